"""The KV accounting on a real engine (tiny random Llama, 4-token blocks): the Fig. 2 breakdown while requests
run, the saving of a shared prefix, the Prometheus gauges it feeds, and when the engine core reports it."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry

from pagemill.engine.arg_utils import EngineArgs
from pagemill.engine.core import EngineCore
from pagemill.messages import EngineCoreRequest
from pagemill.metrics.kv_cache import KV_STATS_INTERVAL_S
from pagemill.metrics.prometheus import PrometheusStatLogger
from pagemill.metrics.stats import IterationStats
from pagemill.sampling_params import SamplingParams
from tests.entrypoints.conftest import parse_metrics

BLOCK = 4
NUM_BLOCKS = 64


@pytest.fixture
def core(tiny_llama) -> EngineCore:
    return EngineCore(EngineArgs(tiny_llama, block_size=BLOCK, max_model_len=128, num_gpu_blocks_override=NUM_BLOCKS,
                                 scheduling_policy="two-level").create_engine_config())


def _add(core: EngineCore, rid: str, prompt: list[int], max_tokens: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    core.add_request(EngineCoreRequest(rid, prompt, params, None, time.monotonic()))


def test_breakdown_and_sharing_while_running(core):
    prompt = list(range(100, 110))  # 10 tokens: 2 full blocks and one with 2 of 4 slots filled
    _add(core, "a", prompt, 20)
    core.step()
    mem = core.get_stats().memory
    assert (mem["blocks_used"], mem["token_slots"], mem["slots_fragmented"], mem["blocks_partial"]) == (3, 10, 2, 1)
    assert mem["slots_reserved"] == 0 and mem["blocks_shared"] == 0 and mem["bytes_saved_by_sharing"] == 0
    assert mem["slots_total"] == (NUM_BLOCKS - 1) * BLOCK

    _add(core, "b", prompt, 20)  # finds a's 2 full blocks in the prefix cache
    core.step()  # b computes its last 2 prompt tokens, a one decode token
    stats = core.get_stats()
    mem = stats.memory
    # blocks: 2 shared + a's third (3 of 4 filled) + b's third (2 of 4): 13 token states, 3 empty slots
    assert (mem["blocks_used"], mem["logical_blocks"], mem["blocks_shared"]) == (4, 6, 2)
    assert (mem["token_slots"], mem["slots_fragmented"], mem["blocks_partial"]) == (13, 3, 2)
    block_bytes = 2 * 2 * 2 * BLOCK * 8 * 4  # K and V x 2 layers x 2 KV heads x 4 slots x 8 dims x float32
    assert core.kv_cache_config.block_bytes == block_bytes
    assert mem["blocks_saved_by_sharing"] == 2 and mem["bytes_saved_by_sharing"] == 2 * block_bytes
    assert (stats.prefix_cache_hits, stats.prefix_cache_queries) == (8, 20)

    prom = PrometheusStatLogger(CollectorRegistry(), "m")
    prom.record(stats, IterationStats(), 0.0)
    m = parse_metrics(prom.render().decode())
    assert m["pagemill:kv_cache_token_slots"] == 13 and m["pagemill:kv_cache_fragmented_slots"] == 3
    assert m["pagemill:kv_cache_partial_blocks"] == 2 and m["pagemill:kv_cache_reserved_slots"] == 0
    assert m["pagemill:kv_cache_shared_blocks"] == 2 and m["pagemill:kv_cache_sharing_saved_blocks"] == 2
    assert m["pagemill:kv_cache_sharing_saved_bytes"] == 2 * block_bytes
    assert m["pagemill:kv_cache_total_slots"] == (NUM_BLOCKS - 1) * BLOCK
    assert m["pagemill:kv_cache_prefix_hit_rate"] == pytest.approx(0.4)


def test_the_core_reports_the_accounting_periodically_and_when_drained(core):
    _add(core, "long", list(range(100, 120)), 60)
    time.sleep(KV_STATS_INTERVAL_S)
    first = core.step().scheduler_stats  # an interval has passed: with the accounting
    second = core.step().scheduler_stats  # right after: without (it is not computed every step)
    assert first.memory is not None and first.memory["token_slots"] == 20
    assert second.memory is None
    last = None
    while core.has_unfinished_requests():
        last = core.step().scheduler_stats
    assert last.memory is not None and last.memory["blocks_used"] == 0 and last.memory["token_slots"] == 0
