"""The LM head for greedy rows: int8 logits screened, then every token that could be a row's maximum recomputed
exactly in float32 (csrc/variant/head_screen.cpp has the bound). The argmax is float32's, bit for bit in which token
wins; the other logits are approximate, so only rows that need nothing but the argmax may use it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# Fewer greedy rows than this take the exact head when it streams quantized records (a Q8_0 table: at 1-3 rows both
# read the same int8 bytes from memory and the screen only adds its recheck). A float head (4 bytes per weight, or 2)
# takes the screen from one row: its int8 codes are a quarter of the bytes.
HEAD_SCREEN_MIN_ROWS = 4


class GreedyHeadScreen:
    """int8 screen of an LM head's float32 table [vocab, hidden] (VNNI / AVX2 int8 dot products)."""

    def __init__(self, table: torch.Tensor, kernels: Any, min_rows: int = HEAD_SCREEN_MIN_ROWS) -> None:
        self.table, self.kernels = table, kernels
        self.min_rows = min_rows  # fewer greedy rows take the exact head
        self.q, self.scales, self.offsets, self.weight_error, self.weight_norm = kernels.pack_head_screen(table)
        self.recomputed = 0  # logits recomputed exactly so far (a statistic: a few per row)
        self.rows = 0

    @classmethod
    def for_head(cls, head: nn.Module, kernels: Any) -> "GreedyHeadScreen | None":
        """A screen of the head's float32 table (its own weight or the tied embedding's), or None when it has none
        (e.g. a float16 head, or a quantized head kept only in its records and oneDNN copy)."""
        table = getattr(head, "weight", None)
        if (kernels is None or getattr(head, "tp_size", 1) != 1 or not hasattr(kernels, "head_screen") or not isinstance(table, torch.Tensor)
                or table.dtype != torch.float32 or table.dim() != 2 or not table.is_contiguous()
                or table.shape[1] % 32 or getattr(head, "bias", None) is not None):
            return None
        return cls(table, kernels, HEAD_SCREEN_MIN_ROWS if getattr(head, "gemv_records", None) is not None else 1)

    @property
    def nbytes(self) -> int:
        """Bytes the screen adds to the head (its int8 codes, scales and offsets)."""
        return sum(t.numel() * t.element_size() for t in (self.q, self.scales, self.offsets))

    def logits(self, hidden: torch.Tensor, bitmask: torch.Tensor | None = None,
               mask_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """[rows, hidden] -> (float32 logits [rows, vocab] whose row maxima are exactly float32's, the rows' argmax
        tokens [rows] (int64; the first maximum, as torch's max)).

        With a structured-output `bitmask` (int32 [R, ceil(vocab / 32)], bit set = allowed) and `mask_rows` (int64
        [rows]: the bitmask row of each row, -1 for none), a masked row's maximum and argmax are over its allowed
        tokens: the argmax of the float32 logits with the disallowed ones at -inf (its other entries stay
        approximate, the disallowed ones unmasked)."""
        x = hidden.to(torch.float32).contiguous()
        out = torch.empty(x.shape[0], self.table.shape[0], dtype=torch.float32)
        tokens = torch.empty(x.shape[0], dtype=torch.int64)
        self.recomputed += self.kernels.head_screen(out, x, self.q, self.scales, self.offsets, self.table,
                                                    self.weight_error, self.weight_norm, tokens, bitmask, mask_rows)
        self.rows += x.shape[0]
        return out, tokens
