"""The measured price of verification: step seconds by token count, and the back-off it drives in the scheduler
(drafts with 50% acceptance keep going while verification is free or cheap, back off where each row costs as much
as a request's plain step)."""

from __future__ import annotations

import pytest

from pagemill.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from pagemill.core.kv_cache_utils import KVCacheConfig
from pagemill.core.sched_output import ModelRunnerOutput
from pagemill.request import Request
from pagemill.sampling_params import SamplingParams
from pagemill.spec_decode.verify_cost import VerifyCostModel
from tests.spec_decode.test_spec_scheduler import speculative_scheduler


def test_step_seconds_measured_interpolated_and_extrapolated():
    m = VerifyCostModel(decay=0.5)
    assert m.step_seconds(4) is None and m.cost_per_draft(4, 16) == 0.0
    assert not m.plain_due(4, 100)  # nothing verified yet: nothing to compare with
    m.record(20, 2.0)
    assert m.step_seconds(4) is None  # one count above: no evidence of the plain step
    m.record(12, 1.6)
    assert m.step_seconds(12) == 1.6 and m.step_seconds(16) == pytest.approx(1.8)
    assert m.step_seconds(30) == 2.0
    assert m.step_seconds(4) == pytest.approx(1.2)  # below: the two smallest counts' line
    m.record(16, 3.6)
    assert m.step_seconds(6) == pytest.approx(1.6 * 6 / 12)  # ... no less than proportional
    m.record(20, 4.0)
    assert m.seconds[20] == pytest.approx(3.0)  # moving average
    assert m.plain_due(4, 100) and not m.plain_due(4, 101)  # unmeasured; then not again for PLAIN_PROBE_EVERY
    m.record(4, 1.0, 200)
    assert not m.plain_due(4, 400) and m.plain_due(4, 200 + 513)  # fresh; stale
    assert m.cost_per_draft(4, 16) == pytest.approx((3.0 / 1.0 - 1) * 4 / 16)
    m.record(5, 1.0)
    assert m.cost_per_draft(1, 4) == 0.0 and m.cost_per_draft(4, 0) == 0.0  # T(1) unknown; no drafts
    m.record(1, 1.0)
    assert m.cost_per_draft(1, 4) == 0.0  # flat: verification is free


def drafted_steps(step_seconds, acceptance: float, batch: int = 4, steps: int = 200) -> int:
    """Steps that verified drafts for `batch` requests, each draft accepted with `acceptance` (deterministically
    the first round(acceptance k)), the runner's step time given by `step_seconds(tokens)`."""
    s = speculative_scheduler(SchedulerConfig(max_num_batched_tokens=256, max_model_len=4096),
                              CacheConfig(block_size=4), KVCacheConfig(4000, 4),
                              SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    for i in range(batch):
        s.add_request(Request(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=2000, ignore_eos=True), None, float(i)))
    drafted = 0
    for _ in range(steps):
        so = s.schedule()
        sampled, proposals = {}, {}
        for rid in so.num_scheduled_tokens:
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            sampled[rid] = drafts[:round(acceptance * len(drafts))] + [8]
            if rid in so.num_spec_tokens_to_propose:
                proposals[rid] = [9, 9, 9, 9]
        drafted += bool(so.scheduled_spec_decode_tokens)
        s.update_from_output(so, ModelRunnerOutput(sampled, draft_token_ids=proposals,
                                                   target_seconds=step_seconds(so.total_num_scheduled_tokens)))
    return drafted


def test_half_accepted_drafts_keep_going_while_verification_is_free_and_back_off_where_it_is_not():
    free = drafted_steps(lambda n: 1.0, acceptance=0.5)  # bound by the weights: any rows cost one step
    costly = drafted_steps(lambda n: n / 4, acceptance=0.5)  # each row costs a request's plain step
    assert free > 150
    assert costly < 40
    # Each row costs a request's plain step: 3 of 4 drafts accepted still lose (4 tokens for 5 rows' time).
    assert drafted_steps(lambda n: n / 4, acceptance=0.75) < 40
    # Rows at a third of that: 1 + 0.5 k tokens for 1 + k rows at 1 + n / 8 pays (cost 1/3 per draft).
    assert drafted_steps(lambda n: 1 + n / 8, acceptance=0.5) > 150
