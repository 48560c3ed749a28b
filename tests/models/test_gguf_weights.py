"""GGUF weights kept in their Q4_1 / Q8_0 form for the few-row GEMVs: same values, same greedy tokens as HF."""

from __future__ import annotations

from collections import Counter

import pytest

from pagemill import LLM, SamplingParams
from tests.conftest import SMOL_PROMPTS, hf_greedy, requires_kernels
from tests.layers.helpers import engine_model

pytestmark = requires_kernels


def _formats(llm: LLM) -> Counter:
    return Counter(m.weight_format for m in engine_model(llm).modules() if hasattr(m, "quant_method"))


def test_smollm2_weights_are_recognised_as_stored(smol_llm):
    """The embedded file's 210 Q4_1 projections (fused into 120 linears) and its Q8_0 tied LM head."""
    assert _formats(smol_llm) == Counter({"q4_1": 120, "q8_0": 1})


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 5])
def test_gemv_path_matches_hf(smol_llm, smol_hf, batch):
    """Decodes of <= 8 rows run the Q4_1/Q8_0 GEMVs: greedy tokens still equal HF's float32 model."""
    hf_model, tok = smol_hf
    prompts = [tok.encode(p) for p in SMOL_PROMPTS[:batch]]
    outs = smol_llm.generate([{"prompt_token_ids": p} for p in prompts],
                             SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf_model, p, 32), tok.decode(p)


def test_quantization_auto_is_none_for_safetensors(tiny_models):
    """A safetensors model keeps float32 weights and F.linear (the tied head shares the embedding)."""
    llm = LLM(tiny_models["llama"], kv_cache_memory="16MiB", max_model_len=128)
    assert llm.llm_engine.config.model_config.quantization == "none"
    assert set(_formats(llm)) == {"float32"}


@pytest.mark.slow
def test_reference_engine_runs_dequantized_float32(smol_path, smol_hf):
    """attention_backend="torch" builds every linear with F.linear on the dequantized float32 weight (no records,
    no oneDNN copies): greedy tokens still equal HF's float32 model."""
    hf_model, tok = smol_hf
    llm = LLM(smol_path, kv_cache_memory="64MiB", max_model_len=512, attention_backend="torch")
    assert _formats(llm) == Counter({"float32": 121})
    prompts = [tok.encode(p) for p in SMOL_PROMPTS[:2]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf_model, p, 16), tok.decode(p)
