"""The scheduler under async scheduling, without a model: two steps in flight, outputs applied late, random
arrivals, aborts, stops and preemptions (also of requests with two steps in flight); the outputs equal synchronous
scheduling's and nothing leaks."""

from __future__ import annotations

import random
from collections import deque

import pytest

from pagemill.config import SCHEDULING_POLICIES, CacheConfig, SchedulerConfig
from pagemill.core.kv_cache_utils import KVCacheConfig
from pagemill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagemill.core.scheduler import Scheduler
from pagemill.request import Request, RequestStatus
from pagemill.sampling_params import SamplingParams
from tests.core.test_scheduler_invariants import check_invariants


def _token(rid: str, index: int) -> int:
    """The 'model': output `index` of request `rid` (so any schedule yields the same text)."""
    return 3 + (sum(map(ord, rid)) * 7919 + index * 104729) % 47


def _drive(async_scheduling: bool, seed: int, policy: str) -> tuple[dict[str, list[int]], dict[str, str], Scheduler]:
    rng = random.Random(seed)
    num_blocks, block_size = rng.choice([12, 20, 40]), rng.choice([2, 4, 8])
    s = Scheduler(SchedulerConfig(max_num_seqs=rng.choice([2, 4, 16]), max_num_batched_tokens=rng.choice([8, 16, 64]),
                                  max_model_len=(num_blocks - 1) * block_size, policy=policy,
                                  preemption_mode=rng.choice(["recompute", "swap"]),
                                  async_scheduling=async_scheduling),
                  CacheConfig(block_size=block_size), KVCacheConfig(num_blocks, block_size, num_swap_blocks=8))
    shared = [rng.randrange(3, 50) for _ in range(12)]
    arrivals: dict[int, Request] = {}
    aborts: dict[int, str] = {}
    for n in range(80):  # the events, drawn before the run (the same in both modes)
        if rng.random() < 0.4:
            suffix = [rng.randrange(3, 50) for _ in range(rng.randrange(1, 20))]
            prompt = (shared if rng.random() < 0.5 else []) + suffix
            sp = SamplingParams(max_tokens=rng.randrange(1, 16), stop_token_ids=[rng.randrange(3, 50)],
                                ignore_eos=True)
            arrivals[n] = Request(f"r{n}", prompt[: s.config.max_model_len - 1], sp, None, float(n))
        if rng.random() < 0.05 and arrivals:
            aborts[n] = rng.choice([r.request_id for r in arrivals.values()])
    resets = {n for n in range(80) if rng.random() < 0.05}  # preempt every running request, outside schedule()
    outputs: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
    depth = 2 if async_scheduling else 1

    def apply_oldest() -> None:
        so, out = in_flight.popleft()
        for o in s.update_from_output(so, out):
            assert o.request_id not in finish, "output after the request finished"
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason:
                finish[o.request_id] = o.finish_reason
        check_invariants(s)

    n = 0
    while n < 80 or s.has_unfinished_requests() or in_flight:
        assert n < 2000, "did not finish"
        if n in arrivals:
            s.add_request(arrivals[n])
        if n in aborts:
            for req in s.finish_requests([aborts[n]], RequestStatus.FINISHED_ABORTED):
                finish[req.request_id] = "abort"
        if n in resets:
            s.reset_prefix_cache(reset_running_requests=True)
        if s.has_unfinished_requests():
            before = {rid: (r.num_output_tokens, r.num_output_placeholders) for rid, r in s.requests.items()}
            so = s.schedule()
            assert so.total_num_scheduled_tokens <= s.config.max_num_batched_tokens
            sampled = {}
            for rid in so.num_scheduled_tokens:  # what the runner samples: the requests at the end of their tokens
                req = s.requests[rid]
                num_out, placeholders = before.get(rid, (req.num_output_tokens, 0))
                if req.num_computed_tokens >= req.num_tokens + placeholders:
                    sampled[rid] = [_token(rid, num_out + placeholders)]
                    assert req.num_output_placeholders == placeholders + async_scheduling
            in_flight.append((so, ModelRunnerOutput(sampled)))
            if len(in_flight) >= depth:
                apply_oldest()
        elif in_flight:
            apply_oldest()
        n += 1
    while in_flight:
        apply_oldest()
    assert not s.has_unfinished_requests()
    return outputs, finish, s


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("policy", SCHEDULING_POLICIES)
def test_async_outputs_equal_sync_and_nothing_leaks(seed, policy):
    sync_out, sync_finish, _ = _drive(False, seed, policy)
    out, finish, s = _drive(True, seed, policy)
    for rid, reason in finish.items():
        toks = out.get(rid, [])
        if reason == "abort" or sync_finish[rid] == "abort":  # aborted at the same step: a prefix either way
            short, long_ = sorted((toks, sync_out.get(rid, [])), key=len)
            assert long_[:len(short)] == short
        else:
            assert toks == sync_out[rid] and reason == sync_finish[rid]
            assert len(toks) <= s.config.max_model_len
    assert set(finish) == set(sync_finish)
    pool = s.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1
    assert not any(g.req_to_blocks for g in s.kv_cache_manager.groups)
    assert s.swap_space.num_free == s.swap_space.num_blocks
    assert all(r.num_output_placeholders == 0 for r in s.requests.values())


def test_no_step_past_max_tokens():
    """A decode whose in-flight token reaches max_tokens is not scheduled again (vLLM's rule); one that may still
    stop on a token is (the extra token is discarded on arrival)."""
    s = Scheduler(SchedulerConfig(max_model_len=64, async_scheduling=True), CacheConfig(block_size=4),
                  KVCacheConfig(20, 4))
    s.add_request(Request("a", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True), None, 0.0))
    s.add_request(Request("b", [5, 6, 7], SamplingParams(max_tokens=9, stop_token_ids=[11], ignore_eos=True),
                          None, 0.0))
    first = s.schedule()  # prefills: both sample
    second = s.schedule()  # both decode on their placeholder (a's second and last token)
    assert set(second.num_scheduled_tokens) == {"a", "b"}
    third = s.schedule()  # a's last token is in flight: only b
    assert set(third.num_scheduled_tokens) == {"b"}
    done = s.update_from_output(first, ModelRunnerOutput({"a": [20], "b": [11]}))  # b stops on its token
    assert {o.request_id: o.finish_reason for o in done} == {"a": None, "b": "stop"}
    done = s.update_from_output(second, ModelRunnerOutput({"a": [21], "b": [22]}))  # b's extra token: discarded
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in done] == [("a", [21], "length")]
    assert s.update_from_output(third, ModelRunnerOutput({"b": [23]})) == []
    assert not s.has_unfinished_requests() and s.kv_cache_manager.block_pool.get_num_free_blocks() == 19
