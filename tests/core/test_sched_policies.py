"""Scheduling policies on the scheduler alone (no model): admission order, aging, the staging queue, the running
set's budget and the preemption victim of fcfs, srtf and two-level."""

from __future__ import annotations

import random

import pytest

from pagemill.config import SCHEDULING_POLICIES, CacheConfig, SchedulerConfig
from pagemill.core.kv_cache_manager import KVCacheManager
from pagemill.core.kv_cache_utils import KVCacheConfig
from pagemill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagemill.core.sched_policy import SRTFQueue, TwoLevelQueue, expected_output_tokens, order_running
from pagemill.core.scheduler import Scheduler
from pagemill.request import Request, RequestStatus
from pagemill.sampling_params import SamplingParams
from tests.core.test_scheduler_invariants import check_invariants, run_to_completion


def make_scheduler(policy: str, *, num_blocks: int = 256, block_size: int = 4, budget: int = 64,
                   max_seqs: int = 8, max_passed_over: int = 64, staging_size: int = 8, caching: bool = True,
                   preemption_mode: str = "recompute", num_swap_blocks: int = 0) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=512,
                                     policy=policy, max_passed_over=max_passed_over, staging_size=staging_size,
                                     preemption_mode=preemption_mode),
                     CacheConfig(block_size=block_size, enable_prefix_caching=caching),
                     KVCacheConfig(num_blocks, block_size, num_swap_blocks))


def make_request(rid: str, prompt_len: int, max_tokens: int, arrival: float = 0.0,
                 expected: int | None = None, prompt: list[int] | None = None) -> Request:
    rng = random.Random(rid)  # distinct prompts: no prefix-cache sharing unless asked for
    tokens = prompt if prompt is not None else [rng.randrange(3, 1000) for _ in range(prompt_len)]
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, expected_output_tokens=expected)
    return Request(rid, tokens, sp, None, arrival)


def step(s: Scheduler) -> SchedulerOutput:
    """One step; every request that reached the end of its tokens samples token 7."""
    so = s.schedule()
    sampled = {rid: [7] for rid in so.num_scheduled_tokens
               if s.requests[rid].num_computed_tokens == s.requests[rid].num_tokens}
    s.update_from_output(so, ModelRunnerOutput(sampled))
    check_invariants(s)
    return so


def admission_order(s: Scheduler, max_steps: int = 500) -> list[str]:
    """Run to completion; the ids in the order they were first scheduled."""
    order: list[str] = []
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return order
        order += [r.req_id for r in step(s).scheduled_new_reqs if r.req_id not in order]
    raise AssertionError("did not finish")


# (prompt tokens, max_tokens): remaining work a=40, b=34, c=10, d=3, e=24, f=6, arriving in this order
SIZES = {"a": (20, 20), "b": (4, 30), "c": (8, 2), "d": (2, 1), "e": (12, 12), "f": (3, 3)}


@pytest.mark.parametrize("policy,expected", [
    ("fcfs", list("abcdef")),
    ("srtf", list("dfceba")),  # all by remaining work
    ("two-level", list("cba" "dfe")),  # SRTF within each FIFO batch of 3
])
def test_admission_order(policy, expected):
    s = make_scheduler(policy, max_seqs=1, staging_size=3)  # one at a time: the order is the admission order
    for t, (rid, (p, m)) in enumerate(SIZES.items()):
        s.add_request(make_request(rid, p, m, arrival=float(t)))
    assert admission_order(s) == expected


def test_expected_output_tokens_hint_reorders_srtf():
    s = make_scheduler("srtf", max_seqs=1)
    s.add_request(make_request("capped", 4, 10))  # expects max_tokens = 10 outputs: 14 left
    s.add_request(make_request("hinted", 4, 100, expected=2))  # expects 2: 6 left
    s.add_request(make_request("big-hint", 4, 5, expected=1000))  # the hint is capped by max_tokens: 9 left
    assert admission_order(s) == ["hinted", "big-hint", "capped"]


def test_expected_output_tokens_is_capped_and_defaults_to_max_tokens():
    assert expected_output_tokens(make_request("a", 10, 50), 512) == 50
    assert expected_output_tokens(make_request("b", 10, 50, expected=7), 512) == 7
    assert expected_output_tokens(make_request("c", 10, 50, expected=0), 512) == 0
    assert expected_output_tokens(make_request("d", 500, 50, expected=40), 512) == 12  # the context ends first


@pytest.mark.parametrize("bad", [-1, 2.5, True, "3"])
def test_expected_output_tokens_is_validated(bad):
    with pytest.raises(ValueError, match="expected_output_tokens"):
        SamplingParams(expected_output_tokens=bad)


def test_policy_flags_are_validated():
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(policy="sjf")
    with pytest.raises(ValueError, match="scheduling_max_passed_over"):
        SchedulerConfig(policy="srtf", max_passed_over=-1)
    with pytest.raises(ValueError, match="scheduling_staging_size"):
        SchedulerConfig(policy="two-level", staging_size=0)


def _passed_over_before_long(policy: str, max_passed_over: int, steps: int = 40) -> int | None:
    """A long request, then two short ones arriving every step (they finish at once): how many requests were
    admitted before the long one (None: never within `steps`)."""
    s = make_scheduler(policy, max_seqs=2, max_passed_over=max_passed_over)
    s.add_request(make_request("long", 30, 50))
    admitted: list[str] = []
    for t in range(steps):
        for k in range(2):
            s.add_request(make_request(f"s{t}.{k}", 2, 1, arrival=t + 1.0))
        admitted += [r.req_id for r in step(s).scheduled_new_reqs]
        if "long" in admitted:
            return admitted.index("long")
    return None


@pytest.mark.parametrize("limit", [0, 1, 3, 10])
def test_srtf_aging_bounds_how_often_a_long_request_is_passed_over(limit):
    assert _passed_over_before_long("srtf", limit) == limit


def test_without_aging_srtf_starves_the_long_request():
    assert _passed_over_before_long("srtf", 10**9) is None
    # two-level: only the two staged along with it go first; every later arrival waits for the staged batch
    assert _passed_over_before_long("two-level", 10**9) == 2


def test_a_preempted_request_keeps_its_age():
    q = SRTFQueue(512, max_passed_over=2, kv_cache_manager=KVCacheManager(8, 4))
    old = make_request("old", 30, 30)
    q.add(old)
    assert q.pop() is old  # admitted early (the queue was empty) ...
    q.admitted(old)
    for i in range(2):
        q.add(make_request(f"n{i}", 2, 1))
    q.add_front(old)  # ... preempted and re-queued: it counts the admissions since it first arrived
    assert q.starving(old) is False and q.peek().request_id == "n0"
    q.admitted(q.pop())
    assert q.starving(old) and q.peek() is old


def test_srtf_queue_abort_and_compaction():
    q = SRTFQueue(512, max_passed_over=64, kv_cache_manager=KVCacheManager(8, 4))
    reqs = [make_request(f"r{i}", 2 + i, 1) for i in range(300)]
    for r in reqs:
        q.add(r)
    for r in reqs[:250]:
        q.remove(r)  # lazy deletion, compacted as the dead entries pile up
    for r in reqs[250:260]:
        q.add_front(r)  # re-queued: still one live entry each
    assert len(q) == 50 and {r.request_id for r in q} == {f"r{i}" for i in range(250, 300)}
    assert len(q._by_arrival) <= 2 * len(q) + 64 + 1
    assert [q.pop().request_id for _ in range(3)] == ["r250", "r251", "r252"]
    with pytest.raises(ValueError):
        q.remove(reqs[0])


def test_two_level_moves_at_most_staging_size_and_only_when_staging_is_empty():
    s = make_scheduler("two-level", max_seqs=1, staging_size=3)
    for t, (rid, (p, m)) in enumerate(SIZES.items()):
        s.add_request(make_request(rid, p, m, arrival=float(t)))
    q: TwoLevelQueue = s.waiting
    order = [r.req_id for r in step(s).scheduled_new_reqs]
    assert order == ["c"] and {r.request_id for r in q.staging} == {"a", "b"} and len(q.waiting) == 3
    s.add_request(make_request("tiny", 1, 1, arrival=10.0))  # the least work of all, but not staged
    largest = 0
    while s.has_unfinished_requests():
        order += [r.req_id for r in step(s).scheduled_new_reqs]
        largest = max(largest, len(q.staging))
    assert largest <= 3
    assert order == ["c", "b", "a", "d", "f", "e", "tiny"]  # tiny waits for the batch staged before it came


def test_two_level_ranks_by_fresh_prefix_cache_hits_srtf_does_not():
    shared = [random.Random(1).randrange(3, 1000) for _ in range(32)]
    orders = {}
    for policy in ("srtf", "two-level"):
        s = make_scheduler(policy, max_seqs=1)
        s.add_request(make_request("warm", 32, 1, prompt=shared))
        admission_order(s)  # its 8 blocks are now in the prefix cache
        s.add_request(make_request("fresh", 20, 4, arrival=1.0))  # 24 left
        s.add_request(make_request("hit", 36, 4, arrival=2.0, prompt=shared + [5, 6, 7, 8]))  # 40 left, 32 cached
        orders[policy] = admission_order(s)
    assert orders == {"srtf": ["fresh", "hit"], "two-level": ["hit", "fresh"]}


@pytest.mark.parametrize("policy,admitted_at", [("fcfs", 6), ("srtf", 1), ("two-level", 1)])
def test_a_long_prefill_does_not_block_a_short_request(policy, admitted_at):
    """Head-of-line blocking: a 100-token prompt is being prefilled in chunks of 16 when a short one arrives."""
    s = make_scheduler(policy, budget=16)
    s.add_request(make_request("long", 100, 4))
    assert step(s).num_scheduled_tokens == {"long": 16}
    s.add_request(make_request("short", 4, 3, arrival=1.0))
    for n in range(1, 10):
        so = step(s)
        if "short" in so.num_scheduled_tokens:
            break
    assert n == admitted_at
    if policy != "fcfs":
        assert so.num_scheduled_tokens == {"long": 12, "short": 4}  # long still progresses
        # the next step the short one decodes first; the long chunk takes the rest
        assert step(s).num_scheduled_tokens == {"short": 1, "long": 15}


def test_order_running_sorts_only_when_the_budget_is_short():
    reqs = [make_request("prefill", 30, 5), make_request("decode", 4, 50)]
    reqs[1].num_computed_tokens = 4
    reqs[1].append_output_token(9)  # computed 4 of 5 tokens: one to compute
    running = list(reqs)
    order_running(running, budget=64, max_model_len=512)
    assert [r.request_id for r in running] == ["prefill", "decode"]  # 31 tokens fit: order kept
    order_running(running, budget=16, max_model_len=512)
    assert [r.request_id for r in running] == ["decode", "prefill"]


@pytest.mark.parametrize("policy,victim", [("fcfs", "c"), ("srtf", "a"), ("two-level", "a")])
def test_preemption_victim_follows_the_policy(policy, victim):
    """Three 8-token prompts fill 6 of 6 blocks; the first decode step needs a block: who is preempted?"""
    s = make_scheduler(policy, num_blocks=7, block_size=4)
    for t, (rid, m) in enumerate((("a", 40), ("b", 4), ("c", 20))):  # remaining work after prefill: 40, 4, 20
        s.add_request(make_request(rid, 8, m, arrival=float(t)))
    assert len(step(s).num_scheduled_tokens) == 3
    assert step(s).preempted_req_ids == {victim}


def test_srtf_never_preempts_a_starving_request_before_the_others():
    s = make_scheduler("srtf", max_passed_over=1)
    q: SRTFQueue = s.waiting
    reqs = [make_request(rid, 8, m, arrival=float(t)) for t, (rid, m) in enumerate((("a", 40), ("b", 4), ("c", 90)))]
    for r in reqs:
        q.add(r)
    q.num_admitted = 1  # a, b and c have each been passed over once: all starving, served in FIFO order
    assert q.victim(reqs) is reqs[2]
    q.add(late := make_request("d", 8, 2, arrival=3.0))  # queued now: not starving
    assert q.victim(reqs + [late]) is late  # the policy serves it after the starving ones, whatever its size


@pytest.mark.parametrize("policy", SCHEDULING_POLICIES)
def test_swap_preemption_under_every_policy(policy):
    s = make_scheduler(policy, num_blocks=9, block_size=4, preemption_mode="swap", num_swap_blocks=5,
                       max_passed_over=2, staging_size=2)
    for i in range(5):
        s.add_request(make_request(f"r{i}", 8, 12, arrival=float(i)))
    outputs = run_to_completion(s, random.Random(0))
    assert s.num_swapped_out > 0 and s.swap_space.num_free == 5
    assert sorted(outputs) == [f"r{i}" for i in range(5)] and all(len(v) == 12 for v in outputs.values())


@pytest.mark.parametrize("policy", SCHEDULING_POLICIES)
def test_abort_anywhere_under_every_policy(policy):
    s = make_scheduler(policy, max_seqs=2, staging_size=2)
    for i in range(6):
        s.add_request(make_request(f"r{i}", 6, 4, arrival=float(i)))
    step(s)
    waiting = [r.request_id for r in s.waiting]
    done = s.finish_requests([waiting[0], waiting[-1], s.running[0].request_id], RequestStatus.FINISHED_ABORTED)
    assert len(done) == 3 and len(s.waiting) == 2 and len(s.running) == 1
    admission_order(s)
    pool = s.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1
