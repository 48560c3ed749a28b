"""The scheduler with several batches in flight (pipeline micro-batches), driven without a model: a request in a
batch whose output is not back is neither scheduled again nor preempted, the running requests are shared evenly
between the batches, and an output coming back makes its requests schedulable again."""

from __future__ import annotations

from pagemill.config import CacheConfig, SchedulerConfig
from pagemill.core.kv_cache_utils import KVCacheConfig
from pagemill.core.sched_output import ModelRunnerOutput
from pagemill.core.scheduler import Scheduler
from pagemill.request import Request, RequestStatus
from pagemill.sampling_params import SamplingParams


def _scheduler(num_blocks: int = 64, budget: int = 64, batches: int = 2) -> Scheduler:
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=128),
                  CacheConfig(block_size=4, enable_prefix_caching=False), KVCacheConfig(num_blocks, 4))
    s.max_concurrent_batches = batches
    return s


def _add(s: Scheduler, rid: str, prompt_len: int, max_tokens: int = 8) -> None:
    s.add_request(Request(rid, list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                          None, float(len(s.requests))))


def _output(s: Scheduler, so, token: int = 7) -> ModelRunnerOutput:
    """Every scheduled request whose known tokens are all computed samples `token` (as the runner does)."""
    return ModelRunnerOutput({rid: [token] for rid in so.num_scheduled_tokens
                              if s.requests[rid].num_computed_tokens >= s.requests[rid].num_tokens})


def test_two_batches_share_the_requests_and_never_overlap():
    s = _scheduler()
    for i in range(4):
        _add(s, f"r{i}", 5)
    first = s.schedule()
    second = s.schedule()
    assert set(first.num_scheduled_tokens) == {"r0", "r1"}  # an even share each: both stages get work
    assert set(second.num_scheduled_tokens) == {"r2", "r3"}
    assert s.schedule().total_num_scheduled_tokens == 0  # everything is in flight
    s.update_from_output(first, _output(s, first))
    third = s.schedule()
    assert set(third.num_scheduled_tokens) == {"r0", "r1"} and third.total_num_scheduled_tokens == 2  # decodes
    s.update_from_output(second, _output(s, second))
    fourth = s.schedule()
    assert set(fourth.num_scheduled_tokens) == {"r2", "r3"}
    assert all(len(s.requests[r].output_token_ids) == 1 for r in ("r0", "r1", "r2", "r3"))


def test_a_chunked_prefill_in_flight_waits_for_its_output():
    s = _scheduler(budget=8)
    _add(s, "long", 20)  # three chunks of 8
    first = s.schedule()
    assert first.num_scheduled_tokens == {"long": 8}
    assert s.schedule().total_num_scheduled_tokens == 0  # its next chunk waits: its batch is not back
    s.update_from_output(first, ModelRunnerOutput({}))
    second = s.schedule()
    assert second.num_scheduled_tokens == {"long": 8} and second.scheduled_cached_reqs[0].num_computed_tokens == 8


def test_with_one_batch_in_flight_nothing_changes():
    s = _scheduler(batches=1)
    for i in range(4):
        _add(s, f"r{i}", 5)
    so = s.schedule()
    assert set(so.num_scheduled_tokens) == {"r0", "r1", "r2", "r3"}
    s.update_from_output(so, _output(s, so))
    assert not s.in_flight


def test_a_request_in_flight_is_not_preempted():
    # 4 usable blocks of 4 tokens; r0 and r1 hold 2 each (8-token prompts). r1 is in flight and last in the running
    # list (the default victim) when r0 needs a third block: r0 preempts itself, r1 keeps its blocks.
    s = _scheduler(num_blocks=5, budget=64, batches=2)
    _add(s, "r0", 8, max_tokens=20)
    _add(s, "r1", 8, max_tokens=20)
    a = s.schedule()
    b = s.schedule()
    assert set(a.num_scheduled_tokens) == {"r0"} and set(b.num_scheduled_tokens) == {"r1"}
    s.update_from_output(a, _output(s, a))
    c = s.schedule()
    assert c.total_num_scheduled_tokens == 0 and c.preempted_req_ids == {"r0"}
    assert s.requests["r1"].status == RequestStatus.RUNNING and s.requests["r0"].status == RequestStatus.PREEMPTED
    s.update_from_output(b, _output(s, b))
    assert s.requests["r1"].output_token_ids == [7]
    d = s.schedule()  # r1 decodes into a third block (r0's were freed)
    assert set(d.num_scheduled_tokens) == {"r1"}
