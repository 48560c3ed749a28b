"""The quantized KV cache (kv_cache_dtype fp8 / fp8_e4m3 / fp8_e5m2 / int8) through the whole engine on SmolLM2."""

from __future__ import annotations

import pytest

from pagemill import LLM, BeamSearchParams, SamplingParams
from pagemill.config import CacheConfig
from tests.conftest import SMOL_PROMPTS

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _tokens(llm: LLM, prompts: list[str], params: SamplingParams) -> list[list[list[int]]]:
    """Every completion's tokens per prompt."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def _agreement(ours: list[list[list[int]]], ref: list[list[list[int]]]) -> float:
    """Share of generated tokens before the first divergence from the reference (greedy runs)."""
    same = total = 0
    for a, b in zip(ours, ref):
        x, y = a[0], b[0]
        n = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), len(y))
        same, total = same + n, total + len(y)
    return same / total


@pytest.mark.parametrize("kv_cache_dtype,min_agree", [("int8", 0.75), ("fp8", 0.5)])
def test_greedy_generation_agrees_with_the_float_cache(smol_path, smol_llm, kv_cache_dtype, min_agree):
    """Greedy text with a quantized cache follows the float32 cache's for most tokens."""
    ref = _tokens(smol_llm, SMOL_PROMPTS[:8], GREEDY)
    llm = LLM(smol_path, kv_cache_memory="64MiB", max_model_len=512, kv_cache_dtype=kv_cache_dtype)
    agree = _agreement(_tokens(llm, SMOL_PROMPTS[:8], GREEDY), ref)
    print(f"kv_cache_dtype={kv_cache_dtype}: greedy tokens before divergence {agree:.3f}")
    assert agree >= min_agree


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype,preemption_mode", [("int8", "recompute"), ("fp8_e5m2", "swap")])
def test_features_run_and_are_deterministic(smol_path, kv_cache_dtype, preemption_mode):
    """Prefix caching, preemption (recompute or swap), n > 1 and beam search with a quantized cache: no error, the
    same results twice (the second run hits the prefix cache), and every block back at the end.

    batch_invariant=True: in the default mode a token's K/V differ in the last bits with the batch's shape (the
    GEMV records for few rows, GEMMs for many), which is harmless for a float cache but moves some values across a
    rounding boundary of the quantizer, and those flips grow through the layers (logprobs move ~0.01, about the
    quantization error itself); with fixed-order kernels the same tokens give the same codes."""
    llm = LLM(smol_path, num_gpu_blocks_override=10, max_model_len=128, kv_cache_dtype=kv_cache_dtype,
              preemption_mode=preemption_mode, swap_space=0.05, batch_invariant=True)
    shared = "You are a careful assistant. Answer briefly and precisely. " * 3
    prompts = [shared + p for p in SMOL_PROMPTS[:3]]  # 2 shared blocks + 3 of each: more than 10
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, n=2, seed=7, max_tokens=8, ignore_eos=True)
    beam = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    runs = []
    for _ in range(2):
        g = _tokens(llm, prompts, greedy)
        s = _tokens(llm, prompts[:1], sampled)
        b = [[x.tokens for x in o.sequences] for o in llm.beam_search([{"prompt": p} for p in prompts[:1]], beam)]
        runs.append((g, s, b))
    assert runs[0] == runs[1]
    stats = llm.get_stats()
    assert stats.num_preemptions > 0 if preemption_mode == "recompute" else stats.num_swapped_out > 0
    assert stats.prefix_cache_hits > 0
    assert stats.num_blocks_free == stats.num_blocks_total
    assert all(len(c) == 2 for c in runs[0][1])


@pytest.mark.slow
def test_speculative_decoding_and_chunked_prefill_equal_plain_decoding(smol_path):
    """n-gram speculation (verify steps) and chunked prefill with an int8 cache give the plain run's greedy tokens."""
    prompts = ["one two three four one two three four one two", SMOL_PROMPTS[0]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = LLM(smol_path, kv_cache_memory="64MiB", max_model_len=512, kv_cache_dtype="int8")
    ref = [_tokens(plain, [p], params)[0] for p in prompts]  # one at a time: nothing else in the batch
    del plain
    spec = LLM(smol_path, kv_cache_memory="64MiB", max_model_len=512, kv_cache_dtype="int8",
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    assert [_tokens(spec, [p], params)[0] for p in prompts] == ref
    del spec
    chunked = LLM(smol_path, kv_cache_memory="64MiB", max_model_len=512, kv_cache_dtype="int8",
                  max_num_batched_tokens=8, enable_prefix_caching=False)
    out = _tokens(chunked, prompts, params)
    assert _agreement(out, ref) >= 0.75  # chunks attend through the kernel, a fresh prefill through SDPA


def test_capacity_in_tokens_grows_with_the_smaller_cache(smol_path):
    """Same kv_cache_memory: float16 holds ~2x the float32 tokens; fp8 ~4x (1 byte a channel + a 4-byte scale per
    64-element row: 256 / 68 = 3.76x), int8 3.56x (+ a 2-byte scale per 16 channels: 256 / 72)."""
    blocks = {}
    for dtype in ("float32", "float16", "int8", "fp8_e4m3"):
        llm = LLM(smol_path, kv_cache_memory="32MiB", max_model_len=256, kv_cache_dtype=dtype,
                  enable_prefix_caching=False)
        blocks[dtype] = llm.get_stats().num_blocks_total
        del llm
    f32 = blocks["float32"]  # ~44: whole blocks, so the ratios are within a block of the byte ratios
    assert abs(blocks["float16"] / f32 - 2) < 0.1
    for dtype, row_bytes in (("int8", 72), ("fp8_e4m3", 68)):
        assert abs(blocks[dtype] / f32 - 256 / row_bytes) < 0.15
        assert blocks[dtype] > 1.7 * blocks["float16"]


def test_bad_kv_cache_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="fp4")


def test_backend_without_quantized_reads_names_kv_cache_dtype(smol_path):
    """The virtual-contiguous layout reads float caches only: asking it for int8 names the field."""
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'"):
        LLM(smol_path, kv_cache_memory="64MiB", max_model_len=256, kv_cache_dtype="int8", kv_cache_layout="virtual")


def test_kv_connector_blocks_carry_the_scales(tiny_llama, tmp_path):
    """P/D over shared storage with an int8 cache: the consumer's loaded blocks (codes and scales) give the tokens of
    a single instance; blocks without their scales would not."""
    from tests.distributed.test_kv_connector import GREEDY as CONNECTOR_GREEDY
    from tests.distributed.test_kv_connector import PROMPTS, _llm, _prompts, _storage, loadable_tokens

    reference = _llm(tiny_llama, kv_cache_dtype="int8").generate(_prompts(), CONNECTOR_GREEDY, use_tqdm=False)
    producer = _llm(tiny_llama, kv_cache_dtype="int8", kv_transfer_config=_storage(tmp_path, "kv_producer"))
    producer.generate(_prompts(), SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    del producer
    consumer = _llm(tiny_llama, kv_cache_dtype="int8", kv_transfer_config=_storage(tmp_path, "kv_consumer"))
    out = consumer.generate(_prompts(), CONNECTOR_GREEDY, use_tqdm=False)
    assert consumer.get_stats().external_prefix_cache_hits == loadable_tokens() > 0
    for got, want in zip(out, reference, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for lg, lw in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
            t = next(iter(lw))
            assert abs(lg[t].logprob - lw[t].logprob) < 1e-3
    assert len(PROMPTS) == len(out)
