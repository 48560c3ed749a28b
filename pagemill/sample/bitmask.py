"""Apply a grammar's token bitmask to logits: disallowed tokens get -inf (compiled kernel, torch fallback)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagemill.kernels.ops import TorchLayerOps

_SHIFTS = torch.arange(32, dtype=torch.int32)


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits[rows[i], t] = -inf where bit t of bitmask[i] is 0 (tokens past the mask's width too). In place."""
    vocab = logits.shape[1]
    bitmask, rows = bitmask.to(logits.device), rows.to(logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> _SHIFTS.to(logits.device)) & 1).reshape(bitmask.shape[0], -1).bool()
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    logits[rows] = logits[rows].masked_fill(~allowed[:, :vocab], float("-inf"))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor,
                        ops: TorchLayerOps | None = None) -> None:
    """Mask logits rows in place with the compiled kernel when the layer ops `ops` have it (float32 rows), else in
    torch."""
    if ops is not None and ops.has_kernel("apply_token_bitmask") and logits.dtype == torch.float32 \
            and logits.is_contiguous():
        ops.apply_token_bitmask(logits, bitmask.contiguous(), rows.to(torch.int64).contiguous())
    else:
        apply_token_bitmask_torch(logits, bitmask, rows)
