"""Reduced-precision matmuls: Linear layers whose weights and GEMMs run in float16/bfloat16.

On AVX512-FP16/BF16 CPUs these GEMMs run 3-4x faster than float32 from 32 rows up (measured:
[32x576]x[576x3072] 217 GFLOP/s in fp32, 670 in fp16). The residual stream, norms, attention and
sampling stay in the model dtype; only the matmul inputs and outputs are rounded.

Two prepacked forms of each weight serve the two regimes of a decode step:
- up to GEMV_MAX_ROWS rows (single streams, small batches) a weight-streaming GEMV kernel of ours
  (csrc/gemv.cpp), ~3x faster than oneDNN at one row;
- more rows: oneDNN with the weight reordered once at load (not on every call), 1.3-1.7x faster than F.linear.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from pagemill.kernels import load_kernels, ops

logger = logging.getLogger(__name__)

LINEAR_DTYPES = ("auto", "float32", "float16", "bfloat16")
QUANTIZATIONS = ("none", "int8")
INT8_GROUP_SIZE = 64  # int8 scales per output channel per 64 inputs (divides every SmolLM2/Llama width)
GEMV_MAX_ROWS = 8  # measured crossover vs oneDNN fp16: ~10-12 rows for the layer matrices
_MKLDNN_BATCH_HINT = 32  # oneDNN reorder hint; within 10% of the best layout from 8 to 128 rows


def fake_quantize_int8(weight: torch.Tensor, group_size: int = INT8_GROUP_SIZE) -> torch.Tensor:
    """The weight rounded to symmetric int8 with one scale per output channel per `group_size` inputs.

    Same grid as the int8 GEMV packer, so every path of a quantized layer computes with the same weights.
    """
    n, k = weight.shape
    g = min(group_size, k)
    pad = (-k) % g
    w = F.pad(weight.float(), (0, pad)).view(n, -1, g)
    scale = w.abs().amax(-1, keepdim=True) / 127.0
    q = (w / torch.where(scale > 0, scale, torch.ones_like(scale))).round().clamp(-127, 127)
    return (q * scale).view(n, -1)[:, :k].contiguous()


class ReducedPrecisionLinear(nn.Module):
    """y = x W^T + b computed and returned in `dtype` (the fused ops around it read and write that dtype).

    With quantization="int8" the weight is rounded to int8 (per-group scales): the GEMV streams the int8
    codes (a quarter of fp32's bytes), larger batches run oneDNN on the same values in `dtype`.
    """

    def __init__(self, linear: nn.Linear, dtype: torch.dtype, quantization: str = "none") -> None:
        super().__init__()
        weight = linear.weight.detach()
        if quantization == "int8":
            weight = fake_quantize_int8(weight)
        self.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(dtype),
                                                                  requires_grad=False)
        self.dtype = dtype
        self.out_features = self.weight.shape[0]
        self._mkldnn_weight = _mkldnn_pack(self.weight)
        kernels = load_kernels()
        self._gemv_weight = self._gemv_int8 = None
        if kernels is not None and quantization == "int8" and dtype in (torch.float16, torch.float32):
            self._gemv_int8 = kernels.pack_gemv_weight_int8(weight, INT8_GROUP_SIZE)
        elif kernels is not None and dtype == torch.float16:
            self._gemv_weight = kernels.pack_gemv_weight_f16(self.weight)
        self._gemv_bias = None if self.bias is None else self.bias.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        kernels = ops.kernels()
        if kernels is None:  # the reference path
            return F.linear(x, self.weight, self.bias)
        if x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS:
            out = torch.empty(x.shape[0], self.out_features, dtype=self.dtype)
            if self._gemv_int8 is not None:
                kernels.gemv_int8(out, x.contiguous(), *self._gemv_int8, self._gemv_bias)
                return out
            if self._gemv_weight is not None:
                kernels.gemv_f16(out, x.contiguous(), self._gemv_weight, self._gemv_bias)
                return out
        if self._mkldnn_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._mkldnn_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _mkldnn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight reordered into oneDNN's blocked layout, or None where oneDNN is unavailable."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, _MKLDNN_BATCH_HINT)
    except RuntimeError as e:
        logger.warning("oneDNN weight prepacking failed (%s); using F.linear.", e)
        return None


def resolve_linear_dtype(linear_dtype: str, quantization: str, model_dtype: torch.dtype) -> torch.dtype:
    """The matmul dtype: as asked, else float16 for int8 weights (its GEMMs are fastest), else the model's."""
    if linear_dtype not in LINEAR_DTYPES:
        raise ValueError(f"linear_dtype must be one of {', '.join(LINEAR_DTYPES)}, got {linear_dtype!r}.")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}.")
    if linear_dtype == "auto":
        return torch.float16 if quantization == "int8" else model_dtype
    return getattr(torch, linear_dtype)


def convert_linears(model: nn.Module, linear_dtype: str, model_dtype: torch.dtype, quantization: str = "none") -> None:
    """Swap every Linear of the transformer (and the LM head) to `linear_dtype` / quantized matmuls, in place."""
    dtype = resolve_linear_dtype(linear_dtype, quantization, model_dtype)
    if dtype == model_dtype and quantization == "none":
        return
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, ReducedPrecisionLinear(child, dtype, quantization))
    if getattr(model, "lm_head", None) is None and hasattr(model, "embed_tokens"):
        model.lm_head = ReducedPrecisionLinear(_as_linear(model.embed_tokens.weight), dtype, quantization)


def _as_linear(weight: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    lin.weight = nn.Parameter(weight.detach(), requires_grad=False)
    return lin
