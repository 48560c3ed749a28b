"""Sliding-window KV cache groups end to end: tiny Gemma 3 (sliding + full layers) and an all-sliding Mistral with
window 8 and 4-token blocks must equal HF greedy while their sliding groups drop blocks behind the window."""

from __future__ import annotations

import os

import pytest
import torch

from pagemill import LLM, SamplingParams
from tests.conftest import SMOL_PROMPTS, hf_greedy

KINDS = ["gemma3_text", "mistral"]
NEW = 24
BS = 4


def _save_sliding_mistral(root: str, tokenizer) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(1)
    config = AutoConfig.for_model("mistral", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=1024, initializer_range=0.2, tie_word_embeddings=False,
                                  sliding_window=8, rope_theta=1e4)
    path = os.path.join(root, "tiny-mistral-sliding")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tiny_models, smol_hf, tmp_path_factory) -> dict[str, str]:
    """Tiny Gemma 3 (window 8 on layer 0, full layer 1) and Mistral (window 8 on both layers)."""
    return {"gemma3_text": tiny_models["gemma3_text"],
            "mistral": _save_sliding_mistral(str(tmp_path_factory.mktemp("swa")), smol_hf[1])}


@pytest.fixture(scope="module")
def prompts(smol_hf) -> list[list[int]]:
    """Prompts of 4-13 tokens plus two of 37 and 50 tokens: all end far past the window of 8."""
    tok = smol_hf[1]
    out = [tok.encode(p) for p in SMOL_PROMPTS[:6]]
    long = tok.encode(" ".join(SMOL_PROMPTS))
    return out + [long[:37], long[:50]]


@pytest.fixture(scope="module")
def references(models, prompts) -> dict[str, list[list[int]]]:
    """HF greedy continuations (NEW tokens) of every prompt, per model."""
    from transformers import AutoModelForCausalLM

    refs = {}
    for kind, path in models.items():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        refs[kind] = [hf_greedy(hf, p, NEW) for p in prompts]
    return refs


GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def _generate(llm: LLM, prompts: list[list[int]], sp: SamplingParams = GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("kind", KINDS)
def test_batch_matches_hf_with_sliding_groups(kind, backend, models, prompts, references):
    llm = LLM(models[kind], kv_cache_memory="16MiB", block_size=BS, max_model_len=128, attention_backend=backend)
    windows = llm.llm_engine.engine_core.kv_cache_config.group_windows
    assert windows == ((None, 8) if kind == "gemma3_text" else (8,))
    outs = _generate(llm, prompts)
    assert [o.outputs[0].token_ids for o in outs] == references[kind]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prefill_and_preemption_match_hf(kind, mode, models, prompts, references):
    # Gemma 3: 39 usable blocks, one 128-token sequence needs 32 + 7 (its sliding group: window and a 16-token chunk).
    # Mistral (one sliding group): 9 usable blocks, a sequence needs 7 at most however long it gets.
    blocks = 40 if kind == "gemma3_text" else 10
    llm = LLM(models[kind], block_size=BS, max_model_len=128, max_num_batched_tokens=16, num_gpu_blocks_override=blocks,
              preemption_mode=mode, swap_space=0.01, enable_prefix_caching=False)
    outs = _generate(llm, prompts)
    assert [o.outputs[0].token_ids for o in outs] == references[kind]
    stats = llm.get_stats()
    assert stats.num_preemptions > 0
    assert (stats.num_swapped_out > 0) == (mode == "swap")
    assert stats.num_blocks_free == stats.num_blocks_total  # everything came back


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_cache_hits_match_hf(kind, models, prompts, references):
    llm = LLM(models[kind], kv_cache_memory="16MiB", block_size=BS, max_model_len=128)
    long37, long50 = prompts[-2], prompts[-1]  # long37 is a prefix of long50
    assert _generate(llm, [long37])[0].outputs[0].token_ids == references[kind][-2]
    out = _generate(llm, [long50])[0]
    assert out.num_cached_tokens == 36  # 9 blocks: the full group's prefix, the sliding group's last 2 blocks
    assert out.outputs[0].token_ids == references[kind][-1]
    again = _generate(llm, prompts)  # every prompt again: hits wherever cached, same tokens
    assert [o.outputs[0].token_ids for o in again] == references[kind]
    assert llm.reset_prefix_cache()
    assert _generate(llm, [long50])[0].num_cached_tokens == 0


@pytest.mark.parametrize("kind", KINDS)
def test_parallel_sampling_forks_every_group(kind, models, prompts, references):
    llm = LLM(models[kind], kv_cache_memory="16MiB", block_size=BS, max_model_len=128, enable_prefix_caching=False)
    outs = _generate(llm, prompts[-3:], SamplingParams(n=3, temperature=0, max_tokens=NEW, ignore_eos=True))
    for o, ref in zip(outs, references[kind][-3:]):
        assert [c.token_ids for c in o.outputs] == [ref] * 3
    assert llm.get_stats().num_cow_copies > 0  # the siblings wrote into the shared last prompt block


def test_long_gemma3_decode_holds_window_blocks_only(models):
    llm = LLM(models["gemma3_text"], kv_cache_memory="16MiB", block_size=BS, max_model_len=512)
    engine = llm.llm_engine
    engine.add_request("long", {"prompt_token_ids": list(range(100, 140))},
                       SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    mgr = engine.engine_core.scheduler.kv_cache_manager
    total = engine.get_stats().num_blocks_total
    seen = 0
    while engine.has_unfinished_requests():
        engine.step()
        if "long" in mgr.groups[0].req_to_blocks:
            full, sliding = (sum(1 for b in g.req_to_blocks["long"] if b.block_id) for g in mgr.groups)
            # Window 8 = 2 blocks + the one being written (+ the rest of a prefill chunk while it runs).
            assert sliding <= 3 + (40 // BS if seen == 0 else 0)
            assert full == len(mgr.groups[0].req_to_blocks["long"])
            assert total - engine.get_stats().num_blocks_free == full + sliding
            seen += 1
    assert seen > 300
