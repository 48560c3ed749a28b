"""Quantized checkpoints (GPTQ, AWQ, compressed-tensors, FP8): their `quantization_config` checked field by field,
and each linear's stored tensors decoded into integer codes with per-group scales and zero points.

Layouts (the published packers'):
- gptq (AutoGPTQ / GPTQModel): qweight int32 [K / (32 / b), N] packed along K (element j of a word at bits b * j),
  qzeros int32 [K / g, N / (32 / b)] packed along N, scales fp16 [K / g, N], g_idx int32 [K] (input column -> group;
  `desc_act` orders the columns by activation size). w = s * (q - z); the v1 format ("checkpoint_format": "gptq", the
  default) stores z - 1 in qzeros, gptq_v2 stores z.
- awq (AutoAWQ GEMM): qweight int32 [K, N / 8] and qzeros int32 [K / g, N / 8] packed along N in the interleaved order
  [0, 2, 4, 6, 1, 3, 5, 7] (nibble i of word c holds output column 8 c + order[i]), scales fp16 [K / g, N];
  w = s * (q - z).
- compressed-tensors `pack-quantized`: weight_packed int32 [N, K b / 32] packed along K (element j at bits b * j),
  each code stored as q + 2^(b-1) (q signed); weight_scale [N, K / g] (or [N, 1] per channel); asymmetric schemes add
  weight_zero_point, signed codes packed along N (dim 0); weight_g_idx with `actorder`. w = s * (q - zp).
- compressed-tensors `int-quantized`: weight int8 [N, K], weight_scale [N, 1] (per channel) or [N, K / g] or [1]
  (+ weight_zero_point int8 when asymmetric); its input activations int8, dynamic per token.
- fp8 (e4m3) and compressed-tensors `float-quantized`: weight float8_e4m3fn [N, K] with weight_scale (per tensor [1]
  or [], per channel [N, 1]) or weight_scale_inv / a block-strategy weight_scale [ceil(N / bn), ceil(K / bk)]; w = s w8.

Here every integer format becomes `QuantCodes`: unsigned codes uint8 [N, K], scales [N, G], unsigned zero points
[N, G] (w = s (code - zero), group g = K / G), and g_idx where the checkpoint orders groups by activation.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch

CHECKPOINT_METHODS = ("gptq", "awq", "compressed-tensors", "fp8")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8 c + AWQ_ORDER[i]
CT_FORMATS = ("pack-quantized", "int-quantized", "float-quantized")
_LITTLE_ENDIAN = sys.byteorder == "little"
RECORD_GROUP = 32  # the records' block of inputs: group sizes must be a multiple of it


@dataclass
class CheckpointQuant:
    """A checked `quantization_config`: what the checkpoint stores and how each linear is computed."""

    method: str  # gptq | awq | compressed-tensors | fp8
    bits: int = 4
    group_size: int = -1  # inputs per scale; -1: one group per output channel (a whole row)
    symmetric: bool = True
    weight_type: str = "int"  # int | float (fp8 e4m3)
    ct_format: str | None = None  # compressed-tensors' format
    gptq_zero_minus_one: bool = True  # GPTQ v1 stores zero - 1
    activations: str | None = None  # None (float activations) | "int8_token" (dynamic per-token int8, W8A8)
    block: tuple[int, int] | None = None  # fp8 block scales (rows, cols)
    ignore: list[str] = field(default_factory=list)  # compressed-tensors' ignore list (modules left float)

    @property
    def integer(self) -> bool:
        """Integer codes run on the records kernels; fp8 weights are dequantized to the dense float path."""
        return self.weight_type == "int"


def _field(cfg: dict, name: str, prefix: str, default: Any = ..., types: tuple = ()) -> Any:
    if name not in cfg or cfg[name] is None:
        if default is ...:
            raise ValueError(f"{prefix}.{name} is missing from the checkpoint's quantization_config.")
        return default
    value = cfg[name]
    if types and not isinstance(value, types) or (bool not in types and isinstance(value, bool) and int in types):
        raise ValueError(f"{prefix}.{name} must be {' or '.join(t.__name__ for t in types)}, got {value!r}.")
    return value


def _check_group(group: int, prefix: str) -> int:
    if group != -1 and (group <= 0 or group % RECORD_GROUP):
        raise ValueError(f"{prefix}.group_size must be -1 (per channel) or a positive multiple of {RECORD_GROUP}, "
                         f"got {group}.")
    return group


def parse_checkpoint_quant(qc: Any) -> CheckpointQuant:
    """The checkpoint's `quantization_config` (dict or a transformers config object) checked; ValueError naming the
    field for an unknown method or an unsupported value."""
    if hasattr(qc, "to_dict"):
        qc = qc.to_dict()
    if not isinstance(qc, dict):
        raise ValueError(f"quantization_config must be a mapping, got {type(qc).__name__}.")
    p = "quantization_config"
    method = qc.get("quant_method")
    if method not in CHECKPOINT_METHODS:
        raise ValueError(f"{p}.quant_method must be one of {', '.join(CHECKPOINT_METHODS)}, got {method!r}.")
    if method == "gptq":
        bits = _field(qc, "bits", p, types=(int,))
        if bits not in (4, 8):
            raise ValueError(f"{p}.bits must be 4 or 8 for gptq, got {bits!r}.")
        fmt = _field(qc, "checkpoint_format", p, "gptq", (str,))
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"{p}.checkpoint_format must be gptq or gptq_v2, got {fmt!r}.")
        return CheckpointQuant("gptq", bits, _check_group(_field(qc, "group_size", p, -1, (int,)), p),
                               bool(_field(qc, "sym", p, True, (bool,))), gptq_zero_minus_one=fmt == "gptq")
    if method == "awq":
        bits = _field(qc, "bits", p, 4, (int,))
        if bits != 4:
            raise ValueError(f"{p}.bits must be 4 for awq, got {bits!r}.")
        version = str(_field(qc, "version", p, "gemm", (str,))).lower()
        if version != "gemm":
            raise ValueError(f"{p}.version must be 'gemm' (AutoAWQ's GEMM packing), got {version!r}.")
        if not _field(qc, "zero_point", p, True, (bool,)):
            raise ValueError(f"{p}.zero_point must be true for awq (the GEMM packing stores zero points).")
        return CheckpointQuant("awq", 4, _check_group(_field(qc, "group_size", p, 128, (int,)), p), False)
    if method == "fp8":
        fmt = _field(qc, "fmt", p, "e4m3", (str,))
        if fmt != "e4m3":
            raise ValueError(f"{p}.fmt must be 'e4m3', got {fmt!r}.")
        scheme = _field(qc, "activation_scheme", p, "dynamic", (str,))
        if scheme != "dynamic":
            raise ValueError(f"{p}.activation_scheme must be 'dynamic' (static input scales are not supported), "
                             f"got {scheme!r}.")
        block = _field(qc, "weight_block_size", p, None, (list, tuple))
        if block is not None and (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"{p}.weight_block_size must be two positive ints, got {block!r}.")
        return CheckpointQuant("fp8", 8, -1, True, "float", block=tuple(block) if block else None,
                               ignore=list(_field(qc, "ignored_layers", p, [], (list,))))
    return _parse_compressed_tensors(qc, p)


def _parse_compressed_tensors(qc: dict, p: str) -> CheckpointQuant:
    fmt = _field(qc, "format", p, types=(str,))
    if fmt not in CT_FORMATS:
        raise ValueError(f"{p}.format must be one of {', '.join(CT_FORMATS)} for compressed-tensors, got {fmt!r}.")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(f"{p}.quantization_status must be 'compressed', got {status!r}.")
    groups = _field(qc, "config_groups", p, types=(dict,))
    if len(groups) != 1:
        raise ValueError(f"{p}.config_groups must hold one scheme (got {len(groups)}: {', '.join(groups)}).")
    (gname, scheme), = groups.items()
    gp = f"{p}.config_groups.{gname}"
    targets = _field(scheme, "targets", gp, ["Linear"], (list,))
    if targets != ["Linear"]:
        raise ValueError(f"{gp}.targets must be ['Linear'], got {targets!r}.")
    w = _field(scheme, "weights", gp, types=(dict,))
    wp = f"{gp}.weights"
    bits, wtype = _field(w, "num_bits", wp, types=(int,)), _field(w, "type", wp, "int", (str,))
    strategy = _field(w, "strategy", wp, "tensor", (str,))
    if _field(w, "dynamic", wp, False, (bool, str)) is not False:
        raise ValueError(f"{wp}.dynamic must be false (weights quantized once, in the checkpoint).")
    symmetric = bool(_field(w, "symmetric", wp, True, (bool,)))
    group = -1
    if strategy == "group":
        group = _check_group(_field(w, "group_size", wp, types=(int,)), wp)
    elif strategy not in ("channel", "tensor") and not (strategy == "block" and wtype == "float"):
        raise ValueError(f"{wp}.strategy must be channel, group or tensor{' or block' if wtype == 'float' else ''}, "
                         f"got {strategy!r}.")
    block = None
    if strategy == "block":
        bs = _field(w, "block_structure", wp, types=(list,))
        if len(bs) != 2 or not all(isinstance(b, int) and b > 0 for b in bs):
            raise ValueError(f"{wp}.block_structure must be two positive ints, got {bs!r}.")
        block = tuple(bs)
    acts = scheme.get("input_activations")
    ap = f"{gp}.input_activations"
    activations = None
    if fmt == "float-quantized":
        if wtype != "float" or bits != 8:
            raise ValueError(f"{wp}: float-quantized needs type 'float' and num_bits 8 (fp8 e4m3), got {wtype!r} "
                             f"{bits!r}.")
        if acts is not None and not _field(acts, "dynamic", ap, False, (bool, str)):
            raise ValueError(f"{ap}.dynamic must be true (static input scales are not supported).")
        return CheckpointQuant("compressed-tensors", 8, -1, True, "float", fmt, block=block,
                               ignore=list(qc.get("ignore") or []))
    if wtype != "int":
        raise ValueError(f"{wp}.type must be 'int' for {fmt}, got {wtype!r}.")
    if fmt == "pack-quantized":
        if bits not in (4, 8):
            raise ValueError(f"{wp}.num_bits must be 4 or 8 for pack-quantized, got {bits!r}.")
        if acts is not None:
            raise ValueError(f"{ap} must be null for pack-quantized (weight-only W4A16 / W8A16), got {acts!r}.")
    else:  # int-quantized: W8A8
        if bits != 8:
            raise ValueError(f"{wp}.num_bits must be 8 for int-quantized, got {bits!r}.")
        if acts is not None:
            if (_field(acts, "num_bits", ap, 8, (int,)) != 8 or _field(acts, "type", ap, "int", (str,)) != "int"
                    or not _field(acts, "symmetric", ap, True, (bool,))):
                raise ValueError(f"{ap} must be symmetric 8-bit int, got {acts!r}.")
            if _field(acts, "dynamic", ap, False, (bool, str)) is not True or \
                    _field(acts, "strategy", ap, "token", (str,)) != "token":
                raise ValueError(f"{ap} must be dynamic per token (static activation scales are not supported), "
                                 f"got {acts!r}.")
            activations = "int8_token"
    return CheckpointQuant("compressed-tensors", bits, group, symmetric, "int", fmt, activations=activations,
                           ignore=list(qc.get("ignore") or []))


# ---- which tensors a quantized linear stores ------------------------------------------------------------------

def tensor_suffixes(spec: CheckpointQuant) -> tuple[str, tuple[str, ...]]:
    """(the suffix that marks a quantized linear, every suffix its tensors may have)."""
    if spec.method == "gptq":
        return "qweight", ("qweight", "qzeros", "scales", "g_idx")
    if spec.method == "awq":
        return "qweight", ("qweight", "qzeros", "scales")
    if spec.ct_format == "pack-quantized":
        return "weight_packed", ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
    if spec.method == "fp8":
        return "weight_scale" if spec.block is None else "weight_scale_inv", ("weight", "weight_scale",
                                                                               "weight_scale_inv")
    return "weight_scale", ("weight", "weight_scale", "weight_zero_point", "weight_g_idx")


def quantized_prefixes(spec: CheckpointQuant, names: list[str]) -> dict[str, set[str]]:
    """Checkpoint module prefix -> the suffixes it stores, for every quantized linear among the tensor names."""
    marker, suffixes = tensor_suffixes(spec)
    out: dict[str, set[str]] = {}
    for name in names:
        prefix, _, suffix = name.rpartition(".")
        if suffix in suffixes:
            out.setdefault(prefix, set()).add(suffix)
    return {k: v for k, v in out.items() if marker in v}


# ---- decoding -------------------------------------------------------------------------------------------------

@dataclass
class QuantCodes:
    """One quantized linear as stored: w[n, k] = scale[n, k // g] * (codes[n, k] - zeros[n, k // g]) with g = K / G;
    with g_idx, column k is in group g_idx[k] instead (GPTQ desc_act / compressed-tensors actorder)."""

    codes: torch.Tensor  # uint8 [N, K], 0 .. 2^bits - 1
    scale: torch.Tensor  # float [N, G] (the checkpoint's dtype)
    zeros: torch.Tensor  # int16 [N, G], unsigned (2^(bits-1) for symmetric schemes)
    bits: int
    g_idx: torch.Tensor | None = None  # int64 [K]
    activations: str | None = None  # "int8_token": the layer quantizes its input per token (W8A8)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def group(self) -> int:
        return self.codes.shape[1] // self.scale.shape[1]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] (the reference: s * (q - z), exact in float32 for fp16 / bf16 scales)."""
        n, k = self.shape
        if self.g_idx is not None:
            idx = self.g_idx.long()
            return self.scale.float()[:, idx] * (self.codes.float() - self.zeros.float()[:, idx])
        g = self.group
        w = (self.codes.float().view(n, -1, g) - self.zeros.float().unsqueeze(-1)) * self.scale.float().unsqueeze(-1)
        return w.view(n, k)


class LazyQuantWeight:
    """A quantized linear's stored tensors, decoded to QuantCodes only when its records are not cached."""

    def __init__(self, spec: CheckpointQuant, prefix: str, tensors: dict[str, torch.Tensor]) -> None:
        self.spec, self.prefix, self.tensors = spec, prefix, tensors
        self.activations = spec.activations

    @property
    def shape(self) -> tuple[int, int]:
        """(out, in) from the stored shapes, without decoding."""
        t, per = self.tensors, 32 // self.spec.bits
        if self.spec.method == "gptq":
            return t["qweight"].shape[1], t["qweight"].shape[0] * per
        if self.spec.method == "awq":
            return t["qweight"].shape[1] * 8, t["qweight"].shape[0]
        if "weight_shape" in t:
            return tuple(int(v) for v in t["weight_shape"].tolist())
        return tuple(t["weight"].shape)

    def decode(self) -> QuantCodes:
        return decode_linear(self.spec, self.prefix, self.tensors)


def _unpack_rows(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [R, C] packed along the last axis, 32 / bits codes a word (element j at bits b j, or the element
    order[j] there) -> uint8 [R, C * 32 / bits]."""
    per = 32 // bits
    if bits in (4, 8) and _LITTLE_ENDIAN:  # the word's bytes in order: element pairs (4 bits) or elements (8)
        b = packed.to(torch.int32).contiguous().view(torch.uint8)
        codes = b if bits == 8 else torch.stack((b & 15, b >> 4), dim=-1)
        codes = codes.reshape(packed.shape[0], -1, per)
    else:
        shifts = torch.arange(per, dtype=torch.int32) * bits
        codes = ((packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).to(torch.uint8)
    if order is not None:  # codes[..., i] is element order[i]
        codes = codes[..., list(torch.argsort(torch.tensor(order)).tolist())]
    return codes.reshape(packed.shape[0], -1)


def _need(tensors: dict[str, torch.Tensor], name: str, prefix: str) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"{prefix}.{name} is missing from the checkpoint.")
    return tensors[name]


def _shape_check(t: torch.Tensor, shape: tuple[int, ...], what: str) -> torch.Tensor:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{what} has shape {tuple(t.shape)}, expected {tuple(shape)}.")
    return t


def decode_linear(spec: CheckpointQuant, prefix: str, tensors: dict[str, torch.Tensor]) -> QuantCodes | torch.Tensor:
    """A quantized linear's tensors (suffix -> tensor) -> QuantCodes (integer formats) or the float32 weight (fp8)."""
    if spec.method == "gptq":
        return _decode_gptq(spec, prefix, tensors)
    if spec.method == "awq":
        return _decode_awq(spec, prefix, tensors)
    if spec.weight_type == "float":
        return _decode_fp8(spec, prefix, tensors)
    if spec.ct_format == "pack-quantized":
        return _decode_ct_packed(spec, prefix, tensors)
    return _decode_ct_int(spec, prefix, tensors)


def _group_count(k: int, group: int, prefix: str) -> int:
    g = k if group == -1 else group
    if k % g or g % RECORD_GROUP:
        raise ValueError(f"{prefix}: {k} inputs are not a whole number of groups of {g} (a multiple of "
                         f"{RECORD_GROUP} is needed).")
    return k // g


def _decode_gptq(spec: CheckpointQuant, prefix: str, t: dict[str, torch.Tensor]) -> QuantCodes:
    bits, per = spec.bits, 32 // spec.bits
    qweight = _need(t, "qweight", prefix)
    k, n = qweight.shape[0] * per, qweight.shape[1]
    ng = _group_count(k, spec.group_size, prefix)
    codes = _unpack_rows(qweight.t().contiguous(), bits)  # [N, K]
    scales = _shape_check(_need(t, "scales", prefix), (ng, n), f"{prefix}.scales")
    qzeros = _shape_check(_need(t, "qzeros", prefix), (ng, n // per), f"{prefix}.qzeros")
    zeros = _unpack_rows(qzeros, bits).to(torch.int16) + (1 if spec.gptq_zero_minus_one else 0)  # [G, N]
    g_idx = t.get("g_idx")
    if g_idx is not None:
        g_idx = _shape_check(g_idx, (k,), f"{prefix}.g_idx").long()
        if torch.equal(g_idx, torch.arange(k) // (k // ng)):
            g_idx = None  # the plain order: groups already contiguous
    return QuantCodes(codes, scales.t().contiguous(), zeros.t().contiguous(), bits, g_idx)


def _decode_awq(spec: CheckpointQuant, prefix: str, t: dict[str, torch.Tensor]) -> QuantCodes:
    qweight = _need(t, "qweight", prefix)
    k, n = qweight.shape[0], qweight.shape[1] * 8
    ng = _group_count(k, spec.group_size, prefix)
    codes = _unpack_rows(qweight, 4, AWQ_ORDER).t().contiguous()  # [K, N] -> [N, K]
    scales = _shape_check(_need(t, "scales", prefix), (ng, n), f"{prefix}.scales")
    qzeros = _shape_check(_need(t, "qzeros", prefix), (ng, n // 8), f"{prefix}.qzeros")
    zeros = _unpack_rows(qzeros, 4, AWQ_ORDER).to(torch.int16)
    return QuantCodes(codes, scales.t().contiguous(), zeros.t().contiguous(), 4)


def _ct_scale(scale: torch.Tensor, n: int, k: int, group: int, prefix: str) -> torch.Tensor:
    """compressed-tensors' weight_scale as [N, G]: per tensor ([] / [1]), per channel [N, 1], per group."""
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(n, 1).contiguous()
    ng = _group_count(k, group, prefix)
    return _shape_check(scale.reshape(n, -1) if scale.dim() == 1 else scale, (n, ng), f"{prefix}.weight_scale")


def _ct_g_idx(t: dict[str, torch.Tensor], prefix: str, k: int, ng: int) -> torch.Tensor | None:
    g_idx = t.get("weight_g_idx")
    if g_idx is None:
        return None
    g_idx = _shape_check(g_idx, (k,), f"{prefix}.weight_g_idx").long()
    return None if torch.equal(g_idx, torch.arange(k) // (k // ng)) else g_idx


def _decode_ct_packed(spec: CheckpointQuant, prefix: str, t: dict[str, torch.Tensor]) -> QuantCodes:
    bits, half = spec.bits, 1 << (spec.bits - 1)
    packed = _need(t, "weight_packed", prefix)
    n, k = (int(v) for v in _need(t, "weight_shape", prefix).tolist())
    codes = _unpack_rows(packed, bits)[:, :k].contiguous()
    _shape_check(codes, (n, k), f"{prefix}.weight_packed (unpacked)")
    scale = _ct_scale(_need(t, "weight_scale", prefix), n, k, spec.group_size, prefix)
    ng = scale.shape[1]
    if spec.symmetric:
        zeros = torch.full((n, ng), half, dtype=torch.int16)
    else:  # signed zero points packed along the output rows
        zp = _need(t, "weight_zero_point", prefix)
        zp = _unpack_rows(zp.t().contiguous(), bits)[:, :n].t()  # stored + 2^(b-1): the unsigned zero itself
        zeros = _shape_check(zp.to(torch.int16).contiguous(), (n, ng), f"{prefix}.weight_zero_point")
    return QuantCodes(codes, scale, zeros, bits, _ct_g_idx(t, prefix, k, ng))


def _decode_ct_int(spec: CheckpointQuant, prefix: str, t: dict[str, torch.Tensor]) -> QuantCodes:
    weight = _need(t, "weight", prefix)
    if weight.dtype != torch.int8:
        raise ValueError(f"{prefix}.weight must be int8 for int-quantized, got {weight.dtype}.")
    n, k = weight.shape
    scale = _ct_scale(_need(t, "weight_scale", prefix), n, k, spec.group_size, prefix)
    ng = scale.shape[1]
    zeros = torch.full((n, ng), 128, dtype=torch.int16)
    if not spec.symmetric:
        zp = _need(t, "weight_zero_point", prefix)
        zeros = zeros + (zp.reshape(1, 1).expand(n, ng) if zp.numel() == 1 else zp.reshape(n, ng)).to(torch.int16)
    codes = (weight.to(torch.int16) + 128).to(torch.uint8)
    return QuantCodes(codes, scale, zeros, 8, _ct_g_idx(t, prefix, k, ng), spec.activations)


def _decode_fp8(spec: CheckpointQuant, prefix: str, t: dict[str, torch.Tensor]) -> torch.Tensor:
    weight = _need(t, "weight", prefix)
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{prefix}.weight must be float8_e4m3fn, got {weight.dtype}.")
    n, k = weight.shape
    w = weight.float()
    if spec.block is not None:
        scale = t.get("weight_scale_inv", t.get("weight_scale"))
        if scale is None:
            raise ValueError(f"{prefix}.weight_scale_inv is missing from the checkpoint.")
        bn, bk = spec.block
        _shape_check(scale, (-(-n // bn), -(-k // bk)), f"{prefix}.weight_scale_inv")
        full = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        return w.mul_(full)
    scale = _need(t, "weight_scale", prefix).float()
    if scale.numel() == 1:
        return w.mul_(scale.reshape(()))
    return w.mul_(_shape_check(scale.reshape(n, -1), (n, 1), f"{prefix}.weight_scale"))
