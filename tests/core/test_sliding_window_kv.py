"""KV cache groups: sliding-window groups drop the blocks behind their window; prefix hits need the window's blocks."""

from __future__ import annotations

import random

import pytest

from pagemill.config import CacheConfig, SchedulerConfig
from pagemill.core.kv_cache_manager import KVCacheManager
from pagemill.core.kv_cache_utils import KVCacheConfig, kv_cache_groups
from pagemill.core.sched_output import ModelRunnerOutput
from pagemill.core.scheduler import Scheduler
from pagemill.request import Request, RequestStatus
from pagemill.sampling_params import SamplingParams
from tests.core.test_scheduler_invariants import check_invariants_of_manager, run_random_workload

BS, W = 4, 8


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=512, ignore_eos=True), None, 0.0)


def _non_null(mgr: KVCacheManager, group: int, rid: str) -> int:
    return sum(1 for b in mgr.groups[group].req_to_blocks[rid] if b.block_id)


def _run(mgr: KVCacheManager, req: Request, n: int) -> None:
    assert mgr.allocate_slots(req, n) is not None
    req.num_computed_tokens += n


def test_grouping_follows_vllm_hybrid_layout():
    gemma = ["s"] * 5 + ["f"]
    windows = [512 if t == "s" else None for t in gemma * 3]  # Gemma 3 270M: 15 sliding + 3 full layers
    groups = kv_cache_groups(windows, max_model_len=32768)
    assert [w for w, _ in groups] == [None] + [512] * 5
    assert groups[0][1] == [5, 11, 17] and all(len(ids) == 3 for _, ids in groups)
    assert sorted(i for _, ids in groups for i in ids) == list(range(18))
    assert kv_cache_groups([None] * 30, 2048) == [(None, list(range(30)))]  # Llama: one group, as before
    assert kv_cache_groups([4096] * 4, 2048) == [(None, [0, 1, 2, 3])]  # a window past max_model_len drops nothing


def test_long_decode_keeps_only_the_window_in_sliding_groups():
    mgr = KVCacheManager(num_blocks=200, block_size=BS, group_windows=(None, W, W))
    req = _req("a", list(range(1, 41)))
    for start in range(0, 40, 12):  # chunked prefill, 12 tokens a step
        _run(mgr, req, min(12, 40 - start))
        check_invariants_of_manager(mgr)
    peak_sliding = 0
    for t in range(200):
        req.append_output_token(5 + t % 40)
        _run(mgr, req, 1)
        check_invariants_of_manager(mgr)
        full = _non_null(mgr, 0, "a")
        assert full == -(-req.num_computed_tokens // BS)  # the full group keeps everything
        for g in (1, 2):
            peak_sliding = max(peak_sliding, _non_null(mgr, g, "a"))
            # Each allocation keeps the blocks of positions >= c - W + 1, c the tokens computed before the step
            # (the window of the step's first query), and nothing older.
            table = mgr.groups[g].req_to_blocks["a"]
            first = (req.num_computed_tokens - 1 - W + 1) // BS
            assert all(b.block_id == 0 for b in table[:first]) and all(b.block_id for b in table[first:])
        used = mgr.block_pool.num_usable_blocks - mgr.block_pool.get_num_free_blocks()
        assert used == full + _non_null(mgr, 1, "a") + _non_null(mgr, 2, "a")
    assert peak_sliding <= -(-(W - 1) // BS) + 1
    assert mgr.memory_stats()["blocks_used"] < 2 * peak_sliding + 61
    mgr.free(req)
    assert mgr.block_pool.get_num_free_blocks() == mgr.block_pool.num_usable_blocks


def test_prefix_hit_on_a_sliding_group_needs_the_windows_blocks():
    mgr = KVCacheManager(num_blocks=200, block_size=BS, group_windows=(None, W))
    prompt = list(range(1, 34))  # 33 tokens: 8 full blocks
    a = _req("a", prompt)
    for _ in range(3):
        _run(mgr, a, 11)
    assert _non_null(mgr, 1, "a") < 8  # the sliding group already dropped its early blocks ...
    mgr.free(a)
    b = _req("b", prompt + [99])
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 32  # ... which stay cached (evictable) and serve a hit
    assert [len(h) for h in hits] == [8, 8]
    window = -(-(W - 1) // BS)  # 2 blocks before the hit's end
    # A hit needs only the window's blocks of the sliding group: the rest come back as null blocks.
    assert all(blk.block_id == 0 for blk in hits[1][:8 - window]) and all(blk.block_id for blk in hits[1][8 - window:])
    # Evict the sliding group's block 6: hits ending at 7 or 8 blocks lack part of their window; 6 works.
    blk6 = mgr.groups[1].find_longest_cache_hit(b.block_hashes, 7)[6]
    mgr.block_pool._evict(blk6)
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 24 and [len(h) for h in hits] == [6, 6]
    assert [blk.block_id != 0 for blk in hits[1]] == [False, False, False, False, True, True]
    assert all(blk.block_id for blk in hits[0])  # the full group's hit is its whole prefix
    assert mgr.allocate_slots(b, b.num_tokens - num_hit, num_hit, hits) is not None
    b.num_computed_tokens = b.num_tokens
    check_invariants_of_manager(mgr)
    # The full group's block 0 evicted: no prefix at all.
    mgr.free(b)
    mgr.block_pool._evict(mgr.groups[0].find_longest_cache_hit(b.block_hashes, 1)[0])
    assert mgr.get_computed_blocks(_req("c", prompt))[1] == 0


def test_fork_and_copy_on_write_per_group():
    mgr = KVCacheManager(num_blocks=100, block_size=BS, enable_caching=False, group_windows=(None, W))
    a = _req("a", list(range(1, 23)))  # 22 tokens: the last block half full
    _run(mgr, a, 22)
    a.append_output_token(7)
    b = _req("b", list(a.all_token_ids[:22]))
    mgr.fork(a, b, 22)
    b.num_computed_tokens = 21  # the child recomputes the last prompt token
    _run(mgr, b, 1)  # writes into the shared last block of both groups: one copy each
    copies, replaced = mgr.take_step_changes()
    assert len(copies) == 2 and sorted(g for g, _, _ in replaced["b"]) == [0, 1]
    check_invariants_of_manager(mgr)


def _scheduler(num_blocks: int, windows: tuple, mode: str, budget: int, max_seqs: int, max_len: int) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_len,
                                     preemption_mode=mode),
                     CacheConfig(block_size=BS, enable_prefix_caching=True),
                     KVCacheConfig(num_blocks, BS, num_swap_blocks=16 if mode == "swap" else 0,
                                   group_windows=windows))


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_random_workload_with_groups_keeps_invariants(seed, mode):
    rng = random.Random(seed)
    windows = rng.choice([(None, W), (None, W, W), (W,), (None, 5, 5)])
    budget = rng.choice([8, 16])
    cfg = KVCacheConfig(rng.choice([30, 48]), BS, group_windows=windows)
    max_len = 60
    assert cfg.max_blocks_per_request(max_len, budget) <= cfg.usable_blocks
    s = _scheduler(cfg.num_blocks, windows, mode, budget, rng.choice([2, 4, 8]), max_len)
    run_random_workload(s, rng, steps=80, shared_len=14, max_suffix=25, max_tokens=30)
    pool = s.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1
    assert s.swap_space.num_free == s.swap_space.num_blocks and not s._swap_layouts


def test_admission_counts_blocks_per_group():
    # 2 groups of 13 usable blocks: a 24-token prompt needs 6 full + 6 sliding blocks at once (one chunk).
    s = _scheduler(14, (None, W), "recompute", 64, 4, 40)
    s.add_request(Request("a", list(range(3, 27)), SamplingParams(max_tokens=1, ignore_eos=True), None, 0))
    s.add_request(Request("b", list(range(30, 54)), SamplingParams(max_tokens=1, ignore_eos=True), None, 1))
    so = s.schedule()
    assert list(so.num_scheduled_tokens) == ["a"]  # b does not fit beside a
    assert [len(ids) for ids in so.scheduled_new_reqs[0].block_ids] == [6, 6]
