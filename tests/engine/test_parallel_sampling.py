"""n > 1 / best_of fan-out and aggregation (pagemill/engine/parallel_sampling.py), without a model."""

from __future__ import annotations

from pagemill.engine.parallel_sampling import ParentRequest
from pagemill.messages import EngineCoreRequest
from pagemill.outputs import CompletionOutput
from pagemill.sampling_params import RequestOutputKind, SamplingParams


def _req(params: SamplingParams) -> EngineCoreRequest:
    return EngineCoreRequest("r", [1, 2, 3], params, None, 0.0)


def test_single_sequence_has_no_parent():
    assert ParentRequest.from_params("r", SamplingParams(n=1)) is None


def test_fan_out_forks_from_the_first_child_with_distinct_seeds():
    parent = ParentRequest.from_params("r", SamplingParams(n=3, seed=5, temperature=1.0))
    children = parent.child_requests(_req(SamplingParams(n=3, seed=5, temperature=1.0)))
    assert [c.request_id for c in children] == parent.child_ids == ["0_r", "1_r", "2_r"]
    assert [c.fork_of for c in children] == [None, "0_r", "0_r"]
    assert [c.sampling_params.seed for c in children] == [5, 6, 7]
    assert all(c.sampling_params.n == 1 and c.sampling_params.logprobs is None for c in children)


def test_best_of_children_compute_logprobs_and_only_the_best_return():
    sp = SamplingParams(n=2, best_of=4, temperature=1.0)
    parent = ParentRequest.from_params("r", sp)
    children = parent.child_requests(_req(sp))
    assert len(children) == 4 and all(c.sampling_params.logprobs == 0 for c in children)
    kind = RequestOutputKind.FINAL_ONLY
    results = [parent.add_output(CompletionOutput(i, f"t{i}", [i], cumulative_logprob=-lp, logprobs=[{}]), True, kind)
               for i, lp in enumerate([3.0, 1.0, 4.0, 2.0])]
    assert results[:3] == [None] * 3 and parent.finished
    best = results[3]
    assert [c.text for c in best] == ["t1", "t3"] and [c.index for c in best] == [0, 1]
    assert all(c.logprobs is None and c.cumulative_logprob is None for c in best)  # not asked for by the user


def test_streamed_outputs_pass_through_per_child():
    parent = ParentRequest.from_params("r", SamplingParams(n=2))
    out = parent.add_output(CompletionOutput(1, "x", [7]), False, RequestOutputKind.DELTA)
    assert [c.index for c in out] == [1] and not parent.finished
