"""GGUF weights kept in their Q4_1 / Q8_0 form for the few-row GEMVs: same values, same greedy tokens as HF."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

from pagemill import LLM, SamplingParams
from pagemill.layers.linear import ReducedPrecisionLinear
from tests.conftest import SMOL_PROMPTS, hf_greedy, requires_kernels

pytestmark = requires_kernels


def _formats(llm: LLM) -> Counter:
    model = llm.llm_engine.engine_core.executor.model_runner.model
    return Counter(m.weight_format for m in model.modules() if isinstance(m, ReducedPrecisionLinear))


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


def test_unquantized_weights_keep_their_dtype():
    """A weight that is not Q4_1/Q8_0 (random fp32) is not approximated: it stays float32 / float16."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 96)
    assert ReducedPrecisionLinear(lin, torch.float32, "gguf").weight_format == "float32"
    assert ReducedPrecisionLinear(lin, torch.float16, "gguf").weight_format == "float16"


def test_q8_0_weight_is_recognised():
    """A weight built as d * q (int8 q, one scale per 32 inputs) is kept as Q8_0 and computes F.linear."""
    torch.manual_seed(0)
    q = torch.randint(-127, 128, (96, 64)).float()
    q[:, ::32] = 127  # each block spans the full int8 range, as GGUF's quantizer makes it
    d = torch.rand(96, 2).half().float() / 100
    lin = nn.Linear(64, 96, bias=False)
    lin.weight.data = q * d.repeat_interleave(32, dim=1)
    layer = ReducedPrecisionLinear(lin, torch.float32, "gguf")
    assert layer.weight_format == "q8_0"
    from pagemill.kernels import ops

    x = torch.randn(3, 64)
    with ops.use_kernels(True):
        torch.testing.assert_close(layer(x), x @ lin.weight.T, rtol=1e-5, atol=1e-5)


def test_quantization_auto_is_none_for_safetensors(tiny_models):
    llm = LLM(tiny_models["llama"], kv_cache_memory="16MiB", max_model_len=128)
    assert llm.llm_engine.engine_core.executor.model_runner.config.model_config.quantization == "none"
    assert not _formats(llm)


@pytest.mark.slow
def test_reference_path_rebuilds_dropped_weights(smol_path, smol_hf):
    """attention_backend="torch" runs F.linear on `.weight`, rebuilt from the Q4_1 / Q8_0 records the first time
    (the load keeps no plain copy): greedy tokens still equal HF's float32 model."""
    hf_model, tok = smol_hf
    llm = LLM(smol_path, kv_cache_memory="64MiB", max_model_len=512, attention_backend="torch")
    layer = llm.llm_engine.engine_core.executor.model_runner.model.layers[0].mlp.down_proj
    assert "weight" not in layer._parameters
    prompts = [tok.encode(p) for p in SMOL_PROMPTS[:2]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf_model, p, 16), tok.decode(p)
    assert "weight" in layer._parameters  # rebuilt once, then kept
