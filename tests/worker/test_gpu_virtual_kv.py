"""kv_cache_layout="virtual" on the GPU runner (vTensor), run on the CPU through Triton's interpreter over the host's
memfd ranges (the CUDA driver's ranges are tested in tests/cuda): each request's KV is one contiguous range read by
the paged kernel as a single block; tokens equal the CPU engine's paged run."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from pagemill import LLM, SamplingParams  # noqa: E402
from tests.conftest import SMOL_PROMPTS  # noqa: E402

GPU_ARGS = dict(attention_backend="triton", worker_cls="pagemill.worker.gpu_worker.GpuWorker", device="cpu")
# the tiny models' K of one layer is 64 bytes a token: a 64-token block is one 4 KiB page (a chunk)
COMMON = dict(max_model_len=256, block_size=64, kv_cache_layout="virtual")


@pytest.fixture(autouse=True)
def _every_kernel_variant():
    """(Overrides any per-ISA parametrisation: these kernels are Triton's.)"""
    yield


def _tokens(outputs):
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


def _runner(llm):
    return llm.llm_engine.engine_core.executor.driver_worker.model_runner


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_over_chunks_and_prefix_hits_equals_the_paged_engine(tiny_models, async_scheduling):
    """Prompts sharing a 130-token prefix (two full chunks hit in the prefix cache, mapped into a second slot) and
    decodes that cross into a new chunk: the paged CPU engine's greedy tokens; chunks were mapped."""
    path = tiny_models["llama"]
    rng = np.random.default_rng(0)
    prefix = rng.integers(100, 1000, 130).tolist()
    prompts = [{"prompt_token_ids": prefix + rng.integers(100, 1000, n).tolist()} for n in (3, 9, 60)]
    prompts.append({"prompt_token_ids": rng.integers(100, 1000, 40).tolist()})
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    gpu = LLM(path, kv_cache_memory="16MiB", async_scheduling=async_scheduling, max_num_batched_tokens=256,
              **COMMON, **GPU_ARGS)
    first = gpu.generate(prompts[:1], params, use_tqdm=False)
    rest = gpu.generate(prompts[1:], params, use_tqdm=False)
    runner = _runner(gpu)
    assert type(runner).__name__ == "GpuVirtualKVModelRunner"
    assert runner.kv_space.num_map_calls > 0
    assert all(o.num_cached_tokens >= 128 for o in rest[:2])  # two full chunks of the shared prefix
    ref = LLM(path, kv_cache_memory="16MiB", attention_backend="torch", max_model_len=256)
    want = ref.generate(prompts, params, use_tqdm=False)
    assert _tokens(first + rest) == _tokens(want)


def test_parallel_sampling_equals_the_paged_engine(tiny_models):
    """n = 3 seeded samples per prompt (the prompt chunk shared by three slots, copied on write in the pool when a
    sample writes into it): the paged CPU engine's tokens."""
    path = tiny_models["llama"]
    # top_k: a random model's distribution is nearly flat over 49k tokens, so logits that differ by float noise
    # (Triton's interpreter vs torch attention) could move a draw between two tail tokens (seen on a Zen 4)
    params = SamplingParams(n=3, temperature=0.8, top_k=8, seed=5, max_tokens=70, ignore_eos=True)
    prompts = SMOL_PROMPTS[:4]
    gpu = LLM(path, num_gpu_blocks_override=40, max_num_seqs=12, **COMMON, **GPU_ARGS)
    out = gpu.generate(prompts, params, use_tqdm=False)
    ref = LLM(path, attention_backend="torch", max_model_len=256, block_size=64, num_gpu_blocks_override=40,
              max_num_seqs=12)
    assert _tokens(out) == _tokens(ref.generate(prompts, params, use_tqdm=False))


def test_swap_preemption_greedy_equals_the_paged_engine(tiny_models):
    """Requests swapped out to host memory and back into other chunks (and slots): remapped ranges read the swapped-in
    KV; greedy tokens equal the paged CPU engine's."""
    path = tiny_models["llama"]
    params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    kw = dict(preemption_mode="swap", swap_space=0.01, num_gpu_blocks_override=6, max_num_seqs=12)
    gpu = LLM(path, **kw, **COMMON, **GPU_ARGS)
    out = gpu.generate(SMOL_PROMPTS[:4], params, use_tqdm=False)
    assert gpu.llm_engine.engine_core.scheduler.num_preemptions > 0
    ref = LLM(path, attention_backend="torch", max_model_len=256, block_size=64, **kw)
    assert _tokens(out) == _tokens(ref.generate(SMOL_PROMPTS[:4], params, use_tqdm=False))


def test_ranges_are_the_pool_chunks(tiny_models):
    """After a request: its slot's range of each layer reads the pool's blocks of its block table, in order."""
    path = tiny_models["llama"]
    gpu = LLM(path, kv_cache_memory="16MiB", **COMMON, **GPU_ARGS)
    runner = _runner(gpu)
    space = runner.kv_space
    space.map_ahead_in_background = False
    prompt = {"prompt_token_ids": list(range(100, 250))}
    out = gpu.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert out[0].outputs[0].token_ids
    slots = np.flatnonzero((space.mapped >= 0).any(axis=1))
    assert len(slots) == 1
    slot = int(slots[0])
    blocks = space.mapped[slot][space.mapped[slot] >= 0]
    assert len(blocks) == 3  # 150 tokens in 64-token chunks
    view = space.layer_view(1)
    for kv in (0, 1):
        got = view[kv, slot + 1, :150]
        want = torch.cat([space.pool[1, kv, int(b)] for b in blocks])[:150]
        assert torch.equal(got, want) and got.abs().sum() > 0


def test_block_size_limits_name_the_field():
    from pagemill.config import CacheConfig

    assert CacheConfig(block_size=2048, kv_cache_layout="virtual").block_size == 2048
    with pytest.raises(ValueError, match="block_size"):
        CacheConfig(block_size=2048)
