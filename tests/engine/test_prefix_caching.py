"""Automatic prefix caching on the real model: hits compute only the suffix and change no token."""

from __future__ import annotations

from pagemill import LLM, SamplingParams


def test_shared_500_token_prefix_computes_only_the_suffix(smol_path, smol_hf):
    tok = smol_hf[1]
    prefix = tok.encode(" ".join(f"Fact {i}: the sky over city {i} is blue." for i in range(60)))[:500]
    assert len(prefix) == 500
    a = prefix + tok.encode(" Question one: what colour is the sky?")
    b = prefix + tok.encode(" Question two: name a city.")
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    cold = LLM(smol_path, kv_cache_memory="128MiB", max_model_len=1024, enable_prefix_caching=False)
    cold_b = cold.generate({"prompt_token_ids": b}, greedy, use_tqdm=False)[0].outputs[0].token_ids
    del cold
    llm = LLM(smol_path, kv_cache_memory="128MiB", max_model_len=1024)
    llm.generate({"prompt_token_ids": a}, greedy, use_tqdm=False)
    before = llm.get_stats()
    out = llm.generate({"prompt_token_ids": b}, greedy, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == cold_b  # identical to a cold run
    after = llm.get_stats()
    hit = after.prefix_cache_hits - before.prefix_cache_hits
    assert hit == 496 == out.num_cached_tokens  # 31 full blocks of 16
    assert after.num_prompt_tokens - before.num_prompt_tokens == len(b) - 496  # only the suffix was computed
    assert llm.reset_prefix_cache()
    again = llm.generate({"prompt_token_ids": b}, greedy, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and llm.get_stats().prefix_cache_hits == after.prefix_cache_hits


def test_cache_salt_isolates_and_sha256_works(smol_path):
    llm = LLM(smol_path, kv_cache_memory="64MiB", max_model_len=512, prefix_caching_hash_algo="sha256")
    engine = llm.llm_engine
    prompt = {"prompt_token_ids": list(range(1000, 1100))}
    sp = SamplingParams(temperature=0, max_tokens=2)
    engine.add_request("a", prompt, sp, cache_salt="tenant-a")
    while engine.has_unfinished_requests():
        engine.step()
    hits = engine.get_stats().prefix_cache_hits
    engine.add_request("b", prompt, sp, cache_salt="tenant-b")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats().prefix_cache_hits == hits  # different salt: no sharing
    engine.add_request("c", prompt, sp, cache_salt="tenant-a")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats().prefix_cache_hits - hits == 96  # same salt: 6 full blocks shared
