"""The fast GGUF load path gives exactly what the slow one gave: config, tokenizer, float32 weights, GEMV packs."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from pagemill.config.config_snapshot import config_class_name
from pagemill.layers.quantization.gguf import pack_q4_1_blocks, pack_q8_0_blocks
from pagemill.loader.gguf_file import GGML_Q4_1, GGML_Q8_0, GGUFFile, open_gguf
from pagemill.loader.gguf_loader import (GGUFWeights, _reverse_permute, dequantize_q4_1, dequantize_q8_0,
                                         gguf_to_hf_name)
from pagemill.loader.model_files import gguf_hf_config
from pagemill.loader.tokenizer import load_tokenizer
from tests.conftest import require_kernels


def _hf_config(path: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def _config_dict(config) -> dict:
    d = config.to_dict()
    d.pop("_name_or_path", None)
    return d


def _assert_same_config(ours, reference) -> None:
    """Our config (a snapshot of the transformers one) reads as transformers' own: class, attributes, to_dict()."""
    assert config_class_name(ours) == type(reference).__name__
    attributes = {k: v for k, v in vars(ours).items() if k not in ("_snapshot", "_name_or_path")}
    assert attributes == {k: v for k, v in vars(reference).items() if k != "_name_or_path"}
    assert _config_dict(ours) == _config_dict(reference)
    assert type(ours.to_transformers()) is type(reference)


@pytest.fixture(scope="module")
def smol_config(smol_path):
    return gguf_hf_config(smol_path)


@pytest.fixture(scope="module")
def smol_weights(smol_path, smol_config):
    """(HF name -> float32 tensor in HF row order, HF name -> GGUFWeight of the 2-D Q4_1 / Q8_0 weights in HF order)."""
    weights = GGUFWeights(smol_path, smol_config)
    blocks = {}
    for name, w in weights.lazy():
        if w.format is not None:
            heads = smol_config.num_attention_heads if ".q_proj." in name else smol_config.num_key_value_heads
            blocks[name] = w.unpermute_rope(heads) if w.rope_permuted else w
    return dict(weights), blocks


def test_metadata_and_tensor_bytes_match_gguf_reader(smol_path):
    from gguf import GGUFReader
    from transformers.integrations.ggml import _gguf_parse_value

    ours = GGUFFile(smol_path)
    reader = GGUFReader(smol_path)
    assert list(ours.metadata) == [k for k in reader.fields if not k.startswith("GGUF.")]
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = [_gguf_parse_value(field.parts[i], field.types) for i in field.data]
        mine = ours.metadata[key]
        assert (mine if isinstance(mine, list) else [mine]) == value, key
    assert [t.name for t in reader.tensors] == list(ours.tensors)
    for t in reader.tensors:
        info = ours.tensors[t.name]
        assert info.shape == tuple(int(d) for d in reversed(t.shape)) and info.ggml_type == int(t.tensor_type)
        assert np.array_equal(ours.raw(info).reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1)), t.name


def test_open_gguf_is_shared(smol_path):
    assert open_gguf(smol_path) is open_gguf(smol_path)


def test_config_equals_transformers(smol_path, smol_config):
    _assert_same_config(smol_config, _hf_config(smol_path))


def _write_gguf(path: str, arch: str, name: str, with_output: bool) -> None:
    import gguf

    w = gguf.GGUFWriter(path, arch)
    w.add_name(name)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(40)])
    w.add_array("tokenizer.ggml.merges", ["t 1"])
    w.add_eos_token_id(1)
    w.add_tensor("token_embd.weight", np.zeros((40, 64), dtype=np.float32))
    if with_output:
        w.add_tensor("output.weight", np.zeros((40, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch,name,with_output", [("qwen2", "tiny", True), ("llama", "mistral", False),
                                                   ("llama", "Tiny Llama", True)])
def test_config_equals_transformers_other_files(tmp_path, arch, name, with_output):
    path = str(tmp_path / f"{arch}.gguf")
    _write_gguf(path, arch, name, with_output)
    _assert_same_config(gguf_hf_config(path), _hf_config(path))


def test_tokenizer_equals_auto_tokenizer(smol_path, smol_config):
    from transformers import AutoTokenizer

    ours = load_tokenizer(smol_path, smol_path, smol_config)
    ref = AutoTokenizer.from_pretrained(os.path.dirname(smol_path), gguf_file=os.path.basename(smol_path))
    assert type(ours) is type(ref)
    assert ours.backend_tokenizer.to_str() == ref.backend_tokenizer.to_str()
    assert ours.chat_template == ref.chat_template
    assert ours.special_tokens_map == ref.special_tokens_map
    assert {k: v for k, v in ours.init_kwargs.items() if k != "_from_auto"} == \
        {k: v for k, v in ref.init_kwargs.items() if k != "_from_auto"}
    text = "Hello, my name is <|im_start|> café 123"
    assert ours.encode(text) == ref.encode(text)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def test_weights_bit_identical_to_gguf_dequantize(smol_path, smol_config, smol_weights):
    """The torch decode equals gguf.quants.dequantize (+ the llama Q/K un-permutation) bit for bit."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    weights, _ = smol_weights
    reader = GGUFReader(smol_path)
    seen = 0
    for t in reader.tensors:
        hf_name = gguf_to_hf_name(t.name, "llama")
        arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(weights[hf_name].shape)
        if ".attn_q." in t.name or ".attn_k." in t.name:
            heads = smol_config.num_attention_heads if ".attn_q." in t.name else smol_config.num_key_value_heads
            arr = _reverse_permute(arr, heads)
        assert np.array_equal(weights[hf_name].numpy().view(np.int32), arr.view(np.int32)), t.name
        seen += 1
    assert seen == len(weights) == 272


def _kernels():
    from pagemill.kernels import load_kernels

    kernels = load_kernels()
    if kernels is None:
        require_kernels()
    return kernels


def test_packs_equal_kernel_packers_on_smollm2(smol_weights):
    """Laying out the file's blocks gives the bytes pack_gemv_weight_q4 / _int8 fit from the float32 weights."""
    kernels = _kernels()
    weights, blocks = smol_weights
    assert {b.format for b in blocks.values()} == {"q4_1", "q8_0"} and len(blocks) == 211
    for name, b in blocks.items():
        w = weights[name]
        if b.tensor.ggml_type == GGML_Q4_1:
            packed, err = kernels.pack_gemv_weight_q4(w, 32)
            assert float(err) == 0.0
            assert torch.equal(pack_q4_1_blocks(b.blocks), packed), name
        else:
            assert b.tensor.ggml_type == GGML_Q8_0
            q, scales = kernels.pack_gemv_weight_int8(w, 32)
            mine_q, mine_scales = pack_q8_0_blocks(b.blocks)
            assert torch.equal(mine_q, q) and torch.equal(mine_scales, scales), name


@pytest.mark.parametrize("rows", [64, 100, 1])
def test_packs_equal_kernel_packers_on_random_blocks(rows):
    """Random Q4_1 / Q8_0 data from gguf's quantizer, row counts off the 64-channel tile, few-valued groups."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    kernels = _kernels()
    rng = np.random.default_rng(rows)
    k = 256
    w = rng.standard_normal((rows, k)).astype(np.float32)
    groups = w.reshape(rows, k // 32, 32)
    for r in range(rows):  # groups of 1..16 distinct values at several scales, as well as plain normal ones
        for g in range(0, k // 32, 2):
            levels = rng.standard_normal(rng.integers(1, 17)).astype(np.float32) * rng.choice([1e-3, 1.0, 30.0])
            groups[r, g] = rng.choice(levels, 32)
    for qtype, nbytes in ((GGMLQuantizationType.Q4_1, 20), (GGMLQuantizationType.Q8_0, 34)):
        raw = quantize(w, qtype)
        blocks = torch.from_numpy(raw.copy()).view(rows, k // 32, nbytes)
        decode = dequantize_q4_1 if qtype == GGMLQuantizationType.Q4_1 else dequantize_q8_0
        ours = decode(blocks, torch.empty(rows, k))
        ref = dequantize(raw, qtype).reshape(rows, k)
        assert np.array_equal(ours.numpy().view(np.int32), ref.view(np.int32))
        if qtype == GGMLQuantizationType.Q4_1:
            assert torch.equal(pack_q4_1_blocks(blocks), kernels.pack_gemv_weight_q4(ours, 32)[0])
        else:
            q, scales = kernels.pack_gemv_weight_int8(ours, 32)
            mine_q, mine_scales = pack_q8_0_blocks(blocks)
            assert torch.equal(mine_q, q) and torch.equal(mine_scales, scales)


def test_llm_load_reads_the_file_once_and_fits_nothing(smol_path):
    """LLM() on the GGUF: no gguf.GGUFReader, no AutoConfig / AutoTokenizer GGUF read, no Q4 fitting."""
    code = f"""
import gguf, gguf.gguf_reader, transformers
from pagemill.kernels import load_kernels
calls = []
class Spy(gguf.gguf_reader.GGUFReader):
    def __init__(self, *a, **k):
        calls.append("GGUFReader"); super().__init__(*a, **k)
gguf.GGUFReader = gguf.gguf_reader.GGUFReader = Spy
kernels = load_kernels()
if kernels is not None:
    fit = kernels.pack_gemv_weight_q4
    import pagemill.kernels.ops as ops
    class K:
        def __getattr__(self, n): return getattr(kernels, n)
        def pack_gemv_weight_q4(self, *a):
            calls.append("fit"); return fit(*a)
    ops.load_kernels = lambda: K()
from pagemill import LLM
llm = LLM({smol_path!r}, kv_cache_memory="64MiB", max_model_len=512)
print("CALLS", calls)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "CALLS []" in out.stdout, out.stdout


def test_llm_default_load_peak_memory():
    """LLM() on the default model (2 GiB KV cache, committed lazily): peak RSS well under 1.5 GB (was 3.6 GB).

    About 0.4 GB of it is torch + transformers; the model is 0.54 GB of oneDNN float32 weights, 0.1 GB of Q4_1 /
    Q8_0 GEMV records and the 0.11 GB float32 embedding (plain float32 copies of the projections are not kept).
    """
    # VmHWM, not ru_maxrss: the latter carries over the parent's (pytest's) high-water mark through fork + exec.
    code = ("from pagemill import LLM; LLM(); "
            "print('PEAK', [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    peak_mb = int(out.stdout.split("PEAK")[1]) / 1024
    assert peak_mb < 1500, f"LLM() peak RSS {peak_mb:.0f} MB"


def test_linear_weights_are_dropped_and_rebuilt_exactly(smol_llm, smol_weights):
    """Q4_1 / Q8_0 linears, the tied LM head included, hold no float32 weight, and the embedding no float32 table
    (its rows are decoded from the file's blocks); records and looked-up rows hold the values bit for bit."""
    from pagemill.layers.quantization.gguf import GGUFLinearMethod
    from tests.layers.helpers import engine_model

    _kernels()
    weights, _ = smol_weights
    model = engine_model(smol_llm)
    layers = [m for m in model.modules() if isinstance(getattr(m, "quant_method", None), GGUFLinearMethod)]
    assert len(layers) == 121 and all(m.weight is None and not hasattr(m, "mkldnn_weight") for m in layers)
    embedding = model.model.embed_tokens
    assert embedding.weight is None and embedding.blocks is not None
    ids = torch.tensor([0, 1, 17, 49151, 17])
    table = weights["model.embed_tokens.weight"]
    assert torch.equal(embedding(ids).view(torch.int32), table[ids].view(torch.int32))
    attn, mlp = model.model.layers[3].self_attn, model.model.layers[3].mlp
    pre = "model.layers.3."
    expected = {
        attn.qkv_proj: torch.cat([weights[pre + f"self_attn.{p}_proj.weight"] for p in "qkv"]),
        attn.o_proj: weights[pre + "self_attn.o_proj.weight"],
        mlp.gate_up_proj: torch.cat([weights[pre + f"mlp.{p}_proj.weight"] for p in ("gate", "up")]),
        mlp.down_proj: weights[pre + "mlp.down_proj.weight"],
        model.lm_head: weights["model.embed_tokens.weight"],
    }
    for layer, w in expected.items():
        rebuilt = layer.quant_method.dequantized_weight(layer)
        assert torch.equal(rebuilt.view(torch.int32), w.view(torch.int32))
