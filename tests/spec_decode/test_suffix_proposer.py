"""SuffixProposer: tree counts against brute force, proposals on hand-built contexts, incremental updates equal a
fresh build, the global tree of finished outputs (reuse, eviction), the probability and length limits."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from pagemill.config import SpeculativeConfig
from pagemill.spec_decode.suffix_proposer import SuffixProposer, _SuffixTree


def _config(**kw) -> SpeculativeConfig:
    return SpeculativeConfig(method="suffix", **kw)


def _arr(tokens) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int64)


def _brute_counts(seqs, depth: int) -> Counter:
    c: Counter = Counter()
    for seq in seqs:
        for s in range(len(seq)):
            for n in range(1, min(depth, len(seq) - s) + 1):
                c[tuple(seq[s:s + n])] += 1
    return c


def _tree_counts(tree: _SuffixTree) -> Counter:
    """Every substring count the tree represents: nodes, references and the implicit chains below them."""
    out: Counter = Counter()

    def walk(node: int, prefix: tuple) -> None:
        for t, v in tree.children[node].items():
            p = prefix + (t,)
            if v >= 0:
                assert tree.count[v] > 0
                out[p] += tree.count[v]
                walk(v, p)
            else:
                ref = ~v
                seq, pos = tree.seqs[ref >> 32], ref & 0xFFFFFFFF
                assert seq[pos] == t
                out[p] += 1
                while len(p) < tree.max_depth and pos + 1 < len(seq):
                    pos += 1
                    p = p + (seq[pos],)
                    out[p] += 1

    walk(0, ())
    return out


def test_tree_counts_match_brute_force_with_removal():
    rng = random.Random(0)
    for _ in range(150):
        depth = rng.randint(1, 7)
        tree = _SuffixTree(depth)
        live: dict[int, list[int]] = {}
        for _ in range(rng.randint(1, 6)):
            if live and rng.random() < 0.3:
                s = rng.choice(list(live))
                tree.remove(s)
                del live[s]
            else:
                s = tree.add_sequence()
                seq = [rng.randint(0, 2) for _ in range(rng.randint(0, 25))]
                i = 0
                while i < len(seq):  # appended in chunks of 1 to 4 tokens
                    j = i + rng.randint(1, 4)
                    tree.append(s, seq[i:j])
                    i = j
                tree.finish_sequence(s)
                live[s] = seq
            assert _tree_counts(tree) == _brute_counts(live.values(), depth)
            for node, ch in enumerate(tree.children):  # best child: the largest count, then the smallest token
                if ch:
                    expected = min(ch, key=lambda t: (-(tree.count[ch[t]] if ch[t] >= 0 else 1), t))
                    assert tree.best_child(node) == expected
        for s in list(live):
            tree.remove(s)
        assert tree.num_nodes() == 1 and not tree.children[0]  # everything freed


def test_repeating_context():
    p = SuffixProposer(_config(num_speculative_tokens=8))
    # [1, 2] occurred once before, followed by 3, 9: p(3) = 1/2 (the current [1, 2] has no continuation yet).
    assert p.propose("r", _arr([1, 2, 3, 9, 1, 2]), 3, 8) == [3, 9]
    assert p.propose("r", _arr([1, 2, 3, 9, 1, 2, 3]), 3, 0) == []
    period = [5, 6, 7, 8]
    ctx = period * 6 + [5, 6]
    draft = SuffixProposer(_config()).propose("q", _arr(ctx), 4, 8)
    assert draft == (period * 3)[2:10]


def test_max_spec_factor_and_min_token_prob():
    ctx = _arr([1, 2, 3, 9, 1, 2])
    # Match length 2: at most floor(0.5 * 2) = 1 token.
    assert SuffixProposer(_config(suffix_decoding_max_spec_factor=0.5)).propose("r", ctx, 3, 8) == [3]
    assert SuffixProposer(_config(suffix_decoding_max_spec_factor=0.4)).propose("r", ctx, 3, 8) == []
    assert SuffixProposer(_config(suffix_decoding_min_token_prob=0.6)).propose("r", ctx, 3, 8) == []
    # [1, 2] is followed by 3 twice and 4 once: p(3) = 2/4 at the shortest match, 1/2 at the longer ones.
    ctx = _arr([1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2])
    assert SuffixProposer(_config(suffix_decoding_min_token_prob=0.51)).propose("r", ctx, 3, 8) == []
    # The longest match [1, 2, 3, 1, 2] (p = 1/2) was followed by 4.
    assert SuffixProposer(_config(suffix_decoding_min_token_prob=0.5)).propose("r", ctx, 3, 8) == [4, 1, 2, 3, 1]
    # The tree depth bounds match + draft: depth 3 leaves room for 1 token after a 2-token match.
    assert SuffixProposer(_config(suffix_decoding_max_tree_depth=3)).propose("r", _arr(list(range(10)) * 3), 3, 8) \
        == [0]


def _fresh(cfg: SpeculativeConfig, finished: list[tuple[list[int], int]]) -> SuffixProposer:
    p = SuffixProposer(cfg)
    for i, (tokens, n_prompt) in enumerate(finished):
        p.propose(f"done{i}", _arr(tokens), n_prompt, 1)
        p.remove_request(f"done{i}", finished=True)
    return p


@pytest.mark.parametrize("seed", range(3))
def test_incremental_equals_fresh(seed: int):
    rng = random.Random(seed)
    for _ in range(25):
        cfg = _config(num_speculative_tokens=rng.randint(1, 10), suffix_decoding_max_tree_depth=rng.randint(2, 9),
                      suffix_decoding_max_spec_factor=rng.choice([0.5, 1.0, 2.0]),
                      suffix_decoding_min_token_prob=rng.choice([0.0, 0.1, 0.3]),
                      suffix_decoding_max_cached_requests=rng.randint(1, 3))
        vocab = rng.randint(2, 5)
        finished = [([rng.randrange(vocab) for _ in range(rng.randint(1, 30))], rng.randint(0, 5))
                    for _ in range(rng.randint(0, 3))]
        inc = _fresh(cfg, finished)
        ctx = [rng.randrange(vocab) for _ in range(rng.randint(1, 10))]
        n_prompt = len(ctx)
        for step in range(30):
            k = rng.randint(0, cfg.num_speculative_tokens)
            expected = _fresh(cfg, finished).propose("r", _arr(ctx), n_prompt, k)
            assert inc.propose("r", _arr(ctx), n_prompt, k) == expected
            if rng.random() < 0.1:  # the global tree changes under a running request
                extra = ([rng.randrange(vocab) for _ in range(rng.randint(1, 20))], 0)
                finished.append(extra)
                inc.propose(f"done{len(finished) - 1}", _arr(extra[0]), 0, 1)
                inc.remove_request(f"done{len(finished) - 1}", finished=True)
            ctx += [rng.randrange(vocab) for _ in range(rng.choice([1, 1, 2, 5, 12]))]


def test_global_tree_helps_a_repeating_request():
    rng = np.random.default_rng(0)
    prompt_a, output = rng.integers(1000, 2000, 30), rng.integers(0, 1000, 40)
    p = SuffixProposer(_config())
    p.propose("a", np.concatenate([prompt_a, output]), 30, 8)
    p.remove_request("a", finished=True)
    assert p.num_cached_requests() == 1
    # A new request with another prompt that starts repeating a's output: the global tree drafts the rest.
    ctx_b = np.concatenate([rng.integers(2000, 3000, 20), output[:6]])
    assert p.propose("b", ctx_b, 20, 8) == output[6:12].tolist()  # 6 matched tokens: up to 6 drafted
    assert p.propose("b", np.concatenate([ctx_b, output[6:10]]), 20, 8) == output[10:18].tolist()
    assert SuffixProposer(_config()).propose("b", ctx_b, 20, 8) == []
    # Only the output joins the global tree, not the prompt.
    assert p.propose("c", np.concatenate([rng.integers(2000, 3000, 20), prompt_a[:6]]), 20, 8) == []


def test_eviction_keeps_the_most_recent_finished_requests():
    rng = np.random.default_rng(1)
    p = SuffixProposer(_config(suffix_decoding_max_cached_requests=2))
    outputs = [rng.permutation(100)[:30] + 100 * i for i in range(5)]  # no repeats within one
    for i, out in enumerate(outputs):
        p.propose(f"r{i}", np.concatenate([[7, 7], out]), 2, 8)
        p.remove_request(f"r{i}", finished=True)
        assert p.num_cached_requests() == min(i + 1, 2)
    for i, out in enumerate(outputs):
        draft = p.propose(f"q{i}", np.concatenate([[9000], out[:5]]), 1, 4)
        assert draft == (out[5:9].tolist() if i >= 3 else [])
    # Evicting frees the tree: one more round of different outputs leaves no more nodes than the two kept need.
    nodes = p.global_tree.num_nodes()
    for i, out in enumerate(outputs[:2]):
        p.propose(f"s{i}", np.concatenate([[7, 7], out]), 2, 8)
        p.remove_request(f"s{i}", finished=True)
    assert p.num_cached_requests() == 2
    assert p.global_tree.num_nodes() <= nodes + 5


def test_remove_request_frees_state():
    p = SuffixProposer(_config())
    ctx = _arr([1, 2, 3, 9, 1, 2])
    p.propose("r", ctx, 3, 8)
    assert p.has_request("r")
    p.remove_request("r", finished=False)  # preempted: nothing joins the global tree
    assert not p.has_request("r") and p.num_cached_requests() == 0
    assert p.propose("r", ctx, 3, 8) == [3, 9]  # comes back with the same context: rebuilt
    p.remove_request("r", finished=True)
    assert not p.has_request("r") and p.num_cached_requests() == 1
    p.remove_request("unknown", finished=True)
    assert SuffixProposer(_config(suffix_decoding_max_cached_requests=0)).propose("x", ctx, 3, 8) == [3, 9]
