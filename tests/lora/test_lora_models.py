"""Greedy output with LoRA adapters equals HF transformers + PEFT token for token, whatever the batch mixes."""

from __future__ import annotations

import os

import pytest
import torch

from pagemill import LLM, LoRARequest, SamplingParams
from pagemill.kernels import load_kernels
from tests.lora.conftest import TARGETS, hf_peft_greedy, make_adapter

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
MAX_TOKENS = 10


def greedy(n: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def lora_requests(paths: list[str]) -> list[LoRARequest]:
    return [LoRARequest(os.path.basename(p), i + 1, p) for i, p in enumerate(paths)]


def run_mixed(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None]) -> list[list[int]]:
    """Every prompt with every adapter (and the base model), all in one generate call."""
    cases = [(lo, p) for lo in loras for p in prompts]
    outs = llm.generate([{"prompt_token_ids": p} for _, p in cases], greedy(), use_tqdm=False,
                        lora_request=[lo for lo, _ in cases])
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("attention_backend", ["auto", "torch"])
def test_mixed_batch_equals_hf_peft(tiny_models, llama_adapters, smol_hf, attention_backend: str) -> None:
    """Three adapters (different ranks, targets, rsLoRA) and the base model in one batch, two slots: each request
    gets exactly HF + PEFT's output, with the compiled LoRA kernel and with the torch reference ops."""
    base = tiny_models["llama"]
    tok = smol_hf[1]
    prompts = [tok.encode(t) for t in PROMPTS]
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=3, kv_cache_memory="64MiB",
              attention_backend=attention_backend)
    runner = llm.llm_engine.engine_core.executor.model_runner
    kernels = load_kernels() if attention_backend == "auto" else None
    assert all(layer.ops.kernels is kernels for layer in runner.lora_manager.layers.values())
    loras = [None, *lora_requests(llama_adapters)]
    got = run_mixed(llm, prompts, loras)
    want = [hf_peft_greedy(base, lo and lo.lora_path, p, MAX_TOKENS) for lo in loras for p in prompts]
    assert got == want
    assert len({tuple(g) for g in got}) == len(got)  # every adapter changes the output
    assert llm.get_stats().num_running_reqs == 0


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma3_text", "phi3"])
def test_families_with_an_adapter_equal_hf_peft(tiny_models, smol_hf, tmp_path, family: str) -> None:
    """QKV biases (Qwen2), QK norm (Qwen3), sandwich norms and sliding windows (Gemma 3), HF-fused projections
    (Phi-3): the adapter's delta lands on the right shards."""
    base = tiny_models[family]
    adapter = make_adapter(base, str(tmp_path / "adapter"), 5, 8, TARGETS.get(family))
    prompts = [smol_hf[1].encode(t) for t in PROMPTS[:2]]
    llm = LLM(base, enable_lora=True, max_loras=1, max_lora_rank=8, kv_cache_memory="64MiB")
    loras = [None, *lora_requests([adapter])]
    assert run_mixed(llm, prompts, loras) == [hf_peft_greedy(base, lo and lo.lora_path, p, MAX_TOKENS)
                                              for lo in loras for p in prompts]


def test_adapters_evicted_from_host_and_slots_reload(tiny_models, llama_adapters, smol_hf) -> None:
    """One slot, one adapter kept on the host: alternating adapters reload them, with the same outputs."""
    base = tiny_models["llama"]
    prompt = smol_hf[1].encode(PROMPTS[0])
    loras = lora_requests(llama_adapters)
    small = LLM(base, enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=16, kv_cache_memory="64MiB")
    roomy = LLM(base, enable_lora=True, max_loras=3, max_lora_rank=16, kv_cache_memory="64MiB")
    want = run_mixed(roomy, [prompt], loras)
    for lora, expected in [*zip(loras, want), *zip(loras, want)]:
        out = small.generate({"prompt_token_ids": prompt}, greedy(), use_tqdm=False, lora_request=lora)
        assert list(out[0].outputs[0].token_ids) == expected
        assert small.llm_engine.list_loras() == {lora.lora_int_id}
    assert small.llm_engine.remove_lora(loras[2].lora_int_id)
    assert small.llm_engine.list_loras() == set()


def test_prefix_cache_is_per_adapter(tiny_models, llama_adapters, smol_hf) -> None:
    """A prompt cached under one adapter is not reused by another adapter or the base model (other KV)."""
    base = tiny_models["llama"]
    prompt = smol_hf[1].encode(" ".join(PROMPTS) * 3)
    loras = [None, *lora_requests(llama_adapters[:2])]
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=16, kv_cache_memory="64MiB")
    fresh = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=16, kv_cache_memory="64MiB",
                enable_prefix_caching=False)
    want = run_mixed(fresh, [prompt], loras)
    for lora, expected in zip(loras, want):  # one after the other: each finds the others' blocks cached
        out = llm.generate({"prompt_token_ids": prompt}, greedy(), use_tqdm=False, lora_request=lora)
        assert list(out[0].outputs[0].token_ids) == expected
        assert out[0].num_cached_tokens == 0
    again = llm.generate({"prompt_token_ids": prompt}, greedy(), use_tqdm=False, lora_request=loras[1])
    assert list(again[0].outputs[0].token_ids) == want[1] and again[0].num_cached_tokens > 0


def test_speculative_decoding_with_adapters(tiny_models, llama_adapters, smol_hf) -> None:
    """n-gram drafts verified under each request's adapter: the greedy output does not change."""
    base = tiny_models["llama"]
    prompts = [smol_hf[1].encode(PROMPTS[1] * 4)]
    loras = [None, *lora_requests(llama_adapters[:2])]
    plain = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=16, kv_cache_memory="64MiB")
    spec = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=16, kv_cache_memory="64MiB",
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    assert run_mixed(spec, prompts, loras) == run_mixed(plain, prompts, loras)


def test_bad_lora_requests_are_clear_errors_and_leave_the_engine_clean(tiny_models, llama_adapters, tmp_path,
                                                                       smol_hf) -> None:
    base = tiny_models["llama"]
    prompt = {"prompt_token_ids": smol_hf[1].encode(PROMPTS[0])}
    no_lora = LLM(base, kv_cache_memory="64MiB")
    with pytest.raises(ValueError, match="lora_request: LoRA is not enabled"):
        no_lora.generate(prompt, greedy(), use_tqdm=False, lora_request=lora_requests(llama_adapters[:1])[0])
    llm = LLM(base, enable_lora=True, max_loras=1, max_lora_rank=8, kv_cache_memory="64MiB")
    free = llm.get_stats().num_blocks_free
    other = make_adapter(tiny_models["qwen3"], str(tmp_path / "qwen3"), 9, 8)  # head_dim 32: other q/k/v shapes
    for lora, message in [(LoRARequest("big", 1, llama_adapters[2]), "larger than max_lora_rank"),
                          (LoRARequest("gone", 2, str(tmp_path / "nowhere")), "is not a directory"),
                          (LoRARequest("qwen3", 3, other), "the model's layer needs")]:
        with pytest.raises(ValueError, match=message):
            llm.generate([prompt, prompt], greedy(), use_tqdm=False, lora_request=[None, lora])
    ok = LoRARequest("ok", 4, llama_adapters[0])
    with pytest.raises(ValueError, match="lora_int_id 4 is already in use"):
        llm.generate(prompt, greedy(), use_tqdm=False, lora_request=ok)
        llm.generate(prompt, greedy(), use_tqdm=False, lora_request=LoRARequest("other", 4, llama_adapters[1]))
    with pytest.raises(ValueError, match="lora_request has 1 entries for 2 prompts"):
        llm.generate([prompt, prompt], greedy(), use_tqdm=False, lora_request=[ok])
    stats = llm.get_stats()
    assert stats.num_running_reqs == stats.num_waiting_reqs == 0 and stats.num_blocks_free == free


@pytest.mark.slow
def test_smollm2_adapter_equals_hf_peft(smol_path, tmp_path) -> None:
    """A rank-16 adapter of the real SmolLM2 on all seven projections, served from its GGUF (Q4_1 kernels), mixed
    with the base model: HF + PEFT's tokens."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.split(smol_path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, init_lora_weights=False, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02)
    adapter = str(tmp_path / "smol-lora")
    peft_model.save_pretrained(adapter)
    prompts = [tok.encode(t) for t in PROMPTS]

    def hf(ids: list[int], with_adapter: bool) -> list[int]:
        with torch.inference_mode():
            if with_adapter:
                out = peft_model.generate(input_ids=torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_TOKENS,
                                          min_new_tokens=MAX_TOKENS, pad_token_id=0)
            else:
                with peft_model.disable_adapter():
                    out = peft_model.generate(input_ids=torch.tensor([ids]), do_sample=False,
                                              max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, pad_token_id=0)
        return out[0, len(ids):].tolist()

    peft_model.eval()
    loras = [None, LoRARequest("smol-lora", 1, adapter)]
    want = [hf(p, lo is not None) for lo in loras for p in prompts]
    llm = LLM(smol_path, enable_lora=True, max_lora_rank=16, kv_cache_memory="256MiB", max_model_len=1024)
    got = run_mixed(llm, prompts, loras)
    assert got == want
    assert got[:3] != got[3:]


def test_parallel_sampling_beam_search_and_chat_carry_the_adapter(tiny_models, llama_adapters, smol_hf) -> None:
    """n > 1 children, beam search steps and chat requests all run with the request's adapter."""
    from pagemill import BeamSearchParams

    base = tiny_models["llama"]
    tok = smol_hf[1]
    prompt = tok.encode(PROMPTS[2])
    lora = lora_requests(llama_adapters[:1])[0]
    llm = LLM(base, enable_lora=True, max_loras=1, max_lora_rank=16, kv_cache_memory="64MiB")
    want = hf_peft_greedy(base, lora.lora_path, prompt, MAX_TOKENS)
    two = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS,
                                                                   ignore_eos=True), use_tqdm=False, lora_request=lora)
    assert [list(c.token_ids) for c in two[0].outputs] == [want, want]
    beams = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=1, max_tokens=MAX_TOKENS,
                                                                             ignore_eos=True), lora_request=lora)
    assert beams[0].sequences[0].tokens[len(prompt):] == want
    messages = [{"role": "user", "content": "Hello"}]
    chat_ids = llm.render_chat(messages)
    chat = llm.chat(messages, greedy(), use_tqdm=False, lora_request=lora)
    assert list(chat[0].outputs[0].token_ids) == hf_peft_greedy(base, lora.lora_path, chat_ids, MAX_TOKENS)
