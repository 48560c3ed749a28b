"""batch_invariant=True (issue 18): 50 seeded sampled requests give bit-identical logprobs and text alone, in a
batch of 32 and with chunked prefill, on the embedded GGUF model and on a float32 safetensors model. Without the
mode the same requests' logprobs change with the batch on this CPU (the default kernels are chosen by row count)."""

from __future__ import annotations

from typing import Any

import pytest

from pagemill import LLM, SamplingParams
from tests.conftest import SMOL_PROMPTS, requires_kernels

pytestmark = requires_kernels

NUM_REQUESTS, BATCH, MAX_TOKENS = 50, 32, 8
Result = tuple[tuple[int, ...], str, tuple[tuple[tuple[int, float], ...], ...]]  # tokens, text, top logprobs


def _prompts() -> list[str]:
    """50 prompts of about 5 to 90 tokens; many share a prefix (prefix-cache hits in the batched runs)."""
    return [" ".join(SMOL_PROMPTS[(i + j) % len(SMOL_PROMPTS)] for j in range(1 + (i * 5) % 11))
            for i in range(NUM_REQUESTS)]


def _params(i: int) -> SamplingParams:
    """Seeded random sampling, with the filters (top-k, top-p, min-p) varied over the requests."""
    return SamplingParams(temperature=(0.7, 1.0, 1.3)[i % 3], top_k=(0, 40)[i % 2], top_p=(1.0, 0.9)[i % 4 // 2],
                          min_p=0.02 if i % 5 == 0 else 0.0, seed=1000 + i, max_tokens=MAX_TOKENS, logprobs=5,
                          ignore_eos=True)


def _run(llm: LLM, idx: list[int]) -> dict[int, Result]:
    prompts = _prompts()
    outs = llm.generate([prompts[i] for i in idx], [_params(i) for i in idx], use_tqdm=False)
    results = {}
    for i, out in zip(idx, outs):
        c = out.outputs[0]
        assert len(c.token_ids) == MAX_TOKENS
        top = tuple(tuple(sorted((t, lp.logprob) for t, lp in step.items())) for step in c.logprobs)
        results[i] = (tuple(c.token_ids), c.text, top)
    return results


def _alone(llm: LLM) -> dict[int, Result]:
    return {i: _run(llm, [i])[i] for i in range(NUM_REQUESTS)}


def _batches_of_32(llm: LLM) -> list[dict[int, Result]]:
    """Requests 0-31, then 18-49: every request in a batch of 32 (18-31 twice, with different company)."""
    return [_run(llm, list(range(BATCH))), _run(llm, list(range(NUM_REQUESTS - BATCH, NUM_REQUESTS)))]


def _assert_same(reference: dict[int, Result], got: dict[int, Result], where: str) -> None:
    differ = [i for i in got if got[i] != reference[i]]
    assert not differ, f"{where}: requests {differ} differ from their run alone"


def _check_invariant(model: str | None, **kwargs: Any) -> dict[int, Result]:
    llm = LLM(model, batch_invariant=True, max_model_len=512, kv_cache_memory="256MiB", **kwargs)
    alone = _alone(llm)
    for batch in _batches_of_32(llm):  # (their prompts' blocks are prefix-cache hits now)
        _assert_same(alone, batch, "batch of 32")
    del llm
    chunked = LLM(model, batch_invariant=True, max_model_len=512, kv_cache_memory="256MiB",
                  max_num_batched_tokens=16, enable_prefix_caching=False, **kwargs)
    _assert_same(alone, _run(chunked, list(range(NUM_REQUESTS))), "all 50 at once, prefill chunks of 16 tokens")
    return alone


def _assert_batch_dependent(llm: LLM) -> None:
    """Without the mode: some request's logprobs in a batch of 32 differ from its run alone."""
    alone = {i: _run(llm, [i])[i] for i in range(BATCH)}
    batch = _run(llm, list(range(BATCH)))
    assert any(batch[i][2] != alone[i][2] for i in range(BATCH)), "the default mode was batch-invariant here"


def test_float32_model(tiny_llama, kernel_isa):
    """A float32 safetensors Llama (dense linears: gemv_f32), on every kernel variant this CPU runs."""
    _check_invariant(tiny_llama)


def test_float32_model_depends_on_batch_without_the_mode(tiny_llama):
    _assert_batch_dependent(LLM(tiny_llama, max_model_len=512, kv_cache_memory="256MiB"))


def test_embedded_gguf_model():
    """SmolLM2-135M Q4_1 (GGUF records linears, the tied Q8_0 head)."""
    _check_invariant(None)


def test_embedded_gguf_model_depends_on_batch_without_the_mode(smol_llm):
    _assert_batch_dependent(smol_llm)


def test_options_it_cannot_combine_with(tiny_llama):
    for bad in (dict(dtype="bfloat16"), dict(linear_dtype="float16"), dict(attention_backend="torch"),
                dict(speculative_config={"method": "ngram"}), dict(enable_lora=True)):
        with pytest.raises(ValueError, match="batch_invariant"):
            LLM(tiny_llama, batch_invariant=True, **bad)
