"""The CPU path's features on the GPU runner (run on the CPU through Triton's interpreter), each against the CPU
engine on the same tiny model: n > 1 with copy-on-write of the shared prompt blocks, beam search, preemption by swap
to host memory, a JSON-schema constrained request, with and without async scheduling."""

import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from pagemill import LLM, BeamSearchParams, SamplingParams  # noqa: E402
from pagemill.sampling_params import StructuredOutputsParams  # noqa: E402
from tests.conftest import SMOL_PROMPTS  # noqa: E402

GPU_ARGS = dict(attention_backend="triton", worker_cls="pagemill.worker.gpu_worker.GpuWorker", device="cpu")
COMMON = dict(max_model_len=128, block_size=8)


@pytest.fixture(autouse=True)
def _every_kernel_variant():
    """(Overrides any per-ISA parametrisation: these kernels are Triton's.)"""
    yield


def _texts(outputs):
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_parallel_sampling_and_swap_preemption_equal_the_cpu_engine(tiny_models, async_scheduling):
    """n = 3 seeded samples per prompt (their prompt blocks shared, copied on write) in a cache small enough that
    requests are swapped out and back in: the same tokens as the CPU engine's."""
    path = tiny_models["llama"]
    params = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=10, ignore_eos=True)
    prompts = SMOL_PROMPTS[:4]
    kw = dict(num_gpu_blocks_override=24, preemption_mode="swap", swap_space=0.01, max_num_seqs=12, **COMMON)
    gpu = LLM(path, async_scheduling=async_scheduling, **kw, **GPU_ARGS)
    out = gpu.generate(prompts, params, use_tqdm=False)
    assert gpu.llm_engine.engine_core.scheduler.num_preemptions > 0
    ref = LLM(path, attention_backend="torch", **kw).generate(prompts, params, use_tqdm=False)
    assert _texts(out) == _texts(ref)


def test_beam_search_equals_the_cpu_engine(tiny_models):
    path = tiny_models["qwen2"]
    prompts = [{"prompt": p} for p in SMOL_PROMPTS[:3]]
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    gpu = LLM(path, kv_cache_memory="16MiB", **COMMON, **GPU_ARGS).beam_search(prompts, params)
    ref = LLM(path, kv_cache_memory="16MiB", attention_backend="torch", **COMMON).beam_search(prompts, params)
    assert [[s.tokens for s in o.sequences] for o in gpu] == [[s.tokens for s in o.sequences] for o in ref]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_json_schema_request_beside_free_ones(tiny_models, async_scheduling):
    """A JSON-schema request in a batch with unconstrained ones: its text parses and fits the schema; the free
    requests' greedy tokens equal the CPU engine's."""
    path = tiny_models["llama"]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    params = [SamplingParams(temperature=0, max_tokens=24,
                             structured_outputs=StructuredOutputsParams(json=schema))] + \
             [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 3
    prompts = SMOL_PROMPTS[:4]
    gpu = LLM(path, kv_cache_memory="16MiB", async_scheduling=async_scheduling, **COMMON, **GPU_ARGS)
    out = gpu.generate(prompts, params, use_tqdm=False)
    value = json.loads(out[0].outputs[0].text)
    assert isinstance(value, dict) and set(value) == {"a"} and isinstance(value["a"], int)
    ref = LLM(path, kv_cache_memory="16MiB", attention_backend="torch", **COMMON).generate(prompts, params,
                                                                                       use_tqdm=False)
    assert _texts(out[1:]) == _texts(ref[1:])
