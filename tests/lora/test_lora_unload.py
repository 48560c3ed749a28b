"""Unloading an adapter that requests still use: they finish with it (from memory, never from its path), then it
is dropped."""

from __future__ import annotations

import shutil

from pagemill import LoRARequest, SamplingParams
from pagemill.engine.arg_utils import EngineArgs
from pagemill.engine.llm_engine import LLMEngine
from tests.lora.conftest import hf_peft_greedy

MAX_TOKENS = 10


def run_to_end(engine: LLMEngine) -> dict[str, list[int]]:
    """Step until idle; the final token ids of each request."""
    final: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = list(out.outputs[0].token_ids)
    return final


def test_requests_using_an_unloaded_adapter_finish_with_it(tiny_models, llama_adapters, smol_hf, tmp_path) -> None:
    """remove_lora mid-request, the adapter's files deleted, another adapter queued behind it (one slot, one adapter
    on the host): the request still gets HF + PEFT's tokens; the adapter is gone once it ends; an abort retires it
    too."""
    base = tiny_models["llama"]
    path = str(shutil.copytree(llama_adapters[0], tmp_path / "doomed"))
    doomed, other = LoRARequest("doomed", 1, path), LoRARequest("other", 2, llama_adapters[1])
    prompt = {"prompt_token_ids": smol_hf[1].encode("The capital of France is")}
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine = LLMEngine.from_engine_args(EngineArgs(base, enable_lora=True, max_loras=1, max_cpu_loras=1,
                                                   max_lora_rank=16, kv_cache_memory="64MiB"))
    engine.add_request("r", prompt, greedy, lora_request=doomed)
    engine.step()
    assert engine.remove_lora(1)
    shutil.rmtree(path)
    engine.add_request("o", prompt, greedy, lora_request=other)
    final = run_to_end(engine)
    assert final["r"] == hf_peft_greedy(base, llama_adapters[0], prompt["prompt_token_ids"], MAX_TOKENS)
    assert final["o"] == hf_peft_greedy(base, other.lora_path, prompt["prompt_token_ids"], MAX_TOKENS)
    assert 1 not in engine.list_loras()

    engine.add_request("a", prompt, greedy, lora_request=other)
    engine.step()
    assert engine.remove_lora(2) and 2 in engine.list_loras()
    engine.abort_request(["a"])
    assert engine.list_loras() == set()
    assert engine.remove_lora(2) is False
