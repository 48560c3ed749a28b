"""The data-parallel router without processes: vLLM's load score, prefix affinity and its imbalance brake."""

from __future__ import annotations

from pagemill.config import DataParallelConfig
from pagemill.engine.dp_core_client import split_cpus, sum_stats
from pagemill.engine.dp_router import DPRouter, PrefixIndex
from pagemill.messages import EngineCoreRequest
from pagemill.metrics.stats import SchedulerStats
from pagemill.sampling_params import SamplingParams

BLOCK = 4


def _req(rid: str, tokens: list[int], salt: str | None = None) -> EngineCoreRequest:
    return EngineCoreRequest(rid, tokens, SamplingParams(max_tokens=1), None, 0.0, cache_salt=salt)


def _router(routing: str, threshold: int = 16, n: int = 2, capacity: int = 100) -> DPRouter:
    return DPRouter(DataParallelConfig(n, routing, threshold), BLOCK, "builtin", True, [capacity] * n)


def test_least_loaded_scores_waiting_four_times_running():
    r = _router("least-loaded")
    r.update_stats(0, SchedulerStats(num_running_reqs=3, num_waiting_reqs=0))  # score 3
    r.update_stats(1, SchedulerStats(num_running_reqs=0, num_waiting_reqs=1))  # score 4
    assert [r.score(0), r.score(1)] == [3, 4]
    assert r.route(_req("a", [1, 2])) == 0  # now 4 waiting-equivalent on 0: 3 + 4 = 7
    assert r.score(0) == 7
    assert r.route(_req("b", [1, 2])) == 1
    r.update_stats(0, SchedulerStats(num_running_reqs=1))  # fresh stats replace the router's own counts
    assert r.score(0) == 1


def test_burst_alternates_between_idle_engines():
    r = _router("least-loaded", n=3)
    assert [r.route(_req(str(i), [i])) for i in range(6)] == [0, 1, 2, 0, 1, 2]


def test_affinity_follows_the_prefix_and_ignores_partial_blocks():
    r = _router("prefix-affinity")
    shared = list(range(100, 108))  # two full blocks
    assert r.route(_req("a", shared + [1, 2])) == 0
    assert r.route(_req("b", [7, 7, 7, 7, 8])) == 1  # no match: least loaded
    # engine 0 is busier now, but it holds the prefix and the lead is below the threshold
    assert r.route(_req("c", shared + [3])) == 0
    assert r.num_affinity_routed == 1
    assert r.route(_req("d", [9, 9, 9])) == 1  # shorter than a block: nothing to match
    # the same tokens under another cache salt are another prefix
    salted = r.block_hashes(_req("e", shared, salt="s"))
    assert r.indexes[0].match(salted) == 0 and r.indexes[0].match(r.block_hashes(_req("f", shared))) == 2


def test_affinity_yields_to_the_least_loaded_engine_beyond_the_threshold():
    r = _router("prefix-affinity", threshold=8)
    prefix = list(range(50, 58))
    assert r.route(_req("a", prefix)) == 0
    r.update_stats(0, SchedulerStats(num_waiting_reqs=2))  # score 8 vs 0: a lead of 8 is tolerated
    assert r.route(_req("b", prefix)) == 0
    r.update_stats(0, SchedulerStats(num_waiting_reqs=2, num_running_reqs=1))  # 9 vs 0: too much
    assert r.route(_req("c", prefix)) == 1
    r.update_stats(1, SchedulerStats(num_running_reqs=5))  # both hold the prefix now: the less loaded wins
    assert r.route(_req("d", prefix)) == 1
    r.update_stats(1, SchedulerStats(num_running_reqs=10))
    assert r.route(_req("e", prefix)) == 0


def test_least_loaded_routing_never_looks_at_prefixes():
    r = _router("least-loaded")
    prefix = list(range(50, 58))
    assert [r.route(_req(str(i), prefix)) for i in range(4)] == [0, 1, 0, 1]


def test_prefix_index_is_bounded_lru():
    index = PrefixIndex(capacity=3)
    index.insert([1, 2, 3])
    assert index.match([1, 2, 3, 4]) == 3
    index.insert([1, 9])  # 1 becomes most recent; 2 is the oldest and goes
    assert len(index.hashes) == 3
    assert index.match([1, 2]) == 1 and index.match([3]) == 1 and index.match([9]) == 1


def test_split_cpus():
    assert split_cpus([0, 1, 2, 3], 2) == [[0, 1], [2, 3]]
    assert split_cpus([0, 1, 2], 2) == [[0], [1]]
    assert split_cpus([5], 2) == [[5], [5]]


def test_sum_stats():
    total = sum_stats([SchedulerStats(num_running_reqs=1, num_blocks_total=10, num_blocks_free=5, prefix_cache_hits=3),
                       SchedulerStats(num_waiting_reqs=2, num_blocks_total=10, num_blocks_free=10)])
    assert (total.num_running_reqs, total.num_waiting_reqs, total.prefix_cache_hits) == (1, 2, 3)
    assert total.kv_cache_usage == 0.25


def test_data_parallel_config_errors_name_the_field():
    import pytest

    with pytest.raises(ValueError, match="data_parallel_size"):
        DataParallelConfig(0)
    with pytest.raises(ValueError, match="dp_routing"):
        DataParallelConfig(2, "random")
    with pytest.raises(ValueError, match="dp_imbalance_threshold"):
        DataParallelConfig(2, "least-loaded", -1)


def test_serve_flags():
    import argparse

    import pytest

    from pagemill.entrypoints.openai.cli_args import add_serve_args, engine_args_from_namespace

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = engine_args_from_namespace(parser.parse_args(["-dp", "2", "--dp-routing", "least-loaded",
                                                         "--dp-imbalance-threshold", "4"]))
    assert (args.data_parallel_size, args.dp_routing, args.dp_imbalance_threshold) == (2, "least-loaded", 4)
    default = engine_args_from_namespace(parser.parse_args([]))
    assert (default.data_parallel_size, default.dp_routing) == (1, "prefix-affinity")
    with pytest.raises(SystemExit):
        parser.parse_args(["--dp-routing", "random"])
