"""GPTQ / AWQ / compressed-tensors linears decoded from their published layouts and re-laid out as GEMV records: each
computes F.linear on the dequantized weight, on every kernel variant; a bad quantization_config names its field."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagemill.attention.backends.torch_paged import TorchPagedAttention
from pagemill.config import resolve_quantization
from pagemill.kernels.ops import TorchLayerOps
from pagemill.layers.context import LayerContext
from pagemill.layers.linear import ColumnParallelLinear, QKVParallelLinear
from pagemill.layers.quantization.checkpoint_formats import (CheckpointQuant, QuantCodes, decode_linear,
                                                             parse_checkpoint_quant)
from pagemill.layers.quantization.dense import DenseQuantConfig
from pagemill.layers.quantization.prequantized import (CheckpointQuantConfig, PrequantizedLinearMethod,
                                                       quantize_tokens_int8)
from tests.conftest import require_kernel_ops, requires_kernels
from tests.loader.quant_checkpoints import dequantize, pack_awq, pack_gptq, quantize_groups

pytestmark = requires_kernels
NAME = "model.layers.0.mlp.down_proj"


def _context(spec: CheckpointQuant, names: set[str], linear_dtype: torch.dtype = torch.float32) -> LayerContext:
    ops = require_kernel_ops()
    quant = CheckpointQuantConfig(spec, names, DenseQuantConfig(linear_dtype, torch.float32, ops))
    return LayerContext(torch.float32, 256, ops, quant, TorchPagedAttention(), 0, 1)


def _layer(spec: CheckpointQuant, codes: QuantCodes, bias: torch.Tensor | None = None) -> ColumnParallelLinear:
    n, k = codes.shape
    lin = ColumnParallelLinear(k, n, bias is not None, _context(spec, {f"{NAME}.weight"}), NAME)
    assert isinstance(lin.quant_method, PrequantizedLinearMethod)
    lin.load_weight("weight", codes)
    if bias is not None:
        lin.load_weight("bias", bias)
    lin.process_weights_after_loading()
    return lin


def _g_idx(k: int, group: int, desc_act: bool, seed: int = 0) -> torch.Tensor:
    g = k if group == -1 else group
    if not desc_act:
        return torch.arange(k) // g
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    out = torch.empty(k, dtype=torch.long)
    out[perm] = torch.arange(k) // g
    return out


def _check(lin, ref: torch.Tensor, bias: torch.Tensor | None, exact: bool) -> None:
    """dequantized_weight is the reference (exactly, or within fp16 rounding of m = -s z), and every row count of
    the records kernels computes F.linear on it."""
    dq = lin.quant_method.dequantized_weight(lin)
    if exact:
        assert torch.equal(dq, ref)
    else:  # m = -s z rounded to fp16: within 2^-11 |s z| <= 2^-11 * 15 s, under 1% of a step
        torch.testing.assert_close(dq, ref, rtol=0, atol=float(ref.abs().max()) * 2e-3)
    k = ref.shape[1]
    for rows in (1, 5, 16, 17, 64, 200):
        x = torch.randn(rows, k)
        torch.testing.assert_close(lin(x), F.linear(x, dq, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bits,group,sym,desc_act", [(4, 32, True, False), (4, 128, False, True),
                                                     (4, -1, True, True), (4, 64, False, False),
                                                     (8, 128, True, True), (8, 32, False, False)])
def test_gptq_linear(bits, group, sym, desc_act, kernel_isa):
    """AutoGPTQ's packing (v1: zero - 1 in qzeros), 4 / 8 bits, groups 32 / 64 / 128 / -1, act order; 4-bit layers
    are q4 records, 8-bit int8 tiles."""
    torch.manual_seed(0)
    w, b = torch.randn(136, 256), torch.randn(136)  # GPTQ packs qzeros along N: a multiple of 8, not of 64
    g_idx = _g_idx(256, group, desc_act)
    codes, scale, zeros = quantize_groups(w, bits, group, sym, g_idx)
    spec = parse_checkpoint_quant({"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym,
                                   "desc_act": desc_act})
    c = decode_linear(spec, NAME, pack_gptq(codes, scale, zeros, bits, g_idx))
    lin = _layer(spec, c, b)
    assert lin.quant_method.records == ("q4" if bits == 4 else "int8")
    assert (lin.act_perm is not None) == (desc_act and group != -1)  # one group: any order is plain
    _check(lin, dequantize(codes, scale, zeros, g_idx), b, exact=sym or bits == 8)


def test_gptq_v2_zeros():
    """gptq_v2 (GPTQModel) stores the zero points themselves."""
    torch.manual_seed(1)
    w = torch.randn(64, 128)
    codes, scale, zeros = quantize_groups(w, 4, 32, False)
    g_idx = torch.arange(128) // 32
    spec = parse_checkpoint_quant({"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False,
                                   "checkpoint_format": "gptq_v2"})
    c = decode_linear(spec, NAME, pack_gptq(codes, scale, zeros, 4, g_idx, v1=False))
    torch.testing.assert_close(c.dequantize(), dequantize(codes, scale, zeros, g_idx), rtol=0, atol=0)


def test_awq_linear(kernel_isa):
    """AutoAWQ's GEMM packing (interleaved nibbles [0, 2, 4, 6, 1, 3, 5, 7]), group 128, asymmetric."""
    torch.manual_seed(2)
    w = torch.randn(192, 256)
    codes, scale, zeros = quantize_groups(w, 4, 128, False)
    spec = parse_checkpoint_quant({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                   "version": "GEMM"})
    c = decode_linear(spec, NAME, pack_awq(codes, scale, zeros))
    assert torch.equal(c.codes, codes) and torch.equal(c.zeros.long(), zeros.long())
    lin = _layer(spec, c)
    _check(lin, dequantize(codes, scale, zeros, torch.arange(256) // 128), None, exact=False)


@pytest.mark.parametrize("bits,group,sym", [(4, 32, True), (4, 128, False), (8, -1, True), (8, 64, False)])
def test_compressed_tensors_pack_quantized(bits, group, sym, kernel_isa):
    """compressed-tensors' own packer (pack_to_int32) and dequantizer are the layout and the oracle."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    torch.manual_seed(3)
    n, k = 96, 256
    codes, scale, zeros = quantize_groups(torch.randn(n, k), bits, group, sym)
    half = 1 << (bits - 1)
    signed = (codes.to(torch.int16) - half).to(torch.int8)
    tensors = {"weight_packed": pack_to_int32(signed, bits), "weight_shape": torch.tensor([n, k]),
               "weight_scale": scale}
    if not sym:
        tensors["weight_zero_point"] = pack_to_int32((zeros - half).to(torch.int8), bits, packed_dim=0)
    strategy = {"strategy": "channel"} if group == -1 else {"strategy": "group", "group_size": group}
    spec = parse_checkpoint_quant({"quant_method": "compressed-tensors", "format": "pack-quantized",
                                   "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                       "num_bits": bits, "type": "int", "symmetric": sym, **strategy}}}})
    c = decode_linear(spec, NAME, tensors)
    g = k if group == -1 else group
    ref = dequantize(codes, scale, zeros, torch.arange(k) // g)
    assert torch.equal(c.dequantize(), ref)
    _check(_layer(spec, c), ref, None, exact=sym or bits == 8)


def test_compressed_tensors_w8a8_quantizes_each_token(kernel_isa):
    """int-quantized W8A8: int8 weights per channel, each token's activations on its int8 grid (max|x| / 127)."""
    torch.manual_seed(4)
    n, k = 70, 128
    w = torch.randn(n, k)
    scale = (w.abs().amax(1, keepdim=True) / 127).half()
    q = (w / scale.float()).round().clamp(-127, 127).to(torch.int8)
    spec = parse_checkpoint_quant({"quant_method": "compressed-tensors", "format": "int-quantized",
                                   "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                       "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                                       "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                                             "strategy": "token", "dynamic": True}}}})
    lin = _layer(spec, decode_linear(spec, NAME, {"weight": q, "weight_scale": scale}))
    ref = q.float() * scale.float()
    assert torch.equal(lin.quant_method.dequantized_weight(lin), ref) and len(lin.gemv_segments[0].records) == 2
    for rows in (1, 7, 100):
        x = torch.randn(rows, k)
        xs = x.abs().amax(1, keepdim=True) / 127
        xq = (x / xs).round() * xs
        torch.testing.assert_close(quantize_tokens_int8(x), xq)
        torch.testing.assert_close(lin(x), F.linear(xq, ref), rtol=1e-5, atol=1e-4)


def test_fused_layer_shares_one_activation_order():
    """q / k / v shards with one g_idx (GPTQ's act order for one input) run as one layer; different orders are
    refused."""
    spec = parse_checkpoint_quant({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True})
    names = {f"model.layers.0.self_attn.{s}_proj.weight" for s in "qkv"}
    ctx = _context(spec, names)
    torch.manual_seed(5)
    g_idx = _g_idx(64, 32, True)
    shards = {}
    qkv = QKVParallelLinear(64, 16, 4, 2, False, ctx, [f"model.layers.0.self_attn.{s}_proj" for s in "qkv"])
    for s, rows in (("q", 64), ("k", 32), ("v", 32)):
        codes, scale, zeros = quantize_groups(torch.randn(rows, 64), 4, 32, True, g_idx)
        shards[s] = dequantize(codes, scale, zeros, g_idx)
        qkv.load_weight("weight", decode_linear(spec, s, pack_gptq(codes, scale, zeros, 4, g_idx)), s)
    qkv.process_weights_after_loading()
    full = torch.cat(list(shards.values()))
    assert torch.equal(qkv.quant_method.dequantized_weight(qkv), full)
    x = torch.randn(3, 64)
    torch.testing.assert_close(qkv(x), F.linear(x, full), rtol=1e-5, atol=1e-4)
    bad = QKVParallelLinear(64, 16, 4, 2, False, ctx, [f"model.layers.0.self_attn.{s}_proj" for s in "qkv"])
    for i, (s, rows) in enumerate((("q", 64), ("k", 32), ("v", 32))):
        gi = _g_idx(64, 32, True, seed=i)
        codes, scale, zeros = quantize_groups(torch.randn(rows, 64), 4, 32, True, gi)
        bad.load_weight("weight", decode_linear(spec, s, pack_gptq(codes, scale, zeros, 4, gi)), s)
    with pytest.raises(ValueError, match="different g_idx"):
        bad.process_weights_after_loading()


CT = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                       "group_size": 128}}}}


def _ct(**changes):
    import copy

    cfg = copy.deepcopy(CT)
    for path, value in changes.items():
        node = cfg
        *parents, leaf = path.split("__")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return cfg


@pytest.mark.parametrize("config,field", [
    ({"quant_method": "bitsandbytes"}, r"quantization_config\.quant_method must be one of gptq, awq"),
    ({"bits": 4}, r"quantization_config\.quant_method"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, r"quantization_config\.bits must be 4 or 8"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 48}, r"quantization_config\.group_size"),
    ({"quant_method": "gptq", "group_size": 128}, r"quantization_config\.bits is missing"),
    ({"quant_method": "gptq", "bits": "4"}, r"quantization_config\.bits must be int"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, r"quantization_config\.checkpoint_format"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, r"quantization_config\.version"),
    ({"quant_method": "awq", "bits": 4, "zero_point": False}, r"quantization_config\.zero_point"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, r"quantization_config\.activation_scheme"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, r"quantization_config\.weight_block_size"),
    (_ct(format="marlin-24"), r"quantization_config\.format must be one of pack-quantized"),
    (_ct(config_groups__group_0__weights__num_bits=3), r"config_groups\.group_0\.weights\.num_bits"),
    (_ct(config_groups__group_0__weights__strategy="block"), r"config_groups\.group_0\.weights\.strategy"),
    (_ct(config_groups__group_0__input_activations={"num_bits": 8, "type": "int"}),
     r"config_groups\.group_0\.input_activations must be null"),
    (_ct(config_groups__group_1=CT["config_groups"]["group_0"]), r"quantization_config\.config_groups must hold one"),
    (_ct(quantization_status="frozen"), r"quantization_config\.quantization_status"),
])
def test_bad_quantization_config_names_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        parse_checkpoint_quant(config)


def test_quantization_option_must_fit_the_checkpoint():
    """auto runs the checkpoint's method; another choice, or a method without a quantization_config, is refused."""
    assert resolve_quantization("auto", False, "gptq") == "gptq"
    assert resolve_quantization("awq", False, "awq") == "awq"
    with pytest.raises(ValueError, match=r"quantization='none' does not fit.*quant_method='gptq'"):
        resolve_quantization("none", False, "gptq")
    with pytest.raises(ValueError, match=r"quantization='int4' does not fit"):
        resolve_quantization("int4", False, "awq")
    with pytest.raises(ValueError, match=r"quantization='fp8' needs a checkpoint"):
        resolve_quantization("fp8", False, None)
    with pytest.raises(ValueError, match=r"quantization_config\.quant_method must be one of"):
        resolve_quantization("auto", False, "hqq")


@pytest.mark.parametrize("bits", [4, 8])
def test_float16_matmuls_read_the_same_records(bits, kernel_isa):
    """linear_dtype=float16: the records kernels read and return float16, computing with dequantized_weight."""
    torch.manual_seed(6)
    w = torch.randn(72, 128)
    codes, scale, zeros = quantize_groups(w, bits, 64, False)
    spec = parse_checkpoint_quant({"quant_method": "gptq", "bits": bits, "group_size": 64, "sym": False})
    lin = ColumnParallelLinear(128, 72, False, _context(spec, {f"{NAME}.weight"}, torch.float16), NAME)
    lin.load_weight("weight", decode_linear(spec, NAME, pack_gptq(codes, scale, zeros, bits, torch.arange(128) // 64)))
    lin.process_weights_after_loading()
    dq = lin.quant_method.dequantized_weight(lin)
    for rows in (1, 8, 9, 100):
        x = torch.randn(rows, 128).half()
        y, ref = lin(x), F.linear(x.float(), dq)
        assert y.dtype == torch.float16 and (y.float() - ref).abs().max() <= 2e-3 * ref.abs().max()


def test_engine_refuses_what_the_records_cannot_run():
    """The records need the compiled kernels and float32 / float16 matmuls (the field is named)."""
    from pagemill.layers.quantization.prequantized import checkpoint_quant_config

    spec = parse_checkpoint_quant({"quant_method": "awq", "bits": 4, "group_size": 128})
    with pytest.raises(ValueError, match="quantization='awq'.*kernels"):
        checkpoint_quant_config(spec, set(), DenseQuantConfig(torch.float32, torch.float32, TorchLayerOps()))
    with pytest.raises(ValueError, match="linear_dtype resolves to bfloat16"):
        checkpoint_quant_config(spec, set(), DenseQuantConfig(torch.bfloat16, torch.float32, require_kernel_ops()))


def test_q4_records_are_pack_planes_of_the_q4_1_blocks():
    """The direct layout is byte for byte what the GGUF path makes of the same values as Q4_1 blocks (fused parts,
    rows not a multiple of 64)."""
    from pagemill.layers.quantization.gguf_records import pack_planes
    from pagemill.layers.quantization.prequantized import _q4_1_blocks, q4_records

    torch.manual_seed(7)
    parts = []
    for rows, group in ((72, 64), (40, 128)):
        codes, scale, zeros = quantize_groups(torch.randn(rows, 256), 4, group, False)
        parts.append(QuantCodes(codes, scale, zeros.to(torch.int16), 4))
    assert torch.equal(q4_records(parts), pack_planes("q4", [("q4_1", _q4_1_blocks(c)) for c in parts]))


def test_batch_invariant_path_keeps_the_order_and_token_quantization():
    """batch_invariant=True's fixed-order matmul (records streamed for every row count) applies the activation
    order and W8A8's per-token quantization too: a row's result is the same alone or in a batch."""
    from pagemill.layers.batch_invariant import fixed_order_apply

    torch.manual_seed(8)
    g_idx = _g_idx(128, 32, True)
    codes, scale, zeros = quantize_groups(torch.randn(64, 128), 4, 32, True, g_idx)
    spec = parse_checkpoint_quant({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True})
    lin = _layer(spec, decode_linear(spec, NAME, pack_gptq(codes, scale, zeros, 4, g_idx)))
    apply = fixed_order_apply(lin.quant_method, lin, require_kernel_ops())
    x = torch.randn(40, 128)
    y = apply(lin, x)
    torch.testing.assert_close(y, F.linear(x, dequantize(codes, scale, zeros, g_idx)), rtol=1e-5, atol=1e-4)
    assert torch.equal(apply(lin, x[3:4]), y[3:4])
    w8 = {"weight": codes.to(torch.int16).sub(8).to(torch.int8), "weight_scale": scale[:, :1]}
    spec8 = parse_checkpoint_quant({"quant_method": "compressed-tensors", "format": "int-quantized",
                                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                        "num_bits": 8, "type": "int", "strategy": "channel"},
                                        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token",
                                                              "dynamic": True}}}})
    lin8 = _layer(spec8, decode_linear(spec8, NAME, w8))
    apply8 = fixed_order_apply(lin8.quant_method, lin8, require_kernel_ops())
    ref = F.linear(quantize_tokens_int8(x), lin8.quant_method.dequantized_weight(lin8))
    torch.testing.assert_close(apply8(lin8, x), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
def test_whole_tile_shards_are_laid_out_as_they_load(bits):
    """Shards of whole 64-row tiles are laid out at load_weight (their codes freed); the stacked records are those
    of the whole layer laid out at once."""
    from pagemill.layers.quantization.prequantized import q4_records

    spec = parse_checkpoint_quant({"quant_method": "gptq", "bits": bits, "group_size": 32, "desc_act": True,
                                   "sym": False})
    ctx = _context(spec, {f"model.layers.0.self_attn.{s}_proj.weight" for s in "qkv"})
    qkv = QKVParallelLinear(64, 32, 4, 2, False, ctx, [f"model.layers.0.self_attn.{s}_proj" for s in "qkv"])
    torch.manual_seed(9)
    g_idx = _g_idx(64, 32, True)
    decoded, full = [], []
    for s, rows in (("q", 128), ("k", 64), ("v", 64)):
        codes, scale, zeros = quantize_groups(torch.randn(rows, 64), bits, 32, False, g_idx)
        c = decode_linear(spec, s, pack_gptq(codes, scale, zeros, bits, g_idx))
        qkv.load_weight("weight", c, s)
        assert not isinstance(qkv.quant_parts[qkv.shard_offsets["qkv".index(s)]][3], QuantCodes)  # laid out now
        decoded.append(c)
        full.append(dequantize(codes, scale, zeros, g_idx))
    qkv.process_weights_after_loading()
    torch.testing.assert_close(qkv.quant_method.dequantized_weight(qkv), torch.cat(full), rtol=0,
                               atol=float(torch.cat(full).abs().max()) * 2e-3)
    if bits == 4:
        from pagemill.layers.quantization.prequantized import _contiguous_groups

        whole = q4_records([_contiguous_groups(c, "gptq")[0] for c in decoded])
        assert torch.equal(qkv.gemv_segments[0].records, whole)
    x = torch.randn(5, 64)
    torch.testing.assert_close(qkv(x), F.linear(x, qkv.quant_method.dequantized_weight(qkv)), rtol=1e-5, atol=1e-4)


def test_awq_decode_matches_autoawq_dequantize_gemm():
    """AutoAWQ's own dequantizer (awq/utils/packing_utils.py: unpack by shifts 0, 4, ..., 28, then
    AWQ_REVERSE_ORDER [0, 4, 1, 5, 2, 6, 3, 7], then (iweight - izeros) * scales), transcribed, is the oracle."""
    torch.manual_seed(10)
    codes, scale, zeros = quantize_groups(torch.randn(64, 256), 4, 128, False)
    t = pack_awq(codes, scale, zeros)

    def unpack(x):
        shifts = torch.arange(0, 32, 4)
        return torch.bitwise_right_shift(x[:, :, None], shifts[None, None, :]).to(torch.int8).view(x.shape[0], -1)

    iw, iz = unpack(t["qweight"]), unpack(t["qzeros"])
    order = torch.arange(iw.shape[-1]).view(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]].view(-1)
    iw, iz = iw[:, order] & 15, iz[:, order] & 15
    ref = (iw - iz.repeat_interleave(128, 0)) * t["scales"].repeat_interleave(128, 0)  # [K, N] fp16 as AWQ does
    spec = parse_checkpoint_quant({"quant_method": "awq", "bits": 4, "group_size": 128})
    c = decode_linear(spec, NAME, t)
    torch.testing.assert_close(c.dequantize().t(), ref.float(), rtol=1e-3, atol=1e-3)  # AWQ rounds to fp16


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_decode_matches_autogptq_dequantization(bits):
    """AutoGPTQ's QuantLinear dequantization (wf shifts on qweight along K and on qzeros along N, zeros + 1 in the
    v1 format, scales[g_idx] * (weight - zeros[g_idx])), transcribed, is the oracle; act order included."""
    torch.manual_seed(11)
    g_idx = _g_idx(128, 32, True)
    codes, scale, zeros = quantize_groups(torch.randn(64, 128), bits, 32, False, g_idx)
    t = pack_gptq(codes, scale, zeros, bits, g_idx)
    per, maxq = 32 // bits, (1 << bits) - 1
    wf = torch.arange(0, 32, bits, dtype=torch.int32).unsqueeze(0)
    z = torch.bitwise_right_shift(t["qzeros"].unsqueeze(2).expand(-1, -1, per), wf.unsqueeze(0)) & maxq
    z = (z + 1).reshape(t["scales"].shape)
    w = torch.bitwise_right_shift(t["qweight"].unsqueeze(1).expand(-1, per, -1), wf.unsqueeze(-1)) & maxq
    w = w.reshape(-1, w.shape[2])  # [K, N]
    gi = t["g_idx"].long()
    ref = t["scales"].float()[gi] * (w - z[gi]).float()
    spec = parse_checkpoint_quant({"quant_method": "gptq", "bits": bits, "group_size": 32, "desc_act": True,
                                   "sym": False})
    assert torch.equal(decode_linear(spec, NAME, t).dequantize().t(), ref)
