"""EngineCore on the real model: the scheduler is built from the worker's KVCacheConfig, events and worker timings
come back on the outputs (no back-channels into the scheduler or the model runner)."""

from __future__ import annotations

import dataclasses
import time

import pytest

from pagemill.core.kv_cache_utils import KVCacheConfig
from pagemill.engine.arg_utils import EngineArgs
from pagemill.engine.core import EngineCore
from pagemill.messages import EngineCoreEventType, EngineCoreOutput, EngineCoreRequest
from pagemill.sampling_params import SamplingParams

NUM_BLOCKS = 12  # 11 usable blocks of 16 tokens: four 80-token requests cannot all fit


@pytest.fixture(scope="module")
def core(smol_path) -> EngineCore:
    config = EngineArgs(smol_path, max_model_len=128, num_gpu_blocks_override=NUM_BLOCKS,
                        enable_prefix_caching=False).create_engine_config()
    return EngineCore(dataclasses.replace(config, profile=True))


def _run(core: EngineCore, prompts: list[list[int]], max_tokens: int) -> dict[str, list[EngineCoreOutput]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"r{i}", ids, params, None, time.monotonic()))
    outs: dict[str, list[EngineCoreOutput]] = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            outs[o.request_id].append(o)
    return outs


def test_kv_cache_config_reaches_the_scheduler(core):
    assert core.kv_cache_config == KVCacheConfig(NUM_BLOCKS, 16, 0)
    assert core.kv_cache_config.usable_blocks == NUM_BLOCKS - 1
    stats = core.get_stats()
    assert stats.num_blocks_total == NUM_BLOCKS - 1 and stats.num_blocks_free == NUM_BLOCKS - 1
    assert not hasattr(core.config.cache_config, "num_blocks")  # the config is not written back


def test_scheduled_event_comes_with_the_first_token(core):
    start = time.monotonic()
    outs = _run(core, [[1, 2, 3, 4, 5]], max_tokens=3)["r0"]
    first, rest = outs[0], outs[1:]
    assert first.new_token_ids and [e.type for e in first.events] == [EngineCoreEventType.SCHEDULED]
    assert start <= first.events[0].timestamp <= time.monotonic()
    assert all(o.events is None for o in rest)  # each event is sent once


def test_preemption_is_reported(core):
    outs = _run(core, [[10 + i] * 20 for i in range(4)], max_tokens=60)
    events = [e for seq in outs.values() for o in seq for e in (o.events or [])]
    preempted = [e for e in events if e.type == EngineCoreEventType.PREEMPTED]
    assert preempted, "11 blocks cannot hold four 80-token sequences: something must be preempted"
    for seq in outs.values():
        kinds = [e.type for o in seq for e in (o.events or [])]
        assert kinds[0] == EngineCoreEventType.SCHEDULED
        # every preemption is followed by a new scheduling
        assert kinds.count(EngineCoreEventType.PREEMPTED) == kinds.count(EngineCoreEventType.SCHEDULED) - 1
        assert sum(len(o.new_token_ids) for o in seq) == 60
    assert core.get_stats().num_preemptions >= len(preempted)


def test_worker_timings_reach_the_profiler(core):
    core.profiler.reset()
    _run(core, [[1, 2, 3]], max_tokens=2)
    report = core.profiler.report()
    for section in ("schedule", "prepare", "forward", "logits", "sample", "update"):
        assert report[f"{section}_ms"] > 0, section
    assert report["steps"] == 2
