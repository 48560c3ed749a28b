"""Start-up paths: the engine core started from the arguments (serve), the lazily committed KV cache."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch

from pagemill.engine.arg_utils import EngineArgs


def test_async_llm_bad_model_stops_the_prestarted_core():
    """The core process starts before the front end resolves the arguments; a bad model stops it at once."""
    from pagemill.engine.async_llm import AsyncLLM

    start = time.monotonic()
    with pytest.raises(ValueError, match="does not exist"):
        AsyncLLM.from_engine_args(EngineArgs(model="/no/such/model.gguf"))
    assert time.monotonic() - start < 30
    assert not [p for p in multiprocessing.active_children() if p.name == "pagemill-engine-core"]


def test_async_llm_core_resolves_the_same_config(smol_path):
    """A core started from EngineArgs builds the configuration the front end builds (its KV blocks say so)."""
    from pagemill.engine.async_llm import AsyncLLM

    args = EngineArgs(model=smol_path, kv_cache_memory="64MiB", max_model_len=512, block_size=8)
    engine = AsyncLLM.from_engine_args(args)
    try:
        config = args.create_engine_config()
        per_block = (config.model_config.num_layers * 2 * 8 * config.model_config.num_kv_heads
                     * config.model_config.head_dim * 4)
        kv = engine.client.kv_cache_config
        assert kv.block_size == 8
        assert kv.usable_blocks == 64 * 2**20 // per_block - 1
    finally:
        engine.shutdown()


def test_lazy_zeros_reads_zero_and_commits_on_write():
    from pagemill.worker.model_runner import lazy_zeros

    t = lazy_zeros((4, 1024, 1024), torch.float16)  # 8 MiB
    assert t.shape == (4, 1024, 1024) and t.dtype == torch.float16 and t.data_ptr() % 4096 == 0
    assert not t.any()
    t[1].fill_(1.5)
    assert float(t.float().sum()) == 1.5 * 1024 * 1024
    assert lazy_zeros((0, 3), torch.float32).shape == (0, 3)
