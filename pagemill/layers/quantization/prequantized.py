"""GPTQ / AWQ / compressed-tensors integer weights run on the GGUF records' kernels, re-laid out once at load.

Each linear's codes (checkpoint_formats.QuantCodes: w = s (q - z) per group of g inputs) become, with no float copy:
- 4-bit codes: "q4" records (Q4_1's layout, w = d q + m per 32 inputs): d = s in fp16 (exact for fp16 and, in
  range, bf16 scales; fp32 scales rounded, within 2^-11, as vLLM's fp16 kernels cast them; a scale under fp16's
  normal range, 6e-5, keeps an absolute error under 2^-25 per step), m = -s z rounded to fp16 (exact for symmetric
  schemes, z = 8; otherwise within 2^-11 of |m|, under 1% of a quantization step). 0.625 bytes per weight.
- 8-bit codes: gemv_int8's tiles per 32 inputs, int8 q - 128 with fp32 scale s and min s (128 - z) (exact).
  1.125 bytes per weight (symmetric), 1.25 with mins.
A group of g inputs (g a multiple of 32, or the whole row) repeats its scale over its g / 32 blocks of 32.
Activation order (GPTQ desc_act / compressed-tensors actorder: g_idx) is undone once at load: the weight's input
columns are permuted so each group is contiguous (vLLM's exllama / marlin paths do the same) and apply() gathers the
activation columns in that order. compressed-tensors W8A8 quantizes each token's activations to int8 (dynamic,
symmetric, max|x| / 127) before the int8 weights, as the checkpoint's scheme defines.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagemill.layers.quantization.base import LinearMethodBase, QuantConfig
from pagemill.layers.quantization.checkpoint_formats import (RECORD_GROUP, CheckpointQuant, LazyQuantWeight,
                                                             QuantCodes)
from pagemill.layers.quantization.dense import DenseQuantConfig
from pagemill.layers.quantization.records import RecordsLinearMethod
from pagemill.layers.quantization.gguf_records import GEMV_TILE, Int8Codes, _pad_rows, _tiles
from pagemill.layers.quantization.int8_grid import int8_tiles
from pagemill.layers.quantization.records_cache import RecordsCache

if TYPE_CHECKING:
    from pagemill.kernels.ops import TorchLayerOps


def _contiguous_groups(c: QuantCodes, name: str) -> tuple[QuantCodes, torch.Tensor | None]:
    """The codes with their input columns permuted so every group is contiguous (g_idx sorted), and the permutation
    (None when the order is already plain)."""
    if c.g_idx is None:
        return c, None
    k, ng = c.shape[1], c.scale.shape[1]
    perm = torch.argsort(c.g_idx, stable=True)
    if not torch.equal(c.g_idx[perm], torch.arange(k) // (k // ng)):
        raise ValueError(f"{name}: g_idx does not give every group {k // ng} inputs.")
    return QuantCodes(c.codes[:, perm].contiguous(), c.scale, c.zeros, c.bits, None, c.activations), perm


def _blocks32(c: QuantCodes) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales (float32) and zeros repeated from the checkpoint's groups to blocks of 32 inputs: [N, K / 32]."""
    r = c.group // RECORD_GROUP
    return c.scale.float().repeat_interleave(r, 1), c.zeros.repeat_interleave(r, 1)


def _q4_1_blocks(c: QuantCodes) -> torch.Tensor:
    """GGUF Q4_1 blocks uint8 [N, K / 32, 20] (fp16 d, fp16 m, 16 bytes: low nibbles elements 0..15, high 16..31):
    the reference q4_records is checked against (pack_planes of these blocks)."""
    n, k = c.shape
    d, z = _blocks32(c)
    m = (-(d * z.float())).to(torch.float16)
    q = c.codes.view(n, k // 32, 32)
    qs = q[..., :16] | (q[..., 16:] << 4)
    dm = torch.stack((d.to(torch.float16), m), dim=-1).view(torch.uint8).view(n, k // 32, 4)
    return torch.cat((dm, qs), dim=-1)


def q4_records(parts: list[QuantCodes]) -> torch.Tensor:
    """gemv_records' "q4" records [T, K / 32, 64 * 20] of 4-bit codes, rows in order: per 32 inputs and 64 channels
    the nibble pairs of adjacent codes (16 bytes a channel), then fp16 d = s and m = -s z (what pack_planes makes of
    the same weight's Q4_1 blocks, without the round trip through them)."""
    codes = torch.cat([c.codes for c in parts]) if len(parts) > 1 else parts[0].codes
    n, k = codes.shape
    scales = [_blocks32(c) for c in parts]
    d = torch.cat([s for s, _ in scales])
    m = -(d * torch.cat([z for _, z in scales]).float())
    dm = torch.stack((d.to(torch.float16), m.to(torch.float16)), dim=-1)  # [N, K / 32, 2]
    if not bool(torch.isfinite(dm).all()):
        raise ValueError("4-bit scales (or scale x zero) beyond float16's range (65504): the q4 records hold fp16 "
                         "d and m.")
    pairs = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(n, k // 32, 16)
    t = -(-n // GEMV_TILE)
    body = _tiles(_pad_rows(pairs)).reshape(t, k // 32, -1)
    return torch.cat((body, _tiles(_pad_rows(dm)).contiguous().view(torch.uint8).reshape(t, k // 32, -1)), dim=2)


def _int8_codes(c: QuantCodes) -> Int8Codes:
    """Int8Codes per 32 inputs: q - 2^(bits-1)... as int8 (codes - 128 for 8 bits, the codes for 4), exact mins."""
    d, z = _blocks32(c)
    shift = 128 if c.bits == 8 else 0
    q = (c.codes.to(torch.int16) - shift).to(torch.int8)
    return Int8Codes(q, d.contiguous(), (d * (shift - z.float())).contiguous(), RECORD_GROUP)


class PrequantizedLinearMethod(RecordsLinearMethod):
    """A checkpoint's integer weights (every shard of a fused layer) as q4 records (4-bit) or int8 tiles (8-bit).

    A shard is laid out as it is loaded when every shard of the layer is a whole number of 64-row tiles (real
    models' q / k / v, gate / up): its decoded codes are freed at once and the layer's records are the shards'
    records stacked. Otherwise (small models) the codes wait for process_weights_after_loading."""

    def __init__(self, method: str, bits: int, dtype: torch.dtype, ops: TorchLayerOps,
                 cache: RecordsCache | None = None, cache_key: str = "") -> None:
        super().__init__("q4" if bits == 4 else "int8", method, dtype, ops)
        self.use_cache(cache, cache_key)  # the checkpoint's records cache and this layer's key in it

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        """Room for the shards (nothing is allocated); the layer's cached records, if an earlier start made them."""
        layer.in_features, layer.out_features = in_features, out_features
        layer.quant_parts = {}  # row offset -> (rows, activation order, activations, records or QuantCodes)
        layer.act_perm, layer.act_int8 = None, False
        layer.cached_records = self.cache.lookup(self.cache_key) if self.cache is not None else None

    def load_weight(self, layer: nn.Module, loaded: Any, row_offset: int, shard_index: int) -> None:
        """Undo the shard's activation order; lay it out now if the layer's shards are whole tiles (nothing is
        decoded when the layer's records are cached)."""
        if not isinstance(loaded, (QuantCodes, LazyQuantWeight)):
            raise ValueError(f"expected the {self.weight_format} checkpoint's quantized tensors (qweight / "
                             f"weight_packed ...), got {type(loaded).__name__}")
        if loaded.shape[1] != layer.in_features:
            raise ValueError(f"quantized weight has {loaded.shape[1]} inputs, expected {layer.in_features}")
        if layer.cached_records is not None:
            layer.quant_parts[row_offset] = (loaded.shape[0], None, loaded.activations, None)
            return
        c, perm = _contiguous_groups(loaded.decode() if isinstance(loaded, LazyQuantWeight) else loaded,
                                     self.weight_format)
        whole_tiles = all(s % GEMV_TILE == 0 for s in getattr(layer, "output_sizes", [layer.out_features]))
        layer.quant_parts[row_offset] = (c.shape[0], perm, c.activations, self._lay_out([c]) if whole_tiles else c)

    def _lay_out(self, parts: list[QuantCodes]) -> Any:
        """Records of the codes' rows, in order: q4 records, or int8 tiles [q, scale, min]."""
        if self.records == "q4":
            return q4_records(parts)
        codes = [_int8_codes(c) for c in parts]
        return int8_tiles(Int8Codes(torch.cat([c.q for c in codes]), torch.cat([c.scale for c in codes]),
                                    torch.cat([c.min for c in codes]), RECORD_GROUP))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """The shards' records stacked (or laid out now, together); one activation order for the layer."""
        entries = [e for _, e in sorted(layer.quant_parts.items())]
        rows = sum(e[0] for e in entries)
        if rows != layer.out_features:
            raise ValueError(f"quantized shards cover {rows} of {layer.out_features} rows")
        layer.act_int8 = any(e[2] == "int8_token" for e in entries)
        layer.records_mapped = layer.cached_records is not None  # read-only views of the cache file's map
        if layer.cached_records is not None:
            kind, parts = layer.cached_records
            extra = self.cache.extra(self.cache_key)
            parts = parts if isinstance(parts, list) else [parts]
            layer.act_perm = parts[-1].long() if extra.get("perm") else None
            parts = parts[:-1] if extra.get("perm") else parts
            self.records = kind
            self.set_records(layer, parts[0] if kind == "q4" else parts)
            layer.quant_parts, layer.cached_records = {}, None
            return
        perms = [e[1] for e in entries]
        if any(p is None for p in perms) != all(p is None for p in perms) or any(
                not torch.equal(p, perms[0]) for p in perms if p is not None):
            raise ValueError(f"{self.weight_format}: the shards of a fused layer have different g_idx (activation "
                             "orders); they share one input and must share one order.")
        laid = [e[3] for e in entries]
        if all(isinstance(x, QuantCodes) for x in laid):
            records = self._lay_out(laid)
        elif len(laid) == 1:
            records = laid[0]
        elif self.records == "q4":
            records = torch.cat(laid)
        else:
            records = [torch.cat([x[i] for x in laid]) for i in range(3)]
        if self.records == "int8" and not bool(records[2].any()):
            records = records[:2]  # symmetric: no mins
        layer.act_perm = perms[0]
        if self.cache is not None:  # the activation order is kept beside the records (int32)
            parts = [records] if self.records == "q4" else list(records)
            perm = [] if layer.act_perm is None else [layer.act_perm.to(torch.int32)]
            self.cache.add(self.cache_key, self.records, parts + perm, perm=bool(perm))
        self.set_records(layer, records)
        layer.quant_parts, layer.cached_records = {}, None

    def records_only(self, layer: nn.Module) -> bool:
        """Only without an activation order to undo or W8A8's token quantization."""
        return layer.act_perm is None and not layer.act_int8

    def matmul(self, layer: nn.Module, x: torch.Tensor, direct_only: bool) -> torch.Tensor:
        """Activation columns in the weight's order; W8A8's per-token int8 activations; the records kernels (also
        the batch-invariant path's entry: both steps are per row)."""
        if layer.act_perm is not None:
            x = x.index_select(-1, layer.act_perm)
        if layer.act_int8:
            x = quantize_tokens_int8(x)
        return super().matmul(layer, x, direct_only)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """The float32 weight [out, in] in the checkpoint's column order."""
        w = super().dequantized_weight(layer)
        if layer.act_perm is None:
            return w
        out = torch.empty_like(w)
        out[:, layer.act_perm] = w
        return out


def quantize_tokens_int8(x: torch.Tensor) -> torch.Tensor:
    """Each row of x rounded to its int8 grid (symmetric, scale max|x| / 127; vLLM's dynamic per-token W8A8 input),
    in x's dtype: the products with int8 weights are those of the int8 GEMM."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True).clamp_min(1e-10) / 127
    return (xf / scale).round_().clamp_(-127, 127).mul_(scale).to(x.dtype)


class CheckpointQuantConfig(QuantConfig):
    """A quantized checkpoint's layers: PrequantizedLinearMethod for the linears it stores as integer codes, the
    dense methods elsewhere (float layers such as the LM head, and fp8 weights, dequantized at load)."""

    def __init__(self, spec: CheckpointQuant, quantized: set[str], dense: DenseQuantConfig,
                 records_cache: RecordsCache | None = None) -> None:
        self.spec, self.quantized, self.dense = spec, quantized, dense  # quantized: "prefix.weight" names
        self.records_cache = records_cache  # the layouts of earlier starts (records_cache.py)

    def get_linear_method(self, checkpoint_names: list[str], in_features: int) -> LinearMethodBase:
        if not self.spec.integer:
            return self.dense.get_linear_method(checkpoint_names, in_features)
        hits = [n in self.quantized for n in checkpoint_names]
        if not any(hits):
            return self.dense.get_linear_method(checkpoint_names, in_features)
        if not all(hits):
            raise ValueError(f"the checkpoint quantizes some of the fused weights {checkpoint_names} but not all; "
                             "pagemill fuses them into one layer.")
        method = PrequantizedLinearMethod(self.spec.method, self.spec.bits, self.dense.linear_dtype,
                                          self.dense.ops, self.records_cache, "+".join(checkpoint_names))
        method.int8_activations = self.dense.int8_activations
        return method


def checkpoint_quant_config(spec: CheckpointQuant, quantized: set[str], dense: DenseQuantConfig,
                            records_cache: RecordsCache | None = None) -> QuantConfig:
    """The config for a quantized checkpoint; ValueError naming the option when the engine cannot run its records."""
    if spec.integer:
        if not dense.ops.linear_kernels:
            raise ValueError(f"quantization={spec.method!r} runs pagemill's compiled GEMV kernels, which this engine "
                             "does not use (attention_backend='torch', or the kernels are not built).")
        if dense.linear_dtype not in (torch.float32, torch.float16):
            raise ValueError(f"quantization={spec.method!r} needs float32 or float16 matmuls (the GEMV kernels' "
                             f"inputs); linear_dtype resolves to {str(dense.linear_dtype).removeprefix('torch.')}.")
    return CheckpointQuantConfig(spec, quantized, dense, records_cache)
