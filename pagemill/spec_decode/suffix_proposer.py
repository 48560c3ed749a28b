"""Suffix decoding (Oliaro et al., "SuffixDecoding"; vLLM's `method="suffix"` through arctic-inference): draft
tokens from suffix trees over the request's own tokens and over recently finished requests' outputs.

Trees. A `_SuffixTree` counts every substring of length <= `suffix_decoding_max_tree_depth` (D) of the sequences
it holds: `count(w)` is the number of positions where `w` occurs. It is a trie, compacted at its frontier:
- a string that occurs at least twice is a node (parallel lists: `count`, `children`, `best`), and so is every
  string that once did and still occurs (a global tree's strings can lose occurrences when a request is evicted);
- a child of a node that occurs once is not a node but a reference (its sequence, the position of its last token)
  stored in the parent's `children` dict as a negative int (~ref), and its descendants are implicit: they follow
  that sequence. So a request whose text never repeats costs one dict entry per (node, token) pair at the frontier,
  not one node per (position, depth).
- `best[node]` is the token of its most frequent child (ties: the smallest token, so a tree depends only on what
  it holds, not on the order it got there), kept up to date on every increment; a decrement of the best child
  (global tree only) marks it unknown (-1) and the next proposal from that node recomputes it.

Updates are incremental: each sequence keeps its "active" nodes, the nodes of its current suffixes of length
0..D-1 (only suffixes that occurred earlier can be nodes, so there are as many as the longest repeated suffix is
long). Appending a token touches only those: O(D) per token, typically far less. Removing a sequence (evicting a
finished request from the global tree) replays its positions and decrements counts, freeing nodes that reach 0:
O(D) per token of the removed sequence.

Proposals. For a match of length m (a suffix of the context present in a tree), the draft follows the most
frequent child from node to node while the estimated probability (the product of child_count / parent_count along
the path) stays >= `suffix_decoding_min_token_prob`, for at most min(max_tokens, floor(max_spec_factor * m), D - m)
tokens (the tree depth bounds match plus draft, as in arctic-inference). Every match length is tried, longest first,
in the request's tree (its active nodes are the matches) and in the global tree (each request keeps its matches
there incrementally too, rebuilt from the last D tokens when the global tree has changed); the draft with the
highest score wins, the score being the sum of the path's probabilities (the expected number of accepted tokens
under the counts). Ties go to the request's tree, then to the longer match. Candidates whose bound
(first step's probability x length limit) cannot beat the best score so far are skipped.

The global tree holds the outputs (tokens after the prompt) of the last `suffix_decoding_max_cached_requests`
finished requests, added on remove_request(finished=True) as far as propose() saw them, oldest evicted first.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from pagemill.config import SpeculativeConfig

_POS_BITS = 32
_POS_MASK = (1 << _POS_BITS) - 1


class _SuffixTree:
    """Depth-limited suffix trie with occurrence counts over one or more token sequences (see the module doc)."""

    __slots__ = ("max_depth", "count", "children", "best", "free", "seqs", "active", "next_seq", "version")

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.count: list[int] = [0]  # node 0 is the root (its count is not kept)
        self.children: list[dict[int, int] | None] = [{}]  # token -> node id (>= 0) or ~reference (< 0)
        self.best: list[int] = [-1]  # token of the most frequent child; -1: no child or unknown
        self.free: list[int] = []
        self.seqs: dict[int, list[int]] = {}
        self.active: dict[int, list[int]] = {}  # seq -> nodes of its suffixes of length 0..D-1 that are nodes
        self.next_seq = 0
        self.version = 0  # bumped on every change a reader's cached match locations may depend on

    def add_sequence(self) -> int:
        """A new empty sequence; returns its id."""
        s = self.next_seq
        self.next_seq += 1
        self.seqs[s] = []
        self.active[s] = [0]
        return s

    def finish_sequence(self, s: int) -> None:
        """No more appends to sequence s: drop its active nodes (it can still be removed)."""
        self.active.pop(s, None)

    def num_nodes(self) -> int:
        """Nodes in use (the root included)."""
        return len(self.count) - len(self.free)

    def append(self, s: int, tokens: list[int]) -> None:
        """Append tokens to sequence s, counting every new substring occurrence of length <= max_depth."""
        if not tokens:
            return
        self.version += 1
        seq = self.seqs[s]
        active = self.active[s]
        count, children, best, seqs = self.count, self.children, self.best, self.seqs
        depth_1 = self.max_depth - 1
        base = s << _POS_BITS
        for t in tokens:
            i = len(seq)
            seq.append(t)
            new_active = [0]
            grow = True  # new suffix nodes stay contiguous in length; stop collecting after the first leaf
            # active[k] is the node of the suffix of length k (k <= D-1); its child t is the new suffix of length k+1.
            for k, node in enumerate(active):
                ch = children[node]
                v = ch.get(t)
                if v is None:  # first occurrence of this string: a reference to it
                    ch[t] = ~(base | i)
                    c = 1
                    grow = False
                elif v < 0:  # second occurrence: becomes a node, with the first occurrence's continuation
                    ref = ~v
                    nid = self._new_node()
                    count[nid] = c = 2
                    nch: dict[int, int] = {}
                    children[nid] = nch
                    if k + 2 <= self.max_depth:  # the node's children are within the depth
                        oseq = seqs[ref >> _POS_BITS]
                        op = (ref & _POS_MASK) + 1
                        if op < len(oseq):
                            nt = oseq[op]
                            nch[nt] = ~(ref + 1)
                            best[nid] = nt
                    ch[t] = nid
                    if grow and k < depth_1:
                        new_active.append(nid)
                else:
                    c = count[v] + 1
                    count[v] = c
                    if grow and k < depth_1:
                        new_active.append(v)
                b = best[node]
                if b != t:
                    if b < 0:
                        if len(ch) == 1:
                            best[node] = t
                    else:
                        bv = ch[b]
                        bc = count[bv] if bv >= 0 else 1
                        if c > bc or (c == bc and t < b):
                            best[node] = t
            self.active[s] = active = new_active

    def remove(self, s: int) -> None:
        """Remove sequence s: decrement the counts of all its substring occurrences, freeing what reaches 0."""
        self.version += 1
        seq = self.seqs.pop(s)
        self.active.pop(s, None)
        count, children, best = self.count, self.children, self.best
        n, depth = len(seq), self.max_depth
        for start in range(n):
            node = 0
            for pos in range(start, min(start + depth, n)):
                t = seq[pos]
                ch = children[node]
                v = ch.get(t)
                if v is None:  # cannot happen in a consistent tree
                    break
                if best[node] == t:
                    best[node] = -1  # its count drops: recompute on demand
                if v < 0:  # a reference: the only occurrence, this one
                    del ch[t]
                    break
                c = count[v] - 1
                count[v] = c
                if c == 0:
                    del ch[t]
                    self._free_subtree(v)
                    break
                node = v

    def _new_node(self) -> int:
        if self.free:
            nid = self.free.pop()
            self.best[nid] = -1
            return nid
        self.count.append(0)
        self.children.append(None)
        self.best.append(-1)
        return len(self.count) - 1

    def _free_subtree(self, nid: int) -> None:
        stack = [nid]
        children, count, free = self.children, self.count, self.free
        while stack:
            x = stack.pop()
            ch = children[x]
            if ch:
                stack.extend(v for v in ch.values() if v >= 0)
            children[x] = None
            count[x] = 0
            free.append(x)

    def best_child(self, node: int) -> int:
        """Token of the node's most frequent child (-1 if it has none), recomputing it if unknown."""
        b = self.best[node]
        if b < 0:
            ch = self.children[node]
            if ch:
                count = self.count
                bc = 0
                for tok, v in ch.items():
                    c = count[v] if v >= 0 else 1
                    if c > bc or (c == bc and tok < b):
                        b, bc = tok, c
                self.best[node] = b
        return b

    def step(self, loc: int, t: int) -> int | None:
        """The location after token t from loc (node id or ~reference), None if the tree has no such string."""
        if loc >= 0:
            return self.children[loc].get(t)
        ref = ~loc
        seq = self.seqs[ref >> _POS_BITS]
        p = (ref & _POS_MASK) + 1
        if p < len(seq) and seq[p] == t:
            return ~(ref + 1)
        return None

    def speculate(self, locs: list[int], max_tokens: int, spec_factor: float, min_prob: float,
                  best_score: float) -> tuple[float, list[int]] | None:
        """The best-scored draft over the match locations locs[m] (m = match length >= 1); None unless its score
        beats best_score."""
        count, children, seqs = self.count, self.children, self.seqs
        depth = self.max_depth
        result = None
        for m in range(len(locs) - 1, 0, -1):
            limit = min(max_tokens, int(spec_factor * m + 1e-6), depth - m)
            if limit <= best_score:
                continue
            loc = locs[m]
            if loc >= 0:  # bound: no cumulative probability exceeds the first step's
                b = self.best_child(loc)
                if b < 0:
                    continue
                v = children[loc][b]
                if (count[v] if v >= 0 else 1) * limit <= best_score * count[loc]:
                    continue
            prob = 1.0
            score = 0.0
            out: list[int] = []
            while len(out) < limit:
                if loc >= 0:
                    b = self.best_child(loc)
                    if b < 0:
                        break
                    v = children[loc][b]
                    prob *= (count[v] if v >= 0 else 1) / count[loc]
                    if prob < min_prob:
                        break
                    out.append(b)
                    score += prob
                    loc = v
                else:  # one occurrence left: follow its sequence
                    ref = ~loc
                    seq = seqs[ref >> _POS_BITS]
                    p = (ref & _POS_MASK) + 1
                    take = min(limit - len(out), len(seq) - p)
                    if take <= 0:
                        break
                    out.extend(seq[p:p + take])
                    score += prob * take
                    break
            if score > best_score:
                best_score, result = score, (score, out)
        return result


class _RequestState:
    __slots__ = ("tree", "seq", "num_prompt_tokens", "global_locs", "global_version")

    def __init__(self, max_depth: int, num_prompt_tokens: int) -> None:
        self.tree = _SuffixTree(max_depth)
        self.seq = self.tree.add_sequence()
        self.num_prompt_tokens = num_prompt_tokens
        self.global_locs: list[int] = [0]
        self.global_version = -1


class SuffixProposer:
    """Suffix decoding: drafts from a per-request suffix tree and a global tree of recently finished outputs."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.max_depth = config.suffix_decoding_max_tree_depth
        self.max_cached_requests = config.suffix_decoding_max_cached_requests
        self.max_spec_factor = config.suffix_decoding_max_spec_factor
        self.min_token_prob = config.suffix_decoding_min_token_prob
        self.global_tree = _SuffixTree(self.max_depth)
        self._cached: OrderedDict[str, int] = OrderedDict()  # finished req_id -> its sequence in the global tree
        self._requests: dict[str, _RequestState] = {}

    def propose(self, req_id: str, context: np.ndarray, num_prompt_tokens: int, max_tokens: int) -> list[int]:
        """Up to max_tokens draft tokens: the best-scored greedy path after a suffix of context in either tree."""
        state = self._requests.get(req_id)
        n = context.shape[0]
        if state is None or n < len(state.tree.seqs[state.seq]):
            state = self._requests[req_id] = _RequestState(self.max_depth, num_prompt_tokens)
        tree = state.tree
        seq = tree.seqs[state.seq]
        seen = len(seq)
        new = context[seen:].tolist() if n > seen else []
        tree.append(state.seq, new)
        gtree = self.global_tree
        use_global = len(self._cached) > 0
        if use_global:
            self._update_global_locs(state, seq, new)
        if max_tokens <= 0:
            return []
        result = tree.speculate(tree.active[state.seq], max_tokens, self.max_spec_factor, self.min_token_prob, 0.0)
        if use_global:
            g = gtree.speculate(state.global_locs, max_tokens, self.max_spec_factor, self.min_token_prob,
                                result[0] if result is not None else 0.0)
            if g is not None:
                result = g
        return result[1] if result is not None else []

    def _update_global_locs(self, state: _RequestState, seq: list[int], new: list[int]) -> None:
        """Bring the request's match locations in the global tree up to date with its new tokens."""
        gtree = self.global_tree
        depth_1 = self.max_depth - 1
        if state.global_version != gtree.version or len(new) >= depth_1:
            locs = [0]  # the tree changed (or many new tokens): replay the last D-1 tokens
            new = seq[-depth_1:] if depth_1 > 0 else []
            state.global_version = gtree.version
        else:
            locs = state.global_locs
        step = gtree.step
        for t in new:
            nxt = [0]
            for loc in locs[:depth_1]:
                v = step(loc, t)
                if v is None:
                    break
                nxt.append(v)
            locs = nxt
        state.global_locs = locs

    def remove_request(self, req_id: str, finished: bool) -> None:
        """Drop the request's tree; a finished request's output (as far as propose saw it) joins the global tree."""
        state = self._requests.pop(req_id, None)
        if state is None or not finished or self.max_cached_requests <= 0:
            return
        output = state.tree.seqs[state.seq][state.num_prompt_tokens:]
        if not output:
            return
        gtree = self.global_tree
        old = self._cached.pop(req_id, None)
        if old is not None:
            gtree.remove(old)
        s = gtree.add_sequence()
        gtree.append(s, output)
        gtree.finish_sequence(s)
        self._cached[req_id] = s
        while len(self._cached) > self.max_cached_requests:
            _, oldest = self._cached.popitem(last=False)
            gtree.remove(oldest)

    def num_cached_requests(self) -> int:
        """Finished requests whose outputs are in the global tree."""
        return len(self._cached)

    def has_request(self, req_id: str) -> bool:
        """Whether the proposer holds state for req_id."""
        return req_id in self._requests
