"""Parallel options: flags, defaults, the combinations refused with errors naming the field, core binding."""

from __future__ import annotations

import argparse

import pytest

from pagemill.config import ParallelConfig

from pagemill.distributed.parallel_state import layer_range
from pagemill.engine.arg_utils import EngineArgs
from pagemill.entrypoints.openai.cli_args import add_engine_args, engine_args_from_namespace
from pagemill.layers.linear import kv_heads_per_rank
from pagemill.platforms.cpu_binding import rank_cores


def test_cli_flags_and_short_forms():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from_namespace(parser.parse_args(["-tp", "2", "-pp", "3",
                                                         "--distributed-executor-backend", "mp"]))
    assert (args.tensor_parallel_size, args.pipeline_parallel_size, args.distributed_executor_backend) == (2, 3, "mp")
    args = engine_args_from_namespace(parser.parse_args(["--tensor-parallel-size", "4",
                                                         "--distributed-executor-backend", "ray"]))
    assert args.distributed_executor_backend == "ray"
    assert args.tensor_parallel_size == 4 and args.pipeline_parallel_size == 1


def test_backend_defaults_and_bad_values():
    assert ParallelConfig().distributed_executor_backend == "uni"
    assert ParallelConfig(2, 1).distributed_executor_backend == "mp"
    assert ParallelConfig(2, 2).world_size == 4
    with pytest.raises(ValueError, match="distributed_executor_backend='uni'"):
        ParallelConfig(2, 1, "uni")
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of"):
        ParallelConfig(1, 1, "nccl")
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        ParallelConfig(0, 1)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be a positive integer"):
        ParallelConfig(1, -1)


@pytest.mark.parametrize("extra,field", [
    (dict(enable_lora=True), "enable_lora"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative_config"),
    (dict(batch_invariant=True), "batch_invariant"),
    (dict(tensor_parallel_size=3), "tensor_parallel_size \\(3\\) must divide the model's 4 attention heads"),
    (dict(pipeline_parallel_size=3), "pipeline_parallel_size \\(3\\) is larger than the model's 2 layers"),
])
def test_refused_combinations_name_the_field(tiny_llama, extra, field):
    args = dict(model=tiny_llama, tensor_parallel_size=2) | extra
    with pytest.raises(ValueError, match=field):
        EngineArgs(**args).create_engine_config()


def test_pooling_and_gguf_blocks_refused(smol_path, tmp_path):
    with pytest.raises(ValueError, match="runner: pooling models"):
        EngineArgs(model=smol_path, runner="pooling", pipeline_parallel_size=2).create_engine_config()
    with pytest.raises(ValueError, match="quantization: GGUF blocks are not sliced"):
        EngineArgs(model=smol_path, tensor_parallel_size=3).create_engine_config()
    # SmolLM2's 9 heads split over 3 ranks once its weights are decoded to float; not over 2
    EngineArgs(model=smol_path, tensor_parallel_size=3, quantization="none").create_engine_config()
    with pytest.raises(ValueError, match="tensor_parallel_size \\(2\\) must divide the model's 9 attention heads"):
        EngineArgs(model=smol_path, tensor_parallel_size=2, quantization="none").create_engine_config()


def test_layer_split_and_kv_head_shares():
    assert [layer_range(5, r, 2) for r in range(2)] == [(0, 3), (3, 5)]
    assert [layer_range(4, r, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert kv_heads_per_rank(8, 4, 2) == 2
    assert kv_heads_per_rank(8, 2, 4) == 1  # replicated: two ranks read each K/V head
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        kv_heads_per_rank(8, 3, 2)


def test_rank_cores():
    assert rank_cores(2, "0-1|2,3") == [[0, 1], [2, 3]]
    assert rank_cores(3, "nobind") == [None, None, None]
    auto = rank_cores(2, "auto")
    assert all(c is None or len(c) >= 1 for c in auto)
    with pytest.raises(ValueError, match="VLLM_CPU_OMP_THREADS_BIND"):
        rank_cores(2, "0-1")
    with pytest.raises(ValueError, match="VLLM_CPU_OMP_THREADS_BIND"):
        rank_cores(1, "x-y")
