"""Scheduling policies in the engine (tiny random Llama): the flags reach the scheduler, and every policy yields
the tokens fcfs yields, through chunked prefills, preemptions and prefix-cache hits."""

from __future__ import annotations

import random
import time

import pytest

from pagemill.config import SCHEDULING_POLICIES

from pagemill.core.sched_policy import SRTFQueue, TwoLevelQueue
from pagemill.engine.arg_utils import EngineArgs
from pagemill.engine.core import EngineCore
from pagemill.entrypoints.cli import build_parser
from pagemill.entrypoints.openai.cli_args import engine_args_from_namespace
from pagemill.messages import EngineCoreRequest
from pagemill.sampling_params import SamplingParams


def test_flags_reach_the_scheduler(tiny_llama):
    args = build_parser().parse_args(["serve", tiny_llama, "--scheduling-policy", "srtf",
                                      "--scheduling-max-passed-over", "5", "--scheduling-staging-size", "3"])
    config = engine_args_from_namespace(args).create_engine_config().scheduler_config
    assert (config.policy, config.max_passed_over, config.staging_size) == ("srtf", 5, 3)
    core = EngineCore(EngineArgs(tiny_llama, scheduling_policy="two-level", scheduling_staging_size=3,
                                 max_model_len=64, num_gpu_blocks_override=32).create_engine_config())
    assert isinstance(core.scheduler.waiting, TwoLevelQueue) and core.scheduler.waiting.staging_size == 3
    core = EngineCore(EngineArgs(tiny_llama, scheduling_policy="srtf", scheduling_max_passed_over=5,
                                 max_model_len=64, num_gpu_blocks_override=32).create_engine_config())
    assert isinstance(core.scheduler.waiting, SRTFQueue) and core.scheduler.waiting.max_passed_over == 5
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineArgs(tiny_llama, scheduling_policy="lifo").create_engine_config()


def _generate(model: str, policy: str) -> tuple[dict[str, list[int]], int]:
    """Greedy outputs of a mixed batch (some prompts share a prefix) on a small KV cache and token budget."""
    core = EngineCore(EngineArgs(model, block_size=4, max_model_len=128, num_gpu_blocks_override=40,
                                 max_num_batched_tokens=24, scheduling_policy=policy,
                                 scheduling_max_passed_over=3, scheduling_staging_size=2).create_engine_config())
    rng = random.Random(0)
    shared = [rng.randrange(100, 5000) for _ in range(12)]
    for i in range(10):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(100, 5000) for _ in range(rng.randrange(3, 40))]
        params = SamplingParams(temperature=0, max_tokens=rng.randrange(4, 30), ignore_eos=True,
                                expected_output_tokens=rng.choice([None, 2, 50]))
        core.add_request(EngineCoreRequest(f"r{i}", prompt, params, None, time.monotonic()))
    outputs: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    return outputs, core.get_stats().num_preemptions


@pytest.fixture(scope="module")
def fcfs_outputs(tiny_llama) -> dict[str, list[int]]:
    return _generate(tiny_llama, "fcfs")[0]


@pytest.mark.parametrize("policy", [p for p in SCHEDULING_POLICIES if p != "fcfs"])
def test_every_policy_generates_the_fcfs_tokens(tiny_llama, fcfs_outputs, policy):
    outputs, preemptions = _generate(tiny_llama, policy)
    assert preemptions > 0, "39 blocks of 4 tokens cannot hold the batch: something must be preempted"
    assert outputs == fcfs_outputs
