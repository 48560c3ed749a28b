"""On a CUDA GPU (skipped elsewhere; benchmarks/gpu/run.sh runs these): the CUDA platform picks the GPU worker, the
KV cache is sized from gpu_memory_utilization after a profiled forward, decode batches replay CUDA graphs, and greedy
tokens equal HF transformers float32 on CUDA with graphs and with enforce_eager (batch, chunked prefill, prefix hits,
preemption, async scheduling with steps launched ahead). Tiny random models built from a config (benchmarks/gpu/models.py): no hub, no SmolLM2 file needed."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

_MODELS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu", "models.py")


def _models():
    spec = importlib.util.spec_from_file_location("gpu_models", _MODELS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return _models().build("llama", str(tmp_path_factory.mktemp("cuda_models")))


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (int(torch.randint(5, 50, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def hf_refs(tiny):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).cuda().eval()
    out = []
    for p in _prompts(12):
        ids = torch.tensor([p], device="cuda")
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                          min_new_tokens=16, pad_token_id=0)
        out.append(gen[0, len(p):].tolist())
    return out


def _greedy(llm, prompts):
    from pagemill import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], outs


def test_platform_worker_and_memory_sizing(tiny):
    from pagemill import LLM
    from pagemill.platforms import current_platform

    assert current_platform.is_cuda() and current_platform.default_dtype == torch.bfloat16
    llm = LLM(tiny, dtype="float32", max_model_len=512, gpu_memory_utilization=0.3, max_num_seqs=16)
    worker = llm.llm_engine.engine_core.executor.driver_worker
    runner = worker.model_runner
    assert type(worker).__name__ == "GpuWorker" and type(runner).__name__ == "GpuModelRunner"
    assert runner.device.type == "cuda" and runner.kv_cache.is_cuda
    assert runner.buffers.host["input_ids"].is_pinned() and runner.buffers.dev["input_ids"].is_cuda
    total = torch.cuda.mem_get_info()[1]
    kv_bytes = runner.kv_cache.numel() * runner.kv_cache.element_size()
    assert 0 < kv_bytes <= 0.3 * total
    assert runner.graphs is not None and sorted(runner.graphs.graphs) == runner.buckets


def test_greedy_equals_hf_with_graphs_and_eager(tiny, hf_refs, monkeypatch):
    from pagemill import LLM
    from pagemill.worker.cuda_graphs import DecodeGraphs

    replays = []
    original = DecodeGraphs.replay
    monkeypatch.setattr(DecodeGraphs, "replay", lambda self, size: replays.append(size) or original(self, size))
    prompts = _prompts(12)
    for over in ({}, {"enforce_eager": True}, {"max_num_batched_tokens": 16}, {"num_gpu_blocks_override": 40},
                 {"async_scheduling": True}, {"async_scheduling": True, "num_gpu_blocks_override": 40}):
        llm = LLM(tiny, dtype="float32", max_model_len=512, kv_cache_memory="64MiB", max_num_seqs=16, **over)
        tokens, _ = _greedy(llm, prompts)
        assert tokens == hf_refs, over
        if not over:
            assert replays, "decode steps should replay CUDA graphs"
            tokens, outs = _greedy(llm, prompts)  # prefix-cache hits
            assert tokens == hf_refs and sum(o.num_cached_tokens for o in outs) > 0
        if over.get("async_scheduling"):  # launched from the engine's thread: no step thread
            assert llm.llm_engine.engine_core.executor._step_thread is None
        if over.get("enforce_eager"):
            assert llm.llm_engine.engine_core.executor.driver_worker.model_runner.graphs is None
        del llm
        torch.cuda.empty_cache()


def test_sampling_on_the_device(tiny):
    """Seeded sampling is reproducible and logprobs come back; the sampled ids are the only per-step copy."""
    from pagemill import LLM, SamplingParams

    llm = LLM(tiny, dtype="float32", max_model_len=256, kv_cache_memory="64MiB")
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, seed=5, max_tokens=8, ignore_eos=True,
                            logprobs=2, presence_penalty=0.3, logit_bias={7: 3.0})
    a = llm.generate([{"prompt_token_ids": p} for p in _prompts(4)], params, use_tqdm=False)
    b = llm.generate([{"prompt_token_ids": p} for p in _prompts(4)], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert all(len(o.outputs[0].logprobs) == 8 for o in a)


def test_lora_adapters_on_cuda_equal_hf_peft(tiny, tmp_path):
    """Two adapters and the base model in one batch on CUDA (LoRA rows run eagerly): HF + PEFT's greedy tokens on
    CUDA, float32."""
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from pagemill import LLM, LoRARequest, SamplingParams
    from tests.lora.conftest import make_adapter

    adapters = [make_adapter(tiny, str(tmp_path / f"a{i}"), seed=i + 1, rank=8) for i in range(2)]
    prompts = _prompts(3, seed=4)
    want = []
    for path in (None, *adapters):
        hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
        if path is not None:
            hf = PeftModel.from_pretrained(hf, path)
        hf = hf.cuda().eval()
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            with torch.inference_mode():
                gen = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                                  min_new_tokens=8, pad_token_id=0)
            want.append(gen[0, len(p):].tolist())
    llm = LLM(tiny, dtype="float32", max_model_len=256, kv_cache_memory="64MiB", enable_lora=True, max_loras=2,
              max_lora_rank=8)
    loras = [None, *(LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(adapters))]
    cases = [(lo, p) for lo in loras for p in prompts]
    outs = llm.generate([{"prompt_token_ids": p} for _, p in cases],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False,
                        lora_request=[lo for lo, _ in cases])
    assert [list(o.outputs[0].token_ids) for o in outs] == want
