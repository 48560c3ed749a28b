"""kv_cache_layout="virtual" on a CUDA GPU (skipped elsewhere; benchmarks/gpu/run.sh runs it): KV chunks made and
mapped with the CUDA driver's virtual memory API into one contiguous range per request; greedy tokens equal the
paged layout's and HF transformers float32 on CUDA, over several chunks, prefix hits, CUDA graphs, eager and async
scheduling."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

_MODELS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu", "models.py")
# One layer's K is 8 heads x 64 x 4 bytes = 2 KiB a token: a 1,024-token block is one 2 MiB chunk.
WIDE = dict(hidden_size=512, intermediate_size=512, num_attention_heads=8, num_key_value_heads=8, head_dim=64,
            max_position_embeddings=4096)
BLOCK = 1024


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> str:
    spec = importlib.util.spec_from_file_location("gpu_models", _MODELS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build("llama", str(tmp_path_factory.mktemp("virtual_kv")), WIDE)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 512, (2100,), generator=g).tolist()
    tails = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 40)]
    alone = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (1010, 30, 700)]
    return [shared + t for t in tails] + alone  # the first crosses into a third chunk while decoding


def _greedy(llm, prompts, n=40):
    from pagemill import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], outs


def test_virtual_ranges_equal_paged_and_hf(wide):
    from transformers import AutoModelForCausalLM

    from pagemill import LLM

    prompts = _prompts()
    common = dict(dtype="float32", max_model_len=4096, kv_cache_memory="2GiB", max_num_seqs=8)
    paged = LLM(wide, block_size=16, **common)
    want, _ = _greedy(paged, prompts)
    del paged
    torch.cuda.empty_cache()
    for over in ({}, {"enforce_eager": True}, {"async_scheduling": True}):
        llm = LLM(wide, kv_cache_layout="virtual", block_size=BLOCK, **common, **over)
        runner = llm.llm_engine.engine_core.executor.driver_worker.model_runner
        assert type(runner).__name__ == "GpuVirtualKVModelRunner"
        space = runner.kv_space
        assert space.chunk_bytes == 2 * 2**20 and space.chunk_bytes % space.granularity == 0
        first, _ = _greedy(llm, prompts[:1])
        rest, outs = _greedy(llm, prompts[1:])  # the second prompt hits the first's two full chunks
        assert first + rest == want, over
        assert outs[0].num_cached_tokens >= 2 * BLOCK
        assert space.num_map_calls > 0 and space.num_range_mappings() > 0
        if not over:
            assert runner.graphs is not None
        del llm, runner, space
        torch.cuda.empty_cache()
    hf = AutoModelForCausalLM.from_pretrained(wide, dtype=torch.float32).cuda().eval()
    for p, got in zip(prompts, want):
        ids = torch.tensor([p], device="cuda")
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=40,
                          min_new_tokens=40, pad_token_id=0)
        assert gen[0, len(p):].tolist() == got


def test_virtual_ranges_sized_by_gpu_memory_utilization(wide):
    """The profiled sizing path makes and gives back a temporary space, then the real one; a short run works."""
    from pagemill import LLM

    llm = LLM(wide, dtype="float32", max_model_len=4096, kv_cache_layout="virtual", block_size=BLOCK,
              gpu_memory_utilization=0.3, max_num_seqs=8)
    tokens, _ = _greedy(llm, _prompts()[2:], n=8)
    assert all(len(t) == 8 for t in tokens)
