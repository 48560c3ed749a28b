"""The rejection sampler: greedy prefix matching, exact target distributions (chi-square), seeds, zeros, lengths."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import chain

import pytest
import torch

import pagemill.sample.rejection_sampler as rs_mod
from pagemill.sample.rejection_sampler import rejection_sample
from pagemill.sample.draws import SeedPositions, inverse_cdf_sample, seeded_uniform
from tests.sample.harness import p_value

ORIGINAL_ROW_TOKENS = rs_mod._row_tokens

V = 8
REPS = 100_000  # requests per statistical run, all in one call
PASS = 1e-4  # a correct sampler's p-value (fixed seeds, so deterministic) stays above this
FAIL = 1e-12  # a broken sampler's p-value falls below this

# The target p and the draft q are far apart: q puts its mass where p is small (acceptance sum(min(p, q)) = 0.25).
_P = torch.tensor([0.30, 0.25, 0.18, 0.12, 0.08, 0.04, 0.02, 0.01])
_Q = torch.tensor([0.01, 0.02, 0.03, 0.04, 0.10, 0.20, 0.25, 0.35])
TARGETS = torch.stack([_P, _P.flip(0), _P.roll(3), _P.roll(5)])  # position j's target row (the last one: bonus)
DRAFTS = torch.stack([_Q, _Q.flip(0), _Q.roll(3)])  # draft j's distribution


def _one_hot_rows(tokens: list[int]) -> torch.Tensor:
    """Target rows that are one-hot at `tokens` (a sampled request whose outcome is deterministic)."""
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float()


def _position_counts(outputs: list[list[int]], pos: int) -> torch.Tensor:
    """Counts [V] of the token at `pos` over the outputs that reach it (all earlier tokens were accepted drafts)."""
    toks = torch.tensor([o[pos] for o in outputs if len(o) > pos], dtype=torch.long)
    return torch.bincount(toks, minlength=V).to(torch.float64)


def _spec_run(k: int, one_hot_drafts: list[int] | None = None, seed: int = 0) -> list[list[int]]:
    """REPS sampled requests of k drafts over the fixed rows, in one call: drafts drawn from DRAFTS (draft_probs given),
    or the fixed `one_hot_drafts` (draft_probs None)."""
    gen = torch.Generator().manual_seed(seed + 1)
    if one_hot_drafts is None:
        drafts = torch.stack([torch.multinomial(DRAFTS[j], REPS, replacement=True, generator=gen) for j in range(k)], 1)
        draft_ids, draft_probs = drafts.tolist(), DRAFTS[:k].repeat(REPS, 1)
    else:
        draft_ids, draft_probs = [list(one_hot_drafts)] * REPS, None
    target = TARGETS[:k + 1].repeat(REPS, 1)
    torch.manual_seed(seed)
    return rejection_sample(draft_ids, target, target.argmax(dim=1), [False] * REPS, {}, draft_probs)


def _p_values(outputs: list[list[int]], k: int) -> list[float]:
    """Chi-square p-value of each position 0 .. k against its target row (given that the position is reached)."""
    return [p_value(_position_counts(outputs, j), TARGETS[j].double()) for j in range(k + 1)]


def _zero_uniforms(draft_rows: list[int], seeds: SeedPositions) -> torch.Tensor:
    """Broken: u = 0 accepts every draft with p(x) > 0."""
    return torch.zeros(len(draft_rows))


def _p_residual(probs: torch.Tensor, draft_probs: torch.Tensor, draft_idx: torch.Tensor) -> torch.Tensor:
    """Broken: the recovered token is drawn from p, not from the residual max(p - q, 0)."""
    return probs


def _independent_row_tokens(draft_token_ids: list[list[int]], target_probs: torch.Tensor,
                            target_argmax: torch.Tensor, greedy: Sequence[bool], seeds: SeedPositions) -> torch.Tensor:
    """Broken coupling: a draft is accepted with probability p(x), but the token after a rejection is a fresh draw
    from p (which can be the rejected draft itself) instead of the draw that rejected it."""
    tokens = ORIGINAL_ROW_TOKENS(draft_token_ids, target_probs, target_argmax, greedy, seeds)
    fresh = ORIGINAL_ROW_TOKENS(draft_token_ids, target_probs, target_argmax, greedy, seeds)
    drafts = iter(chain.from_iterable(d + [None] for d in draft_token_ids))
    return torch.tensor([f if t != d else t for t, f, d in zip(tokens.tolist(), fresh.tolist(), drafts)])


# --- greedy ---------------------------------------------------------------------------------------------------------

def test_greedy_prefix_mismatch_bonus_and_empty() -> None:
    """Longest matching prefix then the argmax at the mismatch; all matched -> bonus argmax; k = 0 -> bonus only."""
    drafts = [[3, 4, 5], [3, 4, 5], [1], [], [7, 7]]
    argmax = torch.tensor([3, 4, 6, 0,   # mismatch at draft 2 -> 6
                           2, 4, 5, 1,   # mismatch at draft 0 -> 2
                           1, 6,         # all accepted -> bonus 6
                           5,            # k = 0 -> 5
                           7, 7, 3])     # all accepted -> bonus 3
    out = rejection_sample(drafts, None, argmax, [True] * 5, {})
    assert out == [[3, 4, 6], [2], [1, 6], [5], [7, 7, 3]]


def test_all_empty_drafts() -> None:
    """A batch with no drafts at all returns each request's bonus token (greedy and sampled)."""
    probs = _one_hot_rows([2, 5])
    out = rejection_sample([[], []], probs, probs.argmax(dim=1), [True, False], {}, torch.empty(0, V))
    assert out == [[2], [5]]
    assert rejection_sample([], None, torch.empty(0, dtype=torch.long), [], {}) == []


def test_greedy_and_sampled_mixed() -> None:
    """Greedy requests use only the argmax; sampled ones with one-hot targets are deterministic, in one batch."""
    drafts = [[1, 2], [1, 2], [4], [], [6, 6, 6]]
    greedy = [True, False, True, False, False]
    # greedy: argmax [1, 3, x] -> [1, 3]; its probs rows are deliberately different (they must be ignored)
    # sampled one-hot [1, 2, 7] -> both accepted + bonus 7; greedy [4, 0] -> [4, 0]; sampled k = 0 one-hot 3;
    # sampled one-hot [6, 5, ...] -> [6, 5]
    argmax = torch.tensor([1, 3, 0, 1, 2, 7, 4, 0, 3, 6, 5, 6, 6])
    probs = _one_hot_rows([5, 5, 5, 1, 2, 7, 0, 1, 3, 6, 5, 6, 6])
    out = rejection_sample(drafts, probs, argmax, greedy, {})
    assert out == [[1, 3], [1, 2, 7], [4, 0], [3], [6, 5]]


# --- the output distribution is the target's ------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 3])
def test_distribution_matches_target(k: int) -> None:
    """Drafts drawn from q far from p: every position's token (given it is reached) follows its target row."""
    out = _spec_run(k)
    reached = [sum(len(o) > j for o in out) for j in range(k + 1)]
    assert reached[0] == REPS and reached[1] > 0.2 * REPS  # acceptance ~0.25 per draft
    pvals = _p_values(out, k)
    assert min(pvals) > PASS, pvals


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("bug", [_zero_uniforms, _p_residual], ids=["accept_all", "recover_from_p"])
def test_distribution_check_catches_broken_sampler(k: int, bug: Callable[..., torch.Tensor],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The same check fails for a sampler with a classic bug: at position 0, and at position 1 when it is a draft's."""
    name = "_draft_uniforms" if bug is _zero_uniforms else "_residual"
    monkeypatch.setattr(rs_mod, name, bug)
    pvals = _p_values(_spec_run(k), k)
    assert pvals[0] < FAIL and (k == 1 or pvals[1] < FAIL), pvals
    assert min(pvals[k:]) > PASS, pvals  # the bonus position draws from p either way


def test_one_hot_drafts_distribution() -> None:
    """Deterministic drafts (draft_probs None) on unlikely tokens: positions 0 and 1 still follow the target."""
    drafts = [6, 1]  # p0(6) = 0.02, p1(1) = 0.02 (TARGETS[1] is p reversed)
    out = _spec_run(2, one_hot_drafts=drafts)
    pvals = _p_values(out, 2)
    assert min(pvals[:2]) > PASS, pvals
    assert all(o[:len(o) - 1] == drafts[:len(o) - 1] for o in out)


def test_one_hot_drafts_check_catches_p_recovery(monkeypatch: pytest.MonkeyPatch) -> None:
    """Recovering from a fresh draw of p (instead of the draw that rejected the draft) over-weights the draft
    token: detected."""
    monkeypatch.setattr(rs_mod, "_row_tokens", _independent_row_tokens)
    pvals = _p_values(_spec_run(1, one_hot_drafts=[0]), 1)  # p0(0) = 0.3: a large bias
    assert pvals[0] < FAIL, pvals


def test_draft_equal_to_target_accepts_everything() -> None:
    """q == p: min(1, p / q) = 1, every draft is accepted."""
    k, n = 3, 2000
    drafts = torch.stack([torch.multinomial(TARGETS[j], n, replacement=True) for j in range(k)], 1).tolist()
    target = TARGETS.repeat(n, 1)
    out = rejection_sample(drafts, target, target.argmax(dim=1), [False] * n, {}, TARGETS[:k].repeat(n, 1))
    assert all(len(o) == k + 1 and o[:k] == d for o, d in zip(out, drafts))


def test_empty_residual_falls_back_to_target(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rejection whose residual is only rounding noise draws from p (both tokens), not from the noise (token 1)."""
    n = 200
    p = torch.tensor([[0.5, 0.5] + [0.0] * (V - 2)]).repeat(2, 1)
    q = torch.tensor([[0.5 + 2**-22, 0.5 - 2**-22] + [0.0] * (V - 2)])
    monkeypatch.setattr(rs_mod, "_draft_uniforms", lambda rows, seeds: torch.full((len(rows),), 1.0 - 2**-24))
    torch.manual_seed(0)
    out = rejection_sample([[0]] * n, p.repeat(n, 1), torch.zeros(2 * n, dtype=torch.long), [False] * n, {},
                           q.repeat(n, 1))
    assert {o[0] for o in out} == {0, 1} and all(len(o) == 1 for o in out)


# --- zeros in the target (top-k / top-p / masks) --------------------------------------------------------------------

def test_zero_probability_drafts_always_rejected() -> None:
    """A draft with p(x) = 0 is always rejected, and no output token ever has probability zero in its row."""
    n = 20_000
    p = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0, 0.0, 0.0, 0.0])  # as after top-k = 3
    torch.manual_seed(3)
    # one-hot drafts on zero-probability tokens: always rejected, recovered ~ p
    drafts = [[3 + r % 5] for r in range(n)]
    target = p.repeat(2 * n, 1)
    out = rejection_sample(drafts, target, target.argmax(dim=1), [False] * n, {})
    assert all(len(o) == 1 for o in out)
    assert p_value(_position_counts(out, 0), p.double()) > PASS
    # drafts from a uniform q over the whole vocabulary, k = 2, zeros at every position
    q = torch.full((V,), 1.0 / V)
    drafts_t = torch.multinomial(q, 2 * n, replacement=True).view(n, 2)
    target = p.repeat(3 * n, 1)
    out = rejection_sample(drafts_t.tolist(), target, target.argmax(dim=1), [False] * n, {}, q.repeat(2 * n, 1))
    assert all(p[t] > 0 for o in out for t in o)
    assert p_value(_position_counts(out, 0), p.double()) > PASS


# --- seeds ----------------------------------------------------------------------------------------------------------

def _seeded_batch(order: list[int], companions: int, global_seed: int, probabilistic: bool) -> dict[int, list[int]]:
    """Outputs of seeded requests 0..n-1 (seed 100 + i, fixed drafts and rows) placed at `order` among `companions`
    unseeded sampled requests with other drafts; one-hot drafts, or drafts with DRAFTS' distributions."""
    torch.manual_seed(global_seed)
    drafts, rows, qs, seeds, owner = [], [], [], {}, {}
    slots = ["seeded"] * len(order) + ["other"] * companions
    perm = torch.randperm(len(slots)).tolist()
    seeded_iter = iter(order)
    for pos in perm:
        if slots[pos] == "seeded":
            i = next(seeded_iter)
            k = 1 + i % 3
            first_row = sum(len(d) + 1 for d in drafts)
            seeds.update({first_row + j: (100 + i, 10 + j) for j in range(k + 1)})
            owner[len(drafts)] = i
            drafts.append([(5 + i + j) % V for j in range(k)])
            rows.append(TARGETS[:k + 1])
            qs.append(DRAFTS[:k])
        else:
            k = int(torch.randint(0, 4, ()).item())
            drafts.append(torch.randint(0, V, (k,)).tolist())
            rows.append(TARGETS[torch.randint(0, 4, (k + 1,))])
            qs.append(DRAFTS[torch.randint(0, 3, (k,))])
    target = torch.cat(rows)
    out = rejection_sample(drafts, target, target.argmax(dim=1), [False] * len(drafts), seeds,
                           torch.cat(qs) if probabilistic else None)
    return {owner[r]: o for r, o in enumerate(out) if r in owner}


@pytest.mark.parametrize("probabilistic", [False, True], ids=["one_hot_drafts", "draft_probs"])
def test_seeded_requests_reproducible_across_batches(probabilistic: bool) -> None:
    """A seeded request's output depends only on its seed and inputs, not on the batch around it or the global RNG."""
    n = 40
    a = _seeded_batch(list(range(n)), companions=30, global_seed=0, probabilistic=probabilistic)
    b = _seeded_batch(list(reversed(range(n))), companions=7, global_seed=1, probabilistic=probabilistic)
    c = _seeded_batch(list(range(n)), companions=0, global_seed=2, probabilistic=probabilistic)
    assert a == b == c
    assert len({tuple(o) for o in a.values()}) > 5  # the seeded outputs are really random, not constant


def test_seeded_one_hot_verification_draws_what_plain_steps_draw() -> None:
    """With deterministic drafts, a seeded request's tokens are those its plain steps would sample at the same
    positions, however many drafts it proposed: speculation does not change a seeded output."""
    for seed in range(30):
        plain = [int(inverse_cdf_sample(TARGETS[j:j + 1], torch.tensor([seeded_uniform(seed, 50 + j)]))[0])
                 for j in range(4)]
        for k in range(4):
            for wrong_at in range(k + 1):  # drafts follow the plain tokens up to `wrong_at`, then differ
                drafts = plain[:wrong_at] + [(t + 1) % V for t in plain[wrong_at:k]]
                seeds = {j: (seed, 50 + j) for j in range(k + 1)}
                out = rejection_sample([drafts], TARGETS[:k + 1], TARGETS[:k + 1].argmax(dim=1), [False], seeds)[0]
                assert out == plain[:len(out)] and len(out) == min(wrong_at, k) + 1


# --- lengths --------------------------------------------------------------------------------------------------------

def test_output_lengths_and_prefixes() -> None:
    """Random mixed batches: 1 .. k_i + 1 tokens, accepted drafts form a prefix, the last token is allowed."""
    gen = torch.Generator().manual_seed(5)
    for trial in range(5):
        n = 300
        ks = torch.randint(0, 6, (n,), generator=gen).tolist()
        greedy = (torch.rand(n, generator=gen) < 0.3).tolist()
        rows = sum(ks) + n
        logits = torch.randn(rows, V, generator=gen) * 2
        logits[torch.rand(rows, V, generator=gen) < 0.3] = float("-inf")  # zeros, as after top-k / top-p
        logits[:, 0] = logits[:, 0].clamp(min=0.0)  # every row keeps some support
        target = logits.softmax(dim=1)
        dprobs = torch.randn(sum(ks), V, generator=gen).softmax(dim=1)
        drafts = torch.multinomial(dprobs, 1, generator=gen).squeeze(1).tolist()
        draft_ids, at = [], 0
        for k in ks:
            draft_ids.append(drafts[at:at + k])
            at += k
        seeds = {row: (row, row) for row in range(0, rows, 7)}
        torch.manual_seed(trial)
        out = rejection_sample(draft_ids, target, target.argmax(dim=1), greedy, seeds,
                               dprobs if trial % 2 else None)
        offset = 0
        for o, d, k, g in zip(out, draft_ids, ks, greedy):
            assert 1 <= len(o) <= k + 1 and o[:-1] == d[:len(o) - 1]
            row = offset + len(o) - 1
            assert target[row, o[-1]] > 0
            if g:
                assert o[-1] == int(target[row].argmax())
            offset += k + 1


def test_all_greedy_fast_path_matches_the_batched_path() -> None:
    """The all-greedy path (numpy) gives what the general path gives the same greedy requests beside a sampled one."""
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        n = int(torch.randint(1, 6, (1,), generator=g))
        drafts = [torch.randint(0, 3, (int(torch.randint(0, 5, (1,), generator=g)),), generator=g).tolist()
                  for _ in range(n)]
        rows = sum(len(d) + 1 for d in drafts)
        argmax = torch.randint(0, 3, (rows,), generator=g)
        fast = rejection_sample(drafts, None, argmax, [True] * n, {})
        # one more request, sampled (one-hot target, no drafts), sends the batch down the general path
        probs = torch.cat([_one_hot_rows(argmax.tolist()), _one_hot_rows([1])])
        general = rejection_sample(drafts + [[]], probs, torch.cat([argmax, torch.tensor([1])]), [True] * n + [False],
                                   {})
        assert fast == general[:n]
        assert general[n] == [1]
