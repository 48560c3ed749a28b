"""Linear layers for CPUs: the matmul dtype, prepacked weights, and GGUF weights kept quantized.

- `linear_dtype=float16|bfloat16`: weights and GEMMs in reduced precision, 3-4x faster than float32 from 32
  rows up on AVX512-FP16/BF16 CPUs; the residual stream, norms, attention and sampling stay float32.
- Up to GEMV_MAX_ROWS rows (single streams, small batches; RECORDS_MAX_ROWS for float32 Q4_1 / Q8_0 records), a
  weight-streaming kernel of ours (csrc/variant/gemv.cpp): from a GGUF file it streams the Q4_1 / Q8_0 records as
  stored (0.6-1.1 bytes per weight, the same weight values as the dequantized float32 model), else the fp16 weight.
- More rows: oneDNN with the weight reordered once at load rather than on every call (1.3-1.7x faster).

The GEMV layouts of GGUF weights are built from the file's Q4_1 / Q8_0 blocks by re-arranging bytes
(`pack_q4_1_blocks`, `pack_q8_0_blocks`): the same bytes `pack_gemv_weight_q4` / `pack_gemv_weight_int8` produce
from the dequantized weight, without their per-group fit (~2.5 s for SmolLM2). Weights without blocks still go
through the fit. A layer whose records came from the file and that has a oneDNN copy keeps no plain weight (with
the kernels nothing reads it): `.weight` rebuilds it, bit-identical, for the torch reference path.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagemill.kernels import load_kernels, ops

if TYPE_CHECKING:
    from pagemill.loader.gguf_loader import GGUFBlocks

logger = logging.getLogger(__name__)

LINEAR_DTYPES = ("auto", "float32", "float16", "bfloat16")
QUANTIZATIONS = ("auto", "none", "gguf")
GGUF_BLOCK = 32  # Q4_1 / Q8_0 block length along the input dimension
GEMV_TILE = 64  # output channels per packed GEMV tile (csrc/variant/gemv.cpp)
_EXACT = 1e-6  # a weight "is" Q4_1 / Q8_0 when re-encoding it misses by at most this, relative to its max
# Rows up to which the GEMV beats oneDNN (measured, per token at 8 rows: Q4 GEMV 9.0 ms, oneDNN fp16 13.1,
# oneDNN fp32 29.6; at 16 rows the fp16 GEMM wins, the fp32 one does not).
GEMV_MAX_ROWS = {torch.float16: 8, torch.float32: 16}
# float32 Q4_1 / Q8_0 records: beyond 16 rows the kernels dequantize k blocks into L1 panels (an fp32 GEMM reading
# 0.6-1.1 bytes per weight); measured per token (30 layers + head) on a Zen 5 at 32 / 64 rows: 31 / 55 ms vs
# oneDNN fp32 75 / 125 ms (AVX-512 variant), 69 / 120 ms (AVX2 variant). Larger prefill chunks stay on oneDNN.
RECORDS_MAX_ROWS = 64
_MKLDNN_BATCH_HINT = 32  # oneDNN reorder hint; within 10% of the best layout from 8 to 128 rows


def q8_0_round(weight: torch.Tensor, block: int = GGUF_BLOCK) -> torch.Tensor:
    """The weight re-encoded as GGUF Q8_0 (symmetric int8, one scale per `block` inputs) and decoded again.

    A weight that came from a Q8_0 tensor comes back unchanged (its scale is max|w| / 127 by construction).
    """
    n, k = weight.shape
    w = F.pad(weight.float(), (0, (-k) % block)).view(n, -1, block)
    scale = w.abs().amax(-1, keepdim=True) / 127.0
    q = (w / torch.where(scale > 0, scale, torch.ones_like(scale))).round().clamp(-127, 127)
    return (q * scale).view(n, -1)[:, :k]


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
    """x with zero rows appended up to a whole number of GEMV tiles."""
    pad = (-x.shape[0]) % GEMV_TILE
    return x if pad == 0 else torch.cat((x, x.new_zeros((pad, *x.shape[1:]))))


def pack_q4_1_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """gemv_q4's packed records [T, K/32, 16 * 64 + 256] from GGUF Q4_1 blocks uint8 [N, K/32, 20].

    A block is fp16 d, fp16 m, then 16 bytes whose byte j holds q[j] (low nibble) and q[j + 16] (high); a record
    holds, per tile of 64 channels and group, 16 pair rows (byte c of row i = q[2i] | q[2i + 1] << 4 of channel c),
    then the 64 d, then the 64 m. Padding channels are zeros, as pack_gemv_weight_q4 leaves them.
    """
    b = _pad_rows(blocks)
    n, ng, _ = b.shape
    t = n // GEMV_TILE
    qs = b[..., 4:]
    q = torch.stack((qs & 15, qs >> 4), dim=2).view(n, ng, GGUF_BLOCK)  # q[0..31] in k order
    pairs = q[..., 0::2] | (q[..., 1::2] << 4)  # [N, ng, 16]
    pairs = pairs.view(t, GEMV_TILE, ng, GGUF_BLOCK // 2).permute(0, 2, 3, 1)  # [T, ng, 16, 64]
    dm = b[..., :4].reshape(t, GEMV_TILE, ng, 2, 2).permute(0, 2, 3, 1, 4)  # [T, ng, d|m, 64, 2 bytes]
    return torch.cat((pairs.reshape(t, ng, -1), dm.reshape(t, ng, -1)), dim=2)


def pack_q8_0_blocks(blocks: torch.Tensor) -> list[torch.Tensor]:
    """gemv_int8's [q int8 [T, K, 64], scales fp32 [T, K/32, 64]] from GGUF Q8_0 blocks uint8 [N, K/32, 34].

    pack_gemv_weight_int8(w, 32) takes scale = max|w| / 127 per group, which is the block's d: GGUF's quantizer
    puts +-127 in every non-zero block, and 127 * d (11 significant bits times 7) and its division by 127 are exact
    in fp32. Here the scale is d itself; tests/loader checks the two packings are byte-identical on SmolLM2.
    """
    b = _pad_rows(blocks)
    n, ng, _ = b.shape
    t = n // GEMV_TILE
    q = torch.empty(t, ng * GGUF_BLOCK, GEMV_TILE, dtype=torch.int8)
    q.view(t, ng, GGUF_BLOCK, GEMV_TILE).copy_(b[..., 2:].view(torch.int8).view(t, GEMV_TILE, ng, GGUF_BLOCK)
                                                .permute(0, 2, 3, 1))
    d = b[..., :2].contiguous().view(torch.float16).view(t, GEMV_TILE, ng).transpose(1, 2).float()
    return [q, d.contiguous()]


def unpack_q4_1_records(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """The float32 weight [rows, K] of gemv_q4 records: (d * q) + m, as gguf.quants dequantizes Q4_1."""
    t, ng, _ = packed.shape
    half = GGUF_BLOCK // 2
    pairs = packed[..., :half * GEMV_TILE].view(t, ng, half, GEMV_TILE)
    q = torch.stack((pairs & 15, pairs >> 4), dim=3).view(t, ng, GGUF_BLOCK, GEMV_TILE)  # k = 2i, 2i + 1
    q = q.permute(0, 3, 1, 2).reshape(t * GEMV_TILE, ng, GGUF_BLOCK)[:rows]
    dm = packed[..., half * GEMV_TILE:].contiguous().view(torch.float16).view(t, ng, 2, GEMV_TILE)
    dm = dm.permute(0, 3, 1, 2).reshape(t * GEMV_TILE, ng, 2)[:rows].float()
    w = torch.mul(q, dm[..., 0:1])
    return w.add_(dm[..., 1:2]).view(rows, ng * GGUF_BLOCK)


def unpack_q8_0_tiles(q: torch.Tensor, scales: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The float32 weight [rows, cols] of gemv_int8 tiles: q * scale, as gguf.quants dequantizes Q8_0."""
    t, kp, _ = q.shape
    qr = q.transpose(1, 2).reshape(t * GEMV_TILE, kp // GGUF_BLOCK, GGUF_BLOCK)[:rows]
    sr = scales.transpose(1, 2).reshape(t * GEMV_TILE, -1, 1)[:rows]
    return torch.mul(qr, sr).view(rows, kp)[:, :cols].contiguous()


class ReducedPrecisionLinear(nn.Module):
    """y = x W^T + b computed and returned in `dtype` (the fused ops around it read and write that dtype).

    With quantization="gguf", a weight that is exactly GGUF Q4_1 or Q8_0 (as dequantized from the file) is
    also kept in that form for the few-row GEMV, which then streams 0.625 / 1.06 bytes per weight instead of
    2 (fp16) or 4 (fp32) and still computes with the same weight values. `gguf_blocks` (the file's blocks of
    this weight) lays the records out without fitting and lets the layer drop its plain weight (see `weight`).
    """

    def __init__(self, linear: nn.Linear, dtype: torch.dtype, quantization: str = "none",
                 gguf_blocks: GGUFBlocks | None = None) -> None:
        super().__init__()
        weight = linear.weight.detach()
        # Registered directly: the `weight` property below reads it (and rebuilds it when it was dropped).
        self._parameters["weight"] = nn.Parameter(weight.to(dtype), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(dtype),
                                                                  requires_grad=False)
        self.dtype = dtype
        self.out_features, self.in_features = weight.shape
        self._mkldnn_weight = _mkldnn_pack(self.weight)
        kernels = load_kernels()
        self._gemv_weight = self._gemv_q4 = self._gemv_q8 = None
        self._exact_records = False  # the Q4_1 / Q8_0 records hold exactly the weight (laid out from the file)
        self.weight_format = str(dtype).removeprefix("torch.")
        if kernels is not None and dtype in (torch.float16, torch.float32):
            if quantization == "gguf":
                self._pack_gguf(kernels, weight, gguf_blocks)
            if self.weight_format not in ("q4_1", "q8_0") and dtype == torch.float16:
                self._gemv_weight = kernels.pack_gemv_weight_f16(self.weight)
        self._gemv_bias = None if self.bias is None else self.bias.float()
        self._gemv_max_rows = GEMV_MAX_ROWS.get(dtype, 0)
        if dtype == torch.float32 and self.weight_format in ("q4_1", "q8_0"):
            self._gemv_max_rows = RECORDS_MAX_ROWS
        if self._exact_records and self._mkldnn_weight is not None:
            # With the kernels, every matmul reads the records (<= _gemv_max_rows rows) or the oneDNN copy, so the
            # plain weight (a third copy, 4 bytes per weight in float32) is dropped; the torch reference path
            # rebuilds it from the records (bit-identical) the first time it runs.
            del self._parameters["weight"]

    @property
    def weight(self) -> nn.Parameter:
        """The weight [out, in] in `dtype`, as F.linear takes it."""
        w = self._parameters.get("weight")
        if w is None:
            w = nn.Parameter(self._decode_records().to(self.dtype), requires_grad=False)
            self._parameters["weight"] = w  # kept: the reference path is used for whole runs
        return w

    def _decode_records(self) -> torch.Tensor:
        if self._gemv_q4 is not None:
            return unpack_q4_1_records(self._gemv_q4, self.out_features)
        return unpack_q8_0_tiles(*self._gemv_q8, self.out_features, self.in_features)

    def _pack_gguf(self, kernels, weight: torch.Tensor, gguf_blocks: GGUFBlocks | None = None) -> None:
        """Keep the weight as Q4_1 or Q8_0 records for the GEMV when it is exactly one of them.

        With the file's blocks for a float32 weight (dequantized from them: the same values), their bytes are laid
        out directly; otherwise the weight is fitted.
        """
        if gguf_blocks is not None and weight.dtype == torch.float32:
            if tuple(gguf_blocks.shape[:2]) == (weight.shape[0], weight.shape[1] // GGUF_BLOCK):
                if gguf_blocks.format == "q4_1":
                    self._gemv_q4, self.weight_format = pack_q4_1_blocks(gguf_blocks.blocks), "q4_1"
                else:
                    self._gemv_q8, self.weight_format = pack_q8_0_blocks(gguf_blocks.blocks), "q8_0"
                self._exact_records = True
                return
        tolerance = _EXACT * float(weight.abs().max())
        if weight.shape[1] % GGUF_BLOCK == 0:
            packed, err = kernels.pack_gemv_weight_q4(weight.float(), GGUF_BLOCK)
            if float(err) <= tolerance:
                self._gemv_q4, self.weight_format = packed, "q4_1"
                return
        if float((q8_0_round(weight) - weight).abs().max()) <= tolerance:
            self._gemv_q8, self.weight_format = kernels.pack_gemv_weight_int8(weight.float(), GGUF_BLOCK), "q8_0"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        kernels = ops.kernels()
        if kernels is None:  # the reference path
            return F.linear(x, self.weight, self.bias)
        if x.dim() == 2 and x.shape[0] <= self._gemv_max_rows:
            out = torch.empty(x.shape[0], self.out_features, dtype=self.dtype)
            if self._gemv_q4 is not None:
                kernels.gemv_q4(out, x.contiguous(), self._gemv_q4, self._gemv_bias)
                return out
            if self._gemv_q8 is not None:
                kernels.gemv_int8(out, x.contiguous(), *self._gemv_q8, self._gemv_bias)
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


def check_linear_options(linear_dtype: str, quantization: str) -> None:
    """Raise a ValueError naming the field for an unknown linear_dtype or quantization."""
    if linear_dtype not in LINEAR_DTYPES:
        raise ValueError(f"linear_dtype must be one of {', '.join(LINEAR_DTYPES)}, got {linear_dtype!r}.")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}.")


def resolve_quantization(quantization: str, from_gguf: bool) -> str:
    """auto = keep GGUF weights in their quantized form (it changes no weight value), else none."""
    if quantization == "auto":
        return "gguf" if from_gguf else "none"
    return quantization


def convert_linears(model: nn.Module, linear_dtype: str, model_dtype: torch.dtype, quantization: str = "none",
                    gguf_blocks: dict[str, GGUFBlocks] | None = None) -> None:
    """Swap every Linear of the transformer (and the LM head) to `linear_dtype` / quantized matmuls, in place.

    `gguf_blocks`: the GGUF Q4_1 / Q8_0 blocks of weights, by parameter name (e.g. layers.0.mlp.down_proj.weight).
    """
    check_linear_options(linear_dtype, quantization)
    dtype = model_dtype if linear_dtype == "auto" else getattr(torch, linear_dtype)
    if dtype == model_dtype and quantization == "none":
        return
    blocks = gguf_blocks or {}
    # Parents only: a list holding the Linears themselves would keep every replaced weight alive to the end.
    parents = [(prefix, module) for prefix, module in model.named_modules() if not isinstance(module, nn.Linear)]
    for prefix, module in parents:
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                param = f"{prefix}.{name}.weight" if prefix else f"{name}.weight"
                setattr(module, name, ReducedPrecisionLinear(child, dtype, quantization, blocks.get(param)))
                _release(blocks.get(param))
    if getattr(model, "lm_head", None) is None and hasattr(model, "embed_tokens"):
        model.lm_head = ReducedPrecisionLinear(_as_linear(model.embed_tokens.weight), dtype, quantization,
                                               blocks.get("embed_tokens.weight"))
        _release(blocks.get("embed_tokens.weight"))


def _release(gguf_blocks: GGUFBlocks | None) -> None:
    """Packed (or not needed): the blocks' file pages may leave the resident set (peak memory of a load)."""
    if gguf_blocks is not None:
        gguf_blocks.release()


def _as_linear(weight: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    lin.weight = nn.Parameter(weight.detach(), requires_grad=False)
    return lin
