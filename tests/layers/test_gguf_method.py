"""GGUF records linear methods on real GGUF files: chosen from the tensor table, computing F.linear of the
file's dequantized weights on every path (GEMV records, L1 panels, oneDNN)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from pagemill.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagemill.layers.quantization.dense import UnquantizedLinearMethod
from pagemill.layers.quantization.gguf import GGUFLinearMethod
from pagemill.layers.quantization.gguf_records import RECORD_TYPES
from pagemill.layers.quantization.gguf_report import weight_format_table
from pagemill.loader.gguf_loader import GGUFWeights
from pagemill.models.decoder import DecoderForCausalLM
from pagemill.models.weights import load_checkpoint_weights
from tests.conftest import requires_kernels
from tests.kernels.gguf_blocks import dequantized, make_blocks
from tests.layers.helpers import layer_context

HIDDEN, INTER = 64, 96
# GGUF name -> (format, rows, cols); q/k/v mix formats, so their fused layer keeps one segment of records per part.
TENSORS = {
    "blk.0.ffn_gate.weight": ("Q4_1", INTER, HIDDEN), "blk.0.ffn_up.weight": ("Q4_1", INTER, HIDDEN),
    "blk.0.ffn_down.weight": ("Q8_0", HIDDEN, INTER), "blk.0.attn_q.weight": ("Q4_1", HIDDEN, HIDDEN),
    "blk.0.attn_k.weight": ("Q8_0", 32, HIDDEN), "blk.0.attn_v.weight": ("Q4_1", 32, HIDDEN),
}


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> tuple[str, dict[str, np.ndarray]]:
    """A qwen2 GGUF with the tensors above (quantized by gguf's own quantizer) and their dequantized values."""
    import gguf
    from gguf.quants import dequantize, quantize

    path = str(tmp_path_factory.mktemp("gguf") / "layers.gguf")
    writer = gguf.GGUFWriter(path, "qwen2")
    rng = np.random.default_rng(0)
    values = {}
    for name, (fmt, rows, cols) in TENSORS.items():
        qtype = getattr(gguf.GGMLQuantizationType, fmt)
        raw = quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
        writer.add_tensor(name, raw, raw_dtype=qtype)
        values[name] = dequantize(raw, qtype).reshape(rows, cols)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, values


class _Block(nn.Module):
    def __init__(self, ctx) -> None:
        super().__init__()
        p = "model.layers.0"
        self.qkv_proj = QKVParallelLinear(HIDDEN, 16, 4, 2, False, ctx, [f"{p}.self_attn.{s}_proj" for s in "qkv"])
        self.gate_up_proj = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], False, ctx,
                                                       [f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"])
        self.down_proj = RowParallelLinear(INTER, HIDDEN, False, ctx, f"{p}.mlp.down_proj")


def _load(path: str, kernels: bool) -> _Block:
    weights = GGUFWeights(path, SimpleNamespace(model_type="qwen2"))
    block = _Block(layer_context(kernels, quantization="gguf", gguf_tensor_types=weights.tensor_types()))
    named = ((name.rsplit(".", 2)[-2] + ".weight", w) for name, w in weights.lazy())
    load_checkpoint_weights(block, named, DecoderForCausalLM.packed_modules_mapping)
    return block


@requires_kernels
def test_methods_follow_the_tensor_table_and_compute_the_file_weights(gguf_file):
    path, values = gguf_file
    block = _load(path, kernels=True)
    assert isinstance(block.gate_up_proj.quant_method, GGUFLinearMethod) and block.gate_up_proj.weight_format == "q4_1"
    assert isinstance(block.down_proj.quant_method, GGUFLinearMethod) and block.down_proj.weight_format == "q8_0"
    qkv = block.qkv_proj.quant_method  # mixed formats: q's q4 records, k's int8 tiles, v's q4 records
    assert isinstance(qkv, GGUFLinearMethod) and qkv.weight_format == "q4_1+q8_0" and qkv.records == "q4+int8"
    assert [(s.kind, s.start, s.stop) for s in block.qkv_proj.gemv_segments] == [
        ("q4", 0, HIDDEN), ("int8", HIDDEN, HIDDEN + 32), ("q4", HIDDEN + 32, HIDDEN + 64)]
    expected = {
        block.gate_up_proj: np.concatenate([values["blk.0.ffn_gate.weight"], values["blk.0.ffn_up.weight"]]),
        block.down_proj: values["blk.0.ffn_down.weight"],
        block.qkv_proj: np.concatenate([values[f"blk.0.attn_{s}.weight"] for s in "qkv"]),
    }
    torch.manual_seed(0)
    for layer, w in expected.items():
        w = torch.from_numpy(w)
        assert torch.equal(layer.quant_method.dequantized_weight(layer), w)  # bit for bit
        for rows in (1, 5, 16, 17, 64, 65, 130, 300):  # streamed, panels
            x = torch.randn(rows, layer.input_size)
            torch.testing.assert_close(layer(x), x @ w.T, rtol=1e-4, atol=1e-4)


def test_reference_engine_gets_dequantized_float32(gguf_file):
    """Without the kernels every layer is F.linear on the file's dequantized values, bit for bit."""
    path, values = gguf_file
    block = _load(path, kernels=False)
    for layer in (block.qkv_proj, block.gate_up_proj, block.down_proj):
        assert type(layer.quant_method) is UnquantizedLinearMethod and layer.weight_format == "float32"
    assert torch.equal(block.down_proj.weight, torch.from_numpy(values["blk.0.ffn_down.weight"]))


# Every block format kept as records, through the file reader and the fused-layer loading of an MLP whose sizes
# suit the K-quants' 256-long super-blocks; 192 gate/up rows leave a partial GEMV tile.
MLP_HIDDEN, MLP_INTER = 256, 192 + 64


class _MLP(nn.Module):
    def __init__(self, ctx) -> None:
        super().__init__()
        p = "model.layers.0"
        self.gate_up_proj = MergedColumnParallelLinear(MLP_HIDDEN, [MLP_INTER, MLP_INTER], False, ctx,
                                                       [f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"])
        self.down_proj = RowParallelLinear(MLP_INTER, MLP_HIDDEN, False, ctx, f"{p}.mlp.down_proj")


@pytest.fixture(scope="module", params=[name for name, _, _ in RECORD_TYPES.values()])
def format_file(request, tmp_path_factory) -> tuple[str, str, dict[str, torch.Tensor]]:
    """(format, path of a qwen2 GGUF whose MLP is in that format, GGUF name -> dequantized weight)."""
    import gguf

    fmt = request.param
    path = str(tmp_path_factory.mktemp("gguf") / f"mlp_{fmt}.gguf")
    writer = gguf.GGUFWriter(path, "qwen2")
    values = {}
    shapes = {"ffn_gate": (MLP_INTER, MLP_HIDDEN), "ffn_up": (MLP_INTER, MLP_HIDDEN),
              "ffn_down": (MLP_HIDDEN, MLP_INTER)}
    for i, (name, (rows, cols)) in enumerate(shapes.items()):
        blocks = make_blocks(fmt, rows, cols, seed=i)
        writer.add_tensor(f"blk.0.{name}.weight", blocks.reshape(rows, -1).numpy(),
                          raw_dtype=getattr(gguf.GGMLQuantizationType, fmt.upper()))
        values[name] = dequantized(fmt, blocks)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return fmt, path, values


@requires_kernels
def test_every_record_format_computes_the_file_weights(format_file):
    fmt, path, values = format_file
    weights = GGUFWeights(path, SimpleNamespace(model_type="qwen2"))
    mlp = _MLP(layer_context(True, quantization="gguf", gguf_tensor_types=weights.tensor_types()))
    named = ((name.rsplit(".", 2)[-2] + ".weight", w) for name, w in weights.lazy())
    load_checkpoint_weights(mlp, named, DecoderForCausalLM.packed_modules_mapping)
    expected = {mlp.gate_up_proj: torch.cat([values["ffn_gate"], values["ffn_up"]]),
                mlp.down_proj: values["ffn_down"]}
    torch.manual_seed(0)
    for layer, w in expected.items():
        assert isinstance(layer.quant_method, GGUFLinearMethod) and layer.weight_format == fmt
        assert torch.equal(layer.quant_method.dequantized_weight(layer), w)  # bit for bit
        for rows in (1, 5, 17, 64, 65, 300):  # streamed, panels
            x = torch.randn(rows, layer.input_size)
            ref = x @ w.T  # random K-quant blocks give large weights: the tolerance follows the outputs' scale
            torch.testing.assert_close(layer(x), ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item())
    table = weight_format_table(mlp)
    assert [(r.source, r.path, r.tensors) for r in table] == [(fmt, f"{layer.quant_method.records} records", 3)]
    assert table[0].nbytes == sum(layer.quant_method.record_bytes for layer in expected) > 0


@requires_kernels
def test_every_record_format_in_a_float16_engine(format_file):
    """A float16 engine reads the same records (x and out in float16, up to its GEMV rows, then oneDNN)."""
    fmt, path, values = format_file
    weights = GGUFWeights(path, SimpleNamespace(model_type="qwen2"))
    ctx = layer_context(True, linear_dtype="float16", quantization="gguf", gguf_tensor_types=weights.tensor_types())
    mlp = _MLP(ctx)
    named = ((name.rsplit(".", 2)[-2] + ".weight", w) for name, w in weights.lazy())
    load_checkpoint_weights(mlp, named, DecoderForCausalLM.packed_modules_mapping)
    layer, w = mlp.down_proj, values["ffn_down"]
    assert isinstance(layer.quant_method, GGUFLinearMethod) and layer.quant_method.input_dtype == torch.float16
    torch.manual_seed(0)
    for rows in (1, 8, 9):
        x = torch.randn(rows, MLP_INTER).half()
        ref = x.float() @ w.T
        out = layer(x)
        assert out.dtype == torch.float16
        torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=2e-3 * ref.abs().max().item())
