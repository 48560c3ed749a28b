"""The scheduler with LoRA, driven without a model: at most max_loras adapters per step; the adapter keys the
prefix-cache hash."""

from __future__ import annotations

from pagemill.config import CacheConfig, SchedulerConfig
from pagemill.core.kv_cache_utils import KVCacheConfig
from pagemill.core.sched_output import ModelRunnerOutput
from pagemill.core.scheduler import Scheduler
from pagemill.lora.request import LoRARequest
from pagemill.request import Request
from pagemill.sampling_params import SamplingParams


def make_scheduler(max_loras: int, num_blocks: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=256),
                     CacheConfig(block_size=4), KVCacheConfig(num_blocks, 4), max_loras=max_loras)


def lora(i: int) -> LoRARequest:
    return LoRARequest(f"adapter{i}", i, f"/adapters/{i}")


def make_request(rid: str, lora_id: int, prompt: list[int] | None = None, max_tokens: int = 3) -> Request:
    return Request(rid, prompt or list(range(10)), SamplingParams(max_tokens=max_tokens, ignore_eos=True), None, 0.0,
                   lora_request=lora(lora_id) if lora_id else None)


def step(s: Scheduler) -> tuple[set[int], list[str]]:
    """Schedule and complete one step (token 7 for every request); (adapter ids scheduled, ids finished)."""
    so = s.schedule()
    ids = {s.requests[r].lora_int_id for r in so.num_scheduled_tokens}
    sampled = {r: [7] for r in so.num_scheduled_tokens
               if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens}
    outs = s.update_from_output(so, ModelRunnerOutput(sampled))
    return ids - {0}, [o.request_id for o in outs if o.finish_reason]


def test_a_step_mixes_at_most_max_loras_adapters() -> None:
    s = make_scheduler(max_loras=2)
    for i, lora_id in enumerate([1, 2, 3, 0, 1, 3, 0]):
        s.add_request(make_request(f"r{i}", lora_id))
    seen, finished = set(), []
    for _ in range(50):
        if not s.has_unfinished_requests():
            break
        ids, done = step(s)
        assert len(ids) <= 2, ids
        seen |= ids
        finished += done
    assert sorted(finished) == sorted(f"r{i}" for i in range(7))
    assert seen == {1, 2, 3}
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 63


def test_base_requests_are_not_held_back_by_adapter_slots() -> None:
    s = make_scheduler(max_loras=1)
    s.add_request(make_request("a", 1))
    s.add_request(make_request("b", 2))  # waits: the one slot is adapter 1's
    s.add_request(make_request("base", 0))
    so = s.schedule()
    assert set(so.num_scheduled_tokens) == {"a", "base"}
    assert [r.request_id for r in s.waiting] == ["b"]


def test_the_adapter_keys_the_prefix_cache() -> None:
    s = make_scheduler(max_loras=2)
    prompt = list(range(16))
    s.add_request(make_request("a", 1, prompt, max_tokens=1))
    while s.has_unfinished_requests():
        step(s)
    for rid, lora_id, hit in [("same-adapter", 1, 12), ("other-adapter", 2, 0), ("base", 0, 0)]:
        req = make_request(rid, lora_id, prompt, max_tokens=1)
        s.add_request(req)
        step(s)
        assert req.num_cached_tokens == hit, rid
        while s.has_unfinished_requests():
            step(s)
