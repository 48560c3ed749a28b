"""Linear methods for float weights: plain float32 F.linear, and reduced-precision / prepacked oneDNN matmuls.

- `UnquantizedLinearMethod`: the weight in the model dtype and F.linear, exactly what HF transformers computes.
- `PrepackedLinearMethod`: the weight in the matmul dtype (float16/bfloat16 GEMMs are 3-4x faster than float32
  from 32 rows up on AVX512-FP16/BF16 CPUs) reordered once into oneDNN's blocked layout (1.3-1.7x faster than
  F.linear, which reorders on every call); float16 weights also get the GEMV kernel up to 8 rows.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pagemill.layers.quantization.base import LinearMethodBase, QuantConfig, copy_into
from pagemill.layers.quantization.half_tiles import HALF_KINDS, HalfTilesLinearMethod

if TYPE_CHECKING:
    from pagemill.kernels.ops import TorchLayerOps
    from pagemill.layers.quantization.records_cache import RecordsCache

logger = logging.getLogger(__name__)

_MKLDNN_BATCH_HINT = 32  # oneDNN reorder hint; within 10% of the best layout from 8 to 128 rows
# Rows up to which the fp16 GEMV kernel beats oneDNN (measured per token at 8 rows: fp16 GEMV 9.0 ms vs oneDNN
# fp16 13.1; at 16 rows the fp16 GEMM wins).
F16_GEMV_MAX_ROWS = 8


class UnquantizedLinearMethod(LinearMethodBase):
    """W in `dtype`, y = F.linear(x, W, b)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.input_dtype = dtype
        self.weight_format = str(dtype).removeprefix("torch.")

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        """An uninitialised [out, in] weight in the matmul dtype (every row is loaded)."""
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=self.input_dtype),
                                    requires_grad=False)

    def load_weight(self, layer: nn.Module, loaded: Any, row_offset: int, shard_index: int) -> None:
        """Copy (converting) into rows [row_offset, + rows) of the weight."""
        copy_into(layer.weight.narrow(0, row_offset, loaded.shape[0]), loaded)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """F.linear in the weight's dtype."""
        return F.linear(x.to(self.input_dtype), layer.weight, layer.bias)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """The weight itself."""
        return layer.weight


class PrepackedLinearMethod(UnquantizedLinearMethod):
    """W in `dtype`, reordered for oneDNN once at load; float16 W also packed for the few-row GEMV kernel."""

    def __init__(self, dtype: torch.dtype, ops: TorchLayerOps) -> None:
        super().__init__(dtype)
        self.ops = ops

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """The oneDNN copy (and the fp16 GEMV tiles)."""
        layer.mkldnn_weight = mkldnn_pack(layer.weight)
        layer.gemv_weight = None
        if self.input_dtype == torch.float16 and self.ops.linear_kernels:
            layer.gemv_weight = self.ops.pack_gemv_weight_f16(layer.weight)
            layer.gemv_bias = None if layer.bias is None else layer.bias.float()

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The GEMV kernel for few fp16 rows, oneDNN for the rest (F.linear where oneDNN is unavailable)."""
        x = x.to(self.input_dtype)
        if layer.gemv_weight is not None and x.dim() == 2 and x.shape[0] <= F16_GEMV_MAX_ROWS:
            out = torch.empty(x.shape[0], layer.weight.shape[0], dtype=self.input_dtype)
            self.ops.gemv_f16(out, x.contiguous(), layer.gemv_weight, layer.gemv_bias)
            return out
        if layer.mkldnn_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, layer.mkldnn_weight, layer.bias, "none", [], "")
        return F.linear(x, layer.weight, layer.bias)


def mkldnn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight reordered into oneDNN's blocked layout, or None where oneDNN is unavailable."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, _MKLDNN_BATCH_HINT)
    except RuntimeError as e:
        logger.warning("oneDNN weight prepacking failed (%s); using F.linear.", e)
        return None


class DenseQuantConfig(QuantConfig):
    """Float weights for every layer: F.linear in the model dtype, or prepacked in the configured matmul dtype.

    float32 weights of a float32 model keep F.linear (the oracle's own GEMM) unless `prepack` is set (GGUF engines,
    whose records path needs the oneDNN copy beyond the GEMV's rows, set it); prepacking needs the kernels engine.
    A float32 engine with the kernels keeps float16 / bfloat16 checkpoint weights (`tensor_dtypes`: checkpoint name
    -> stored dtype) in their 16 bits, multiplied in float32 (half_tiles.py).
    """

    def __init__(self, linear_dtype: torch.dtype, model_dtype: torch.dtype, ops: TorchLayerOps, prepack: bool = False,
                 int8_activations: bool = False, tensor_dtypes: dict[str, torch.dtype] | None = None,
                 records_cache: RecordsCache | None = None):
        self.linear_dtype, self.model_dtype, self.ops = linear_dtype, model_dtype, ops
        # linear_dtype="int8": the records methods quantize activations to int8 (the dense layers stay float)
        self.int8_activations = int8_activations
        self.prepack = ops.linear_kernels and (prepack or linear_dtype != model_dtype)
        self.tensor_dtypes = tensor_dtypes or {}  # (None: not a float tensor)
        self.keeps_16_bit = ops.linear_kernels and linear_dtype == model_dtype == torch.float32
        # A fused checkpoint tensor (Phi-3's qkv_proj) is not under its layer's shard names: such a layer takes the
        # checkpoint's dtype when every tensor shares one.
        dtypes = set(self.tensor_dtypes.values())
        self.uniform_dtype = dtypes.pop() if len(dtypes) == 1 else None
        self.records_cache = records_cache  # the weight files' records cache: layouts packed by earlier starts

    def get_linear_method(self, checkpoint_names: list[str], in_features: int) -> LinearMethodBase:
        """16-bit tiles for a layer whose checkpoint tensors are all float16 or all bfloat16 (float32 engine with the
        kernels), else the same method for every layer."""
        stored = {self.tensor_dtypes.get(n, self.uniform_dtype) for n in checkpoint_names}
        if self.keeps_16_bit and len(stored) == 1 and next(iter(stored)) in HALF_KINDS:
            method = HalfTilesLinearMethod(next(iter(stored)), self.ops)
            return method.use_cache(self.records_cache, "+".join(checkpoint_names))
        if self.prepack:
            return PrepackedLinearMethod(self.linear_dtype, self.ops)
        return UnquantizedLinearMethod(self.linear_dtype)
