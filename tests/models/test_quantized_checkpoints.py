"""Quantized checkpoint directories (GPTQ / AWQ / FP8 packed by tests/loader/quant_checkpoints.py after each
format's published layout; compressed-tensors written by the package) of tiny random Llama and Qwen2 models: greedy
tokens equal HF transformers float32 on the dequantized weights, the weights stay quantized (no float copy), and a
bad quantization_config is refused before any weight is read."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from pagemill import LLM, SamplingParams
from pagemill.layers.quantization.prequantized import PrequantizedLinearMethod
from tests.conftest import hf_greedy, requires_kernels
from tests.layers.helpers import engine_model
from tests.loader import quant_checkpoints as qc

pytestmark = requires_kernels

# name -> (writer, kwargs, records kind of the decoder linears: q4 / int8 / None for fp8's dense float path)
FORMATS = {
    "gptq-4bit-g32-desc_act": (qc.write_gptq, dict(bits=4, group=32, sym=True, desc_act=True), "q4"),
    "gptq-4bit-g128-asym": (qc.write_gptq, dict(bits=4, group=128, sym=False), "q4"),
    "gptq-8bit-channel-v2": (qc.write_gptq, dict(bits=8, group=-1, sym=True, v1=False), "int8"),
    "awq-g128": (qc.write_awq, dict(group=128), "q4"),
    "ct-W4A16-g32": (qc.write_compressed_tensors, dict(preset="W4A16", group=32), "q4"),
    "ct-W4A16-asym-g64": (qc.write_compressed_tensors, dict(preset="W4A16", group=64, symmetric=False), "q4"),
    "ct-W8A16": (qc.write_compressed_tensors, dict(preset="W8A16", group=128), "int8"),
    "ct-W8A8": (qc.write_compressed_tensors, dict(preset="W8A8"), "int8"),
    "ct-FP8_DYNAMIC": (qc.write_compressed_tensors, dict(preset="FP8_DYNAMIC"), None),
    "fp8-block": (qc.write_fp8, dict(scheme="block"), None),
    "fp8-channel": (qc.write_fp8, dict(scheme="channel"), None),
}
CASES = [("llama", f) for f in FORMATS] + [("qwen2", f) for f in ("gptq-4bit-g32-desc_act", "awq-g128",
                                                                  "ct-W4A16-g32", "ct-W8A8", "fp8-block")]
PROMPTS = [[1 + i] * (3 + 7 * i) for i in range(3)] + [list(range(5, 105))]  # GEMV prefills and a 100-row one
MAX_TOKENS = 8


@pytest.fixture(autouse=True)
def _records_cache_dir(tmp_path, monkeypatch):
    """Laid-out records are cached under the test's own directory."""
    monkeypatch.setenv("PAGEMILL_RECORDS_CACHE_DIR", str(tmp_path / "records"))
    monkeypatch.delenv("PAGEMILL_RECORDS_CACHE", raising=False)


def _quantize_inputs_per_token(model) -> None:
    """W8A8's reference: each quantized linear's input rounded per token to int8 (max|x| / 127), as vLLM's dynamic
    per-token quantization does, before a float32 matmul."""
    def hook(_module, args):
        x = args[0]
        s = x.abs().amax(-1, keepdim=True).clamp_min(1e-10) / 127
        return ((x / s).round().clamp(-127, 127) * s,)

    for _, lin in qc.quantized_linears(model):
        lin.register_forward_pre_hook(hook)


@pytest.mark.parametrize("kind,fmt", CASES)
def test_greedy_tokens_equal_hf_on_dequantized_weights(kind, fmt, tmp_path):
    writer, kwargs, records = FORMATS[fmt]
    model, tok = qc.tiny_model(kind)
    path = writer(model, tok, str(tmp_path / fmt), **kwargs)
    if fmt == "ct-W8A8":
        _quantize_inputs_per_token(model)
    llm = LLM(path, kv_cache_memory="16MiB", max_model_len=256, enable_prefix_caching=False)
    layers = [m for m in engine_model(llm).modules() if hasattr(m, "quant_method")]
    quantized = [m for m in layers if isinstance(m, torch.nn.Module) and
                 isinstance(m.quant_method, PrequantizedLinearMethod)]
    if records is None:  # fp8: the dense path on the dequantized float weights
        assert not quantized
    else:  # 2 layers x (qkv, o, gate_up, down), kept only as records
        assert len(quantized) == 8 and {m.quant_method.records for m in quantized} == {records}
        assert all(getattr(m, "weight", None) is None for m in quantized)
        # no float copy: bytes per weight of the records (0.625 q4; int8 1.125, 1.25 with mins)
        per_weight = [m.quant_method.record_bytes / (m.in_features * -(-m.out_features // 64) * 64)
                      for m in quantized]
        assert max(per_weight) <= (0.625 if records == "q4" else 1.25)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        assert o.outputs[0].token_ids == hf_greedy(model, p, MAX_TOKENS), (fmt, len(p))


def test_each_linear_holds_the_dequantized_weight(tmp_path):
    """The engine's layers hold exactly the oracle's dequantized weights (symmetric GPTQ with act order: m = -8 s is
    exact in fp16), in the checkpoint's column order."""
    model, tok = qc.tiny_model("llama")
    path = qc.write_gptq(model, tok, str(tmp_path / "gptq"), bits=4, group=32, sym=True, desc_act=True)
    llm = LLM(path, kv_cache_memory="16MiB", max_model_len=256, enable_prefix_caching=False)
    m = engine_model(llm)
    ref = model.model.layers[1]
    qkv = m.model.layers[1].self_attn.qkv_proj
    want = torch.cat([getattr(ref.self_attn, f"{s}_proj").weight for s in "qkv"])
    assert torch.equal(qkv.quant_method.dequantized_weight(qkv), want)
    down = m.model.layers[1].mlp.down_proj
    assert torch.equal(down.quant_method.dequantized_weight(down), ref.mlp.down_proj.weight)


@pytest.mark.parametrize("fmt", ["gptq-4bit-g32-desc_act", "gptq-8bit-channel-v2", "ct-W8A8"])
def test_second_start_maps_the_cached_records(fmt, tmp_path):
    """The first start writes the layers' records (and activation order) to the records cache; the second maps
    them without decoding a weight, and generates the same tokens."""
    writer, kwargs, records = FORMATS[fmt]
    model, tok = qc.tiny_model("llama")
    path = writer(model, tok, str(tmp_path / fmt), **kwargs)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    runs = []
    for start in range(2):
        llm = LLM(path, kv_cache_memory="16MiB", max_model_len=256, enable_prefix_caching=False)
        layers = [m for m in engine_model(llm).modules()
                  if isinstance(getattr(m, "quant_method", None), PrequantizedLinearMethod)]
        assert len(layers) == 8 and all(m.records_mapped == (start == 1) for m in layers)
        assert {m.quant_method.records for m in layers} == {records}
        if kwargs.get("desc_act"):
            assert all(m.act_perm is not None for m in layers)
        runs.append([o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                                   params, use_tqdm=False)])
        del llm
    assert runs[0] == runs[1]
    assert len(list((tmp_path / "records").glob("*.safetensors"))) == 1


def _with_quantization_config(src: str, dst: str, qconfig: dict | None) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qconfig
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


def test_bad_quantization_config_is_refused_naming_the_field(tmp_path):
    """An unknown quant_method (formerly loaded silently as float) and a bad field fail at LLM() with the field
    named; quantization='none' on a quantized checkpoint and tensor parallelism too."""
    model, tok = qc.tiny_model("llama")
    good = qc.write_awq(model, tok, str(tmp_path / "awq"))
    with open(os.path.join(good, "config.json")) as f:
        awq = json.load(f)["quantization_config"]
    bad = _with_quantization_config(good, str(tmp_path / "hqq"), {"quant_method": "hqq"})
    with pytest.raises(ValueError, match=r"quantization_config\.quant_method must be one of .* got 'hqq'"):
        LLM(bad, kv_cache_memory="16MiB", max_model_len=256)
    bad = _with_quantization_config(good, str(tmp_path / "gemv"), {**awq, "version": "gemv"})
    with pytest.raises(ValueError, match=r"quantization_config\.version"):
        LLM(bad, kv_cache_memory="16MiB", max_model_len=256)
    with pytest.raises(ValueError, match=r"quantization='none' does not fit"):
        LLM(good, quantization="none", kv_cache_memory="16MiB", max_model_len=256)
    from pagemill.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match=r"quantization: a quantized checkpoint's weights are not sliced"):
        EngineArgs(model=good, tensor_parallel_size=2, kv_cache_memory="16MiB").create_engine_config()
