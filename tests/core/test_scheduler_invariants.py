"""The scheduler and KV cache manager, driven without a model: invariants after every step."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pagemill.config import SCHEDULING_POLICIES, CacheConfig, SchedulerConfig
from pagemill.core.kv_cache_utils import KVCacheConfig
from pagemill.core.sched_output import ModelRunnerOutput
from pagemill.core.scheduler import Scheduler
from pagemill.request import Request, RequestStatus
from pagemill.sampling_params import SamplingParams


def make_scheduler(num_blocks: int, block_size: int = 4, budget: int = 32, max_seqs: int = 8,
                   policy: str = "fcfs", caching: bool = True, max_len: int = 256, max_passed_over: int = 64,
                   staging_size: int = 8) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_len,
                                     policy=policy, max_passed_over=max_passed_over, staging_size=staging_size),
                     CacheConfig(block_size=block_size, enable_prefix_caching=caching),
                     KVCacheConfig(num_blocks, block_size))


def check_invariants(s: Scheduler) -> None:
    check_invariants_of_manager(s.kv_cache_manager)
    for req in s.running:
        for g in s.kv_cache_manager.groups:
            assert len(g.req_to_blocks[req.request_id]) * s.block_size >= req.num_computed_tokens


def check_invariants_of_manager(mgr) -> None:
    """Ref counts equal table references; free + used = total; the free queue is exactly the free blocks; a block
    belongs to one group; a request's tables have equal lengths."""
    pool = mgr.block_pool
    refs = Counter(b.block_id for g in mgr.groups for blocks in g.req_to_blocks.values() for b in blocks
                   if b.block_id)
    owners = {}
    for g in mgr.groups:
        for blocks in g.req_to_blocks.values():
            for b in blocks:
                if b.block_id:
                    assert owners.setdefault(b.block_id, g.group_id) == g.group_id
    for rid in mgr.groups[0].req_to_blocks:
        assert len({len(g.req_to_blocks[rid]) for g in mgr.groups}) == 1
    for b in pool.blocks[1:]:
        assert b.ref_cnt == refs[b.block_id], f"block {b.block_id}: ref_cnt {b.ref_cnt} != {refs[b.block_id]} references"
    free_ids = [b.block_id for b in pool.free_block_queue]
    assert len(free_ids) == len(set(free_ids)) == pool.get_num_free_blocks()
    assert set(free_ids) == {b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0}
    used = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
    assert used + pool.get_num_free_blocks() == pool.num_blocks - 1
    for key, b in pool.cached_block_hash_to_block.items():
        assert b.block_hash == key
        if b.ref_cnt:
            assert owners[b.block_id] == key[1]  # cached under the group that holds it
    assert pool.num_block_refs == sum(refs.values())
    assert pool.num_shared_blocks == sum(1 for n in refs.values() if n > 1)
    check_memory_accounting(mgr)


def check_memory_accounting(mgr) -> None:
    """memory_stats' breakdown equals a block-by-block count: a block's fill is the tokens a table holding it
    has stored there (every table agrees), so used slots = token states + fragmentation + reservation."""
    bs, null = mgr.block_size, mgr.block_pool.null_block
    fill: dict[int, set[int]] = {}
    for g in mgr.groups:
        for rid, blocks in g.req_to_blocks.items():
            stored = mgr._num_stored.get(rid, 0)
            for j, b in enumerate(blocks):
                if b is not null:
                    fill.setdefault(b.block_id, set()).add(min(max(stored - j * bs, 0), bs))
    assert all(len(f) == 1 for f in fill.values()), "sharers disagree on a block's fill"
    fills = [f.pop() for f in fill.values()]
    mem = mgr.memory_stats()
    assert mem["blocks_used"] == len(fills)
    assert mem["token_slots"] == sum(fills)
    assert mem["slots_fragmented"] == sum(bs - f for f in fills if 0 < f < bs)
    assert mem["blocks_partial"] == sum(1 for f in fills if 0 < f < bs)
    assert mem["slots_reserved"] == bs * fills.count(0)
    assert mem["blocks_saved_by_sharing"] == mem["logical_blocks"] - len(fills) >= 0


def run_to_completion(s: Scheduler, rng: random.Random, max_steps: int = 5000) -> dict[str, list[int]]:
    """Step with random 'sampled' tokens until everything finishes; returns outputs by request id."""
    results: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return results
        so = s.schedule()
        assert so.total_num_scheduled_tokens <= s.config.max_num_batched_tokens
        assert len(so.num_scheduled_tokens) <= s.config.max_num_seqs
        sampled = {}
        for rid in so.num_scheduled_tokens:
            req = s.requests[rid]
            if req.num_computed_tokens == req.num_tokens:
                sampled[rid] = [rng.randrange(3, 50)]
        for o in s.update_from_output(so, ModelRunnerOutput(sampled)):
            results.setdefault(o.request_id, []).extend(o.new_token_ids)
        check_invariants(s)
    raise AssertionError("did not finish")


def run_random_workload(s: Scheduler, rng: random.Random, steps: int, shared_len: int, max_suffix: int,
                        max_tokens: int, priorities: int = 1) -> None:
    """Random arrivals (half sharing a prefix), aborts and sampled tokens for `steps` steps, then run to completion;
    the invariants are checked after every step."""
    shared = [rng.randrange(3, 50) for _ in range(shared_len)]
    for n in range(steps):
        if rng.random() < 0.4:
            prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(3, 50)
                                                                 for _ in range(rng.randrange(1, max_suffix))]
            prompt = prompt[: s.config.max_model_len - 1]
            sp = SamplingParams(max_tokens=rng.randrange(1, max_tokens), ignore_eos=True)
            s.add_request(Request(f"r{n}", prompt, sp, None, float(n), priority=rng.randrange(priorities)))
        if rng.random() < 0.05 and s.requests:
            s.finish_requests([rng.choice(list(s.requests))], RequestStatus.FINISHED_ABORTED)
        if s.has_unfinished_requests():
            so = s.schedule()
            sampled = {rid: [rng.randrange(3, 50)] for rid in so.num_scheduled_tokens
                       if s.requests[rid].num_computed_tokens == s.requests[rid].num_tokens}
            s.update_from_output(so, ModelRunnerOutput(sampled))
        check_invariants(s)
    run_to_completion(s, rng)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("policy", SCHEDULING_POLICIES)
def test_random_workload_keeps_invariants_and_frees_everything(seed, policy):
    rng = random.Random(seed)
    num_blocks, block_size = rng.choice([12, 20, 40]), rng.choice([2, 4, 8])
    # As in the engine, max_model_len never exceeds what the KV cache can hold.
    policy_rng = random.Random(seed + 1000)  # srtf aging and two-level staging, small enough to matter
    s = make_scheduler(num_blocks=num_blocks, block_size=block_size, budget=rng.choice([8, 16, 64]),
                       max_seqs=rng.choice([2, 4, 16]), policy=policy, max_len=(num_blocks - 1) * block_size,
                       max_passed_over=policy_rng.choice([0, 2, 8, 64]), staging_size=policy_rng.choice([1, 2, 4]))
    run_random_workload(s, rng, steps=60, shared_len=12, max_suffix=20, max_tokens=16, priorities=3)
    pool = s.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1
    assert not any(g.req_to_blocks for g in s.kv_cache_manager.groups)


def test_preemption_by_recompute_happens_and_recovers():
    s = make_scheduler(num_blocks=9, block_size=4, budget=64, max_seqs=8)  # 8 usable blocks = 32 tokens
    for i in range(4):
        s.add_request(Request(f"r{i}", list(range(3, 11)), SamplingParams(max_tokens=12, ignore_eos=True), None, i))
    run_to_completion(s, random.Random(0))
    assert s.num_preemptions > 0
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 8


def test_chunked_prefill_respects_budget_and_mixes_decodes():
    s = make_scheduler(num_blocks=64, block_size=4, budget=10, max_seqs=4)
    s.add_request(Request("short", [5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True), None, 0))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"short": 3}
    s.update_from_output(so, ModelRunnerOutput({"short": [9]}))
    s.add_request(Request("long", list(range(3, 40)), SamplingParams(max_tokens=2, ignore_eos=True), None, 1))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"short": 1, "long": 9}  # one decode + a 9-token chunk
    s.update_from_output(so, ModelRunnerOutput({"short": [9]}))
    so = s.schedule()
    assert so.num_scheduled_tokens["long"] == 9 and s.requests["long"].num_computed_tokens == 18


def test_prefix_hit_is_block_aligned_and_leaves_last_token():
    s = make_scheduler(num_blocks=64, block_size=4, budget=64)
    prompt = list(range(3, 15))  # 12 tokens = 3 full blocks
    s.add_request(Request("a", prompt, SamplingParams(max_tokens=1, ignore_eos=True), None, 0))
    so = s.schedule()
    s.update_from_output(so, ModelRunnerOutput({"a": [7]}))
    s.add_request(Request("b", prompt, SamplingParams(max_tokens=1, ignore_eos=True), None, 1))
    so = s.schedule()
    # 3 full blocks cached, but the last prompt token must be recomputed: 2 blocks hit, 4 tokens computed.
    assert so.num_scheduled_tokens == {"b": 4}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8
    s.add_request(Request("c", prompt, SamplingParams(max_tokens=1, ignore_eos=True), None, 2, cache_salt="x"))
    so2 = s.schedule()
    assert so2.num_scheduled_tokens["c"] == 12  # a different salt never shares


def test_priority_policy_preempts_lowest_priority():
    s = make_scheduler(num_blocks=5, block_size=4, budget=64, max_seqs=4, policy="priority")  # 4 usable blocks
    s.add_request(Request("low", list(range(3, 11)), SamplingParams(max_tokens=20, ignore_eos=True), None, 0,
                          priority=5))
    s.add_request(Request("high", list(range(3, 11)), SamplingParams(max_tokens=20, ignore_eos=True), None, 1,
                          priority=0))
    preempted = set()
    for _ in range(6):
        so = s.schedule()
        preempted |= so.preempted_req_ids
        sampled = {r: [5] for r in so.num_scheduled_tokens if s.requests[r].num_computed_tokens == s.requests[r].num_tokens}
        s.update_from_output(so, ModelRunnerOutput(sampled))
    assert preempted == {"low"}


def test_scheduler_takes_blocks_and_swap_blocks_from_kv_cache_config():
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=32,
                                  preemption_mode="swap"),
                  CacheConfig(block_size=4), KVCacheConfig(num_blocks=9, block_size=4, num_swap_blocks=5))
    assert s.make_stats().num_blocks_total == 8 and s.swap_space.num_free == 5
    for i in range(4):
        s.add_request(Request(f"r{i}", list(range(3, 11)), SamplingParams(max_tokens=12, ignore_eos=True), None, i))
    run_to_completion(s, random.Random(0))
    assert s.num_swapped_out > 0 and s.swap_space.num_free == 5
