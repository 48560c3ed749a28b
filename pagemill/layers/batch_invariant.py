"""Batch-invariant linear layers (`batch_invariant=True`): every row's outputs are summed in one fixed order, whatever
the other rows, so a request's hidden states and logits do not depend on the batch it runs in.

The default paths choose a kernel by the number of rows M, and the kernels round differently: the records GEMV's
direct path up to 16 rows, its fp32 panels above; MKL's sgemm (F.linear) for float weights
computes a row one way at M = 1, another at M = 2-3, and the last M mod 4 rows of a small M another. Here every
layer takes the weight-streaming kernels' direct path for any M (csrc/cpu/variant/gemv.cpp, `direct_only`): rows in
chunks of 16, each row summed per k block into its own accumulators, so its result depends on neither M nor its
place among the rows:

- records (GGUF blocks, int8 / int4 weight-only): gemv_records / gemv_int8 on the layer's own records;
- float32 weights: gemv_f32 on a copy packed in tiles of 64 output channels (k blocks at fixed offsets).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagemill.layers.quantization.base import LinearMethodBase
from pagemill.layers.quantization.dense import UnquantizedLinearMethod
from pagemill.layers.quantization.records import RecordsLinearMethod

if TYPE_CHECKING:
    from pagemill.kernels.ops import TorchLayerOps

GEMV_TILE = 64  # output channels per packed tile (gemv.cpp's NT)

Apply = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def make_batch_invariant(model: nn.Module, ops: TorchLayerOps) -> int:
    """Give every linear layer of `model` (LM head included) its fixed-order matmul; returns how many. Raises a
    ValueError for a layer it has none for (MoE experts, an unknown linear method)."""
    from pagemill.layers.fused_moe import FusedMoE

    count = 0
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            raise ValueError(f"batch_invariant=True does not cover mixture-of-experts layers yet ({name}): their "
                             "experts' GEMMs take as many rows as the batch routes to them.")
        method = getattr(module, "quant_method", None)
        if not isinstance(method, LinearMethodBase):
            continue
        apply = fixed_order_apply(method, module, ops, name)
        # Layers call method.apply (through a bound partial set at load, or directly: the LM head, LoRA wrappers).
        method.apply = apply
        if isinstance(module.__dict__.get("forward"), functools.partial):
            module.forward = functools.partial(apply, module)
        count += 1
    return count


def fixed_order_apply(method: LinearMethodBase, layer: nn.Module, ops: TorchLayerOps, name: str = "") -> Apply:
    """The batch-invariant replacement of `method.apply` for `layer` (packing what it reads)."""
    if isinstance(method, RecordsLinearMethod):
        return _records_apply(method)
    if isinstance(method, UnquantizedLinearMethod) and method.input_dtype == torch.float32:
        weight = method.dequantized_weight(layer)
        layer.invariant_weight = pack_f32_tiles(weight.float())
        return _dense_apply(ops, layer.invariant_weight, weight.shape[0])
    raise ValueError(f"batch_invariant=True has no fixed-order matmul for {type(method).__name__} "
                     f"({method.weight_format}) in layer {name!r}; it needs float32 or GGUF / int8 / int4 weights.")


def _records_apply(method: RecordsLinearMethod) -> Apply:
    def apply(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return method.matmul(layer, x.to(method.input_dtype), direct_only=True)

    return apply


def _dense_apply(ops: TorchLayerOps, packed: torch.Tensor, out_features: int) -> Apply:
    def apply(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
        ops.gemv_f32(out, x.to(torch.float32).contiguous(), packed, layer.bias)
        return out

    return apply


def pack_f32_tiles(weight: torch.Tensor) -> torch.Tensor:
    """gemv_f32's layout of a float32 weight [N, K]: [ceil(N / 64), K, 64], channels past N zero."""
    n, k = weight.shape
    tiles = -(-n // GEMV_TILE)
    padded = weight.new_zeros(tiles * GEMV_TILE, k)
    padded[:n] = weight
    return padded.view(tiles, GEMV_TILE, k).transpose(1, 2).contiguous()
