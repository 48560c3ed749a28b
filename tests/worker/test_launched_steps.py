"""Async scheduling without a step thread on the GPU runner (run on the CPU through Triton's interpreter): step N+1 is
launched before step N's tokens reach the host and takes them from the device; the tokens equal the synchronous
runner's (and HF's), with requests finishing and rows reused mid-flight, preemption, and rows whose sampling reads
their earlier outputs (penalties, seeds, min_tokens: those steps wait for the tokens in flight)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from pagemill import LLM, SamplingParams  # noqa: E402
from pagemill.worker.launched_step import DeviceTokens  # noqa: E402
from tests.conftest import SMOL_PROMPTS, hf_greedy  # noqa: E402

GPU_ARGS = dict(attention_backend="triton", worker_cls="pagemill.worker.gpu_worker.GpuWorker", device="cpu")


@pytest.fixture(autouse=True)
def _every_kernel_variant():
    """(Overrides any per-ISA parametrisation: these kernels are Triton's.)"""
    yield


@pytest.fixture
def device_fed(monkeypatch):
    """Counts the input tokens that launched steps took from the device (the previous step's sampled ids)."""
    counts = {"tokens": 0}
    index_of = DeviceTokens.index_of

    def counting(self, rows, row_epoch):
        counts["tokens"] += len(rows)
        return index_of(self, rows, row_epoch)

    monkeypatch.setattr(DeviceTokens, "index_of", counting)
    return counts


def _tokens(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_greedy_with_finishing_requests_and_reused_rows_equals_hf(tiny_models, device_fed):
    """10 requests of different lengths through 4 rows: requests finish while a step is in flight and waiting ones
    take their rows; every request's greedy tokens equal HF float32, and most decode inputs came from the device."""
    from transformers import AutoModelForCausalLM

    path = tiny_models["llama"]
    llm = LLM(path, kv_cache_memory="16MiB", max_model_len=128, max_num_seqs=4, block_size=8,
              async_scheduling=True, **GPU_ARGS)
    core = llm.llm_engine.engine_core
    assert core.executor.launches_steps and core.executor._step_thread is None
    prompts = [SMOL_PROMPTS[i % len(SMOL_PROMPTS)] for i in range(10)]
    params = [SamplingParams(temperature=0, max_tokens=2 + (i * 3) % 7, ignore_eos=True) for i in range(10)]
    out = llm.generate(prompts, params, use_tqdm=False)
    assert core.executor._step_thread is None  # (no step thread was started)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    refs = [hf_greedy(hf, list(o.prompt_token_ids), p.max_tokens) for o, p in zip(out, params)]
    assert _tokens(out) == refs
    decode_inputs = sum(p.max_tokens - 1 for p in params)
    assert device_fed["tokens"] > decode_inputs // 2


def test_preemption_under_launched_steps_equals_hf(tiny_models, device_fed):
    """A KV cache too small for the batch: requests are preempted and resumed while steps are in flight; greedy
    tokens still equal HF float32."""
    from transformers import AutoModelForCausalLM

    path = tiny_models["llama"]
    llm = LLM(path, num_gpu_blocks_override=12, max_model_len=64, max_num_seqs=6, block_size=8,
              async_scheduling=True, enable_prefix_caching=False, **GPU_ARGS)
    prompts = SMOL_PROMPTS[:6]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert _tokens(out) == [hf_greedy(hf, list(o.prompt_token_ids), 12) for o in out]
    assert device_fed["tokens"] > 0


def test_sampling_that_reads_outputs_equals_the_synchronous_runner(tiny_models, device_fed):
    """Seeded sampling, penalties, min_tokens and logprobs beside plain greedy rows: the same tokens and logprobs
    as the synchronous GPU runner (those steps wait for the tokens in flight; the others are launched ahead)."""
    path = tiny_models["llama"]
    common = dict(kv_cache_memory="16MiB", max_model_len=128, block_size=16, **GPU_ARGS)
    params = [SamplingParams(temperature=0.9, top_k=20, seed=7, max_tokens=6, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=1.1, seed=11, max_tokens=6, ignore_eos=True, presence_penalty=0.5,
                             repetition_penalty=1.2),
              SamplingParams(temperature=0, max_tokens=6, min_tokens=4, logprobs=2),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)]
    prompts = SMOL_PROMPTS[:4]
    sync = LLM(path, **common).generate(prompts, params, use_tqdm=False)
    launched = LLM(path, async_scheduling=True, **common).generate(prompts, params, use_tqdm=False)
    assert _tokens(launched) == _tokens(sync)
    for a, s in zip(launched, sync):
        for la, ls in zip(a.outputs[0].logprobs or [], s.outputs[0].logprobs or []):
            assert la.keys() == ls.keys()
            assert all(abs(la[t].logprob - ls[t].logprob) < 1e-5 for t in ls)
    # greedy-only batches do not wait: their inputs come from the device
    greedy = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)] * 4
    device_fed["tokens"] = 0
    a = LLM(path, async_scheduling=True, **common).generate(prompts, greedy, use_tqdm=False)
    assert _tokens(a) == _tokens(LLM(path, **common).generate(prompts, greedy, use_tqdm=False))
    assert device_fed["tokens"] > 0
