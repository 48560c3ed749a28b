"""IQ4_NL / IQ4_XS GGUF weights (llama.cpp's non-linear 4-bit formats) kept as int8 records, not float32 copies:
SmolLM2 requantized to IQ4 (its tied embedding too, so the embedding rows and the greedy head screen read IQ4 blocks)
gives HF transformers' float32 greedy tokens on the same file."""

from __future__ import annotations

import pytest

from pagemill import LLM, SamplingParams
from pagemill.layers.quantization.gguf_report import weight_format_table
from tests.conftest import SMOL_PROMPTS, default_model_path, requires_kernels
from tests.layers.helpers import engine_model
from tests.models.hf_reference import hf_greedy_cached
from tests.models.iq4_gguf import requantize_to_iq4

pytestmark = [requires_kernels, pytest.mark.slow]

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def iq4_path(tmp_path_factory) -> str:
    """SmolLM2 with every 2-D weight in IQ4_XS (down_proj: 1536 inputs) or IQ4_NL (576 inputs)."""
    path = str(tmp_path_factory.mktemp("iq4") / "smollm2-iq4.gguf")
    requantize_to_iq4(default_model_path(), path)
    return path


def test_iq4_weights_are_int8_records_and_greedy_equals_hf(iq4_path):
    ref = hf_greedy_cached(iq4_path, SMOL_PROMPTS, MAX_TOKENS)
    llm = LLM(iq4_path, max_model_len=512, kv_cache_memory="64MiB")
    table = weight_format_table(engine_model(llm))
    assert {r.source for r in table} == {"iq4_nl", "iq4_xs"}
    assert {r.path for r in table} == {"int8 records"}  # no float32 copy of any linear, the LM head included
    runner = llm.llm_engine.engine_core.executor.model_runner
    assert runner.head_screen is not None  # packed from the IQ4_NL embedding blocks
    # min_tokens: HF's min_new_tokens masks EOS, which these prompts would otherwise reach
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in ref], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r["output_token_ids"] for r in ref]
    # Plain greedy rows take the head screen (rows under min_tokens need their whole logits): HF's tokens up to
    # the first EOS, the first token where HF's masking differs
    eos = llm.get_tokenizer().eos_token_id
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in ref], params, use_tqdm=False)
    for o, r in zip(outs, ref):
        got = list(o.outputs[0].token_ids)
        n = got.index(eos) if eos in got else len(got)
        assert got[:n] == r["output_token_ids"][:n]
    assert runner.head_screen.rows > 0
