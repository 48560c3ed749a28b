"""Per-step sampling parameters as tensors, one row per request being sampled."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingMetadata:
    """Batched sampling state; optional parts are None when no request in the batch uses them."""

    temperature: torch.Tensor  # [S] float32, 1.0 for greedy rows
    greedy_mask: torch.Tensor  # [S] bool
    all_greedy: bool
    top_p: torch.Tensor | None
    top_k: torch.Tensor | None
    min_p: torch.Tensor | None
    seeds: dict[int, tuple[int, int]]  # row -> (seed, output position) of a seeded request's row (draws.py)
    # penalties: [S] tensors plus token-id matrices padded with vocab_size
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    prompt_token_ids: torch.Tensor | None = None
    output_token_ids: torch.Tensor | None = None
    # (row, token ids to forbid) for requests below min_tokens
    min_tokens_blocks: list[tuple[int, list[int]]] | None = None
    max_num_logprobs: int | None = None
    # (row, token ids) sampling may only choose from; (row, token ids, biases) added to logits
    allowed_token_ids: list[tuple[int, list[int]]] | None = None
    logit_bias: list[tuple[int, list[int], list[float]]] | None = None
    # structured output: int32 [R, ceil(V / 32)] allowed-token bits for logits rows `bitmask_rows` [R] (int64)
    token_bitmask: torch.Tensor | None = None
    bitmask_rows: torch.Tensor | None = None
