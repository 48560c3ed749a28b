"""The scheduler with pooling requests, driven without a model: many short requests share a step, an
encoder-only model gets no KV blocks and whole prompts, and a pooled request leaves nothing behind."""

from __future__ import annotations

import random

from pagemill.config import CacheConfig, SchedulerConfig
from pagemill.core.kv_cache_utils import KVCacheConfig
from pagemill.core.sched_output import ModelRunnerOutput
from pagemill.core.scheduler import Scheduler
from pagemill.pooling_params import PoolingParams
from pagemill.request import Request
from pagemill.sampling_params import SamplingParams
from tests.core.test_scheduler_invariants import check_invariants


def make(kv: bool, budget: int = 64, max_seqs: int = 128, num_blocks: int = 64) -> Scheduler:
    kv_config = KVCacheConfig(num_blocks, 4) if kv else KVCacheConfig(1, 4, 0, ())
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=64),
                     CacheConfig(block_size=4, enable_prefix_caching=False), kv_config)


def pooling_request(rid: str, n: int) -> Request:
    req = Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=1, detokenize=False), None, 0.0)
    req.pooling_params = PoolingParams(task="embed")
    return req


def pooled_output(so) -> ModelRunnerOutput:
    """What a pooling runner returns: a vector for every request whose prompt is complete after the step."""
    done = {rid for rid in so.num_scheduled_tokens}
    return ModelRunnerOutput({}, pooler_output={rid: b"\x00\x00\x80\x3f" for rid in done})


def test_encoder_many_short_requests_share_one_step_without_blocks():
    s = make(kv=False, budget=64)
    for i in range(20):
        s.add_request(pooling_request(f"r{i}", 3))
    so = s.schedule()
    assert len(so.scheduled_new_reqs) == 20 and so.total_num_scheduled_tokens == 60
    assert all(new.block_ids == [] and new.pooling_params.task == "embed" for new in so.scheduled_new_reqs)
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 0 == s.kv_cache_manager.block_pool.num_usable_blocks
    outs = s.update_from_output(so, pooled_output(so))
    assert [o.pooling_output for o in outs] == [b"\x00\x00\x80\x3f"] * 20
    assert all(o.finish_reason == "stop" and o.new_token_ids == [] for o in outs)
    assert not s.has_unfinished_requests() and not s.requests
    assert s.make_stats(include_memory=True).kv_cache_usage == 0.0


def test_encoder_prompt_is_never_chunked():
    """A prompt that does not fit the step's remaining budget waits for the next step (FCFS order kept)."""
    s = make(kv=False, budget=40)
    for rid, n in (("a", 30), ("b", 20), ("c", 5)):
        s.add_request(pooling_request(rid, n))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 30}
    s.update_from_output(so, pooled_output(so))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"b": 20, "c": 5}


def test_decoder_pooling_blocks_are_freed_when_pooled():
    """With a KV cache (a decoder embedder), chunks go through the blocks like a prefill; the pooled request frees
    them at once, and a request is never sampled."""
    s = make(kv=True, budget=16, num_blocks=40)
    rng = random.Random(0)
    lengths = {f"r{i}": rng.randint(1, 40) for i in range(30)}
    for rid, n in lengths.items():
        s.add_request(pooling_request(rid, n))
    finished: set[str] = set()
    while s.has_unfinished_requests():
        so = s.schedule()
        done = {rid for rid in so.num_scheduled_tokens if s.requests[rid].num_computed_tokens >= lengths[rid]}
        outs = s.update_from_output(so, ModelRunnerOutput({}, pooler_output={rid: b"" for rid in done}))
        assert {o.request_id for o in outs} == done and all(o.pooling_output == b"" for o in outs)
        finished |= done
        check_invariants(s)
    assert finished == set(lengths)
    pool = s.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks and not s.kv_cache_manager.groups[0].req_to_blocks
    assert s.num_generation_tokens == 0
