"""Exact rejection sampling of speculative drafts (vLLM v1's algorithm), vectorised over the batch.

Each request i proposes k_i draft tokens; the target model scored k_i + 1 positions (one per draft plus the "bonus"
position after the last one). Greedy requests accept the longest prefix that matches the target argmax.

Deterministic drafts (n-gram, suffix, a draft model's greedy drafts, a grammar's forced tokens: q one-hot) are
verified by coupling: every row of a sampled request draws its token from the target p, and drafts are accepted while
they equal the draws. That is exact (a draft x is accepted with probability p(x); a rejected position's draw follows
p without x, the one-hot residual), and a row draws the uniform its position would draw in a plain step, so a seeded
request gets the very tokens it gets without speculation (draws.py).

Probabilistic drafts (draft_probs given) use the general rule: draft j with token x is accepted with probability
min(1, p_j(x) / q_j(x)); at the first rejection a token is drawn from the residual max(p_j - q_j, 0) (renormalised)
and the request stops, otherwise the bonus token is drawn from the last row.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch

from pagemill.sample.draws import ACCEPT_STREAM, SeedPositions, inverse_cdf_sample, row_uniforms

# A residual whose mass is below this is float noise (p == q up to rounding): draw from p instead. A real residual
# this small is rejected into with probability <= RESIDUAL_EPS, so the fallback's bias is at most that.
RESIDUAL_EPS = 1e-6


def rejection_sample(
    draft_token_ids: list[list[int]],
    target_probs: torch.Tensor | None,
    target_argmax: torch.Tensor,
    greedy: Sequence[bool],
    seeds: SeedPositions,
    draft_probs: torch.Tensor | None = None,
) -> list[list[int]]:
    """Per request: its accepted drafts followed by one recovered or bonus token (1 .. k_i + 1 tokens).

    Rows of `target_probs` / `target_argmax` are k_i + 1 per request, request after request; `seeds` maps the rows
    of seeded sampled requests to (seed, output position); `draft_probs` has one row per draft in the same order, or
    is None when every draft was deterministic (one-hot q).
    """
    num_reqs = len(draft_token_ids)
    if num_reqs == 0:
        return []
    if all(greedy):  # the common verify step: a handful of numpy ops instead of ~20 small torch ones
        return greedy_accept(draft_token_ids, target_argmax)
    if target_probs is None:
        raise ValueError("target_probs is required when a request is sampled")
    if draft_probs is None:
        return greedy_accept(draft_token_ids, _row_tokens(draft_token_ids, target_probs, target_argmax, greedy, seeds))
    lens = [len(d) for d in draft_token_ids]
    num_drafts = sum(lens)
    k = torch.tensor(lens, dtype=torch.long)
    starts = k.cumsum(0) - k  # first draft of each request in the flattened drafts
    offsets = starts + torch.arange(num_reqs)  # first target row of each request
    req_of_draft = torch.repeat_interleave(torch.arange(num_reqs), k)
    draft_rows = torch.arange(num_drafts) + req_of_draft  # target row scoring each draft
    drafts = torch.tensor(list(chain.from_iterable(draft_token_ids)), dtype=torch.long)
    greedy_req = torch.tensor(list(greedy), dtype=torch.bool)
    sampled_idx = torch.tensor([i for i, g in enumerate(greedy) if not g], dtype=torch.long)

    accept = drafts == target_argmax[draft_rows]
    if num_drafts > 0:
        p_x = target_probs[draft_rows, drafts]
        q_x = draft_probs[torch.arange(num_drafts), drafts]
        uniforms = _draft_uniforms(draft_rows.tolist(), seeds)
        # u < p / q without the division; strict, so p(x) == 0 is always rejected even when u == 0.
        accept = torch.where(greedy_req[req_of_draft], accept, uniforms * q_x < p_x)

    # Accepted-draft count = length of the all-accepted prefix, read off a padded [B, kmax] layout.
    kmax = max(lens)
    padded = torch.zeros(num_reqs, kmax, dtype=torch.int32)
    padded[req_of_draft, torch.arange(num_drafts) - starts[req_of_draft]] = accept.to(torch.int32)
    num_accepted = padded.cumprod(dim=1).sum(dim=1) if kmax > 0 else torch.zeros(num_reqs, dtype=torch.long)
    final_rows = offsets + num_accepted  # the first rejected draft's row, or the bonus row
    tokens = target_argmax[final_rows].clone()

    rows = final_rows[sampled_idx]
    probs = target_probs[rows]  # advanced indexing copies: [S, V]
    rejected = (num_accepted[sampled_idx] < k[sampled_idx]).nonzero().squeeze(1)
    if rejected.numel() > 0:
        probs[rejected] = _residual(probs[rejected], draft_probs,
                                    starts[sampled_idx[rejected]] + num_accepted[sampled_idx[rejected]])
    # (inverse-CDF draws are scale-free: the residual needs no renormalising)
    tokens[sampled_idx] = inverse_cdf_sample(probs, row_uniforms(rows.tolist(), seeds))

    counts, last = torch.stack([num_accepted, tokens]).tolist()
    return [d[:n] + [t] for d, n, t in zip(draft_token_ids, counts, last)]


def greedy_accept(draft_token_ids: list[list[int]], target_argmax: torch.Tensor) -> list[list[int]]:
    """Greedy verification: per request, the longest prefix of its drafts that matches the target argmax, then the
    argmax at the first mismatch (or the bonus row). Rows of `target_argmax` are k_i + 1 per request, in order."""
    argmax = target_argmax.numpy()
    lens = np.fromiter((len(d) for d in draft_token_ids), dtype=np.int64, count=len(draft_token_ids))
    first_row = np.cumsum(lens + 1) - (lens + 1)
    num_accepted = lens.copy()
    if lens.any():
        req = np.repeat(np.arange(len(lens)), lens)
        pos = np.arange(int(lens.sum())) - (np.cumsum(lens) - lens)[req]  # each draft's index in its request
        drafts = np.fromiter(chain.from_iterable(draft_token_ids), dtype=np.int64, count=len(req))
        wrong = drafts != argmax[first_row[req] + pos]
        np.minimum.at(num_accepted, req[wrong], pos[wrong])  # the first mismatch, or all k_i
    last = argmax[first_row + num_accepted].tolist()
    return [d[:n] + [t] for d, n, t in zip(draft_token_ids, num_accepted.tolist(), last)]


def _residual(probs: torch.Tensor, draft_probs: torch.Tensor, draft_idx: torch.Tensor) -> torch.Tensor:
    """Unnormalised max(p - q, 0) of rejected rows (q: the rejected drafts' distributions); p where it is ~0."""
    residual = (probs - draft_probs[draft_idx]).clamp_(min=0.0)
    empty = residual.sum(dim=1, keepdim=True) <= RESIDUAL_EPS
    return torch.where(empty, probs, residual)


def _row_tokens(draft_token_ids: list[list[int]], target_probs: torch.Tensor, target_argmax: torch.Tensor,
                greedy: Sequence[bool], seeds: SeedPositions) -> torch.Tensor:
    """Every target row's token: the argmax in a greedy request's rows, a draw from p in a sampled request's."""
    rows_per_req = np.fromiter((len(d) + 1 for d in draft_token_ids), dtype=np.int64, count=len(draft_token_ids))
    sampled_rows = np.flatnonzero(np.repeat(~np.asarray(greedy, dtype=bool), rows_per_req))
    probs = target_probs if len(sampled_rows) == len(target_probs) else target_probs[torch.from_numpy(sampled_rows)]
    tokens = target_argmax.clone()
    tokens[torch.from_numpy(sampled_rows)] = inverse_cdf_sample(probs, row_uniforms(sampled_rows.tolist(), seeds))
    return tokens


def _draft_uniforms(draft_rows: list[int], seeds: SeedPositions) -> torch.Tensor:
    """U(0, 1] per draft (its target row's position), on the acceptance stream: a seeded request's keyed by seed."""
    return row_uniforms(draft_rows, seeds, ACCEPT_STREAM)
