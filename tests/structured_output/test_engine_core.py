"""Structured output inside the engine core: requests wait for their grammar (WAITING_FOR_FSM) without holding up
the batch, and preemption by recompute keeps each matcher on its own output tokens."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import jsonschema
import pytest

from pagemill.engine.arg_utils import EngineArgs
from pagemill.engine.core import EngineCore
from pagemill.messages import EngineCoreOutput, EngineCoreRequest
from pagemill.request import RequestStatus
from pagemill.sampling_params import SamplingParams, StructuredOutputsParams
from tests.structured_output.schemas import arr, i

NUM_BLOCKS = 12  # 11 usable blocks of 16 tokens: four ~100-token requests cannot all fit
DIGITS = arr(i(0, 9), 12, 12)  # exactly 12 digits: 30-60 tokens of output


@pytest.fixture(scope="module")
def core(smol_path) -> EngineCore:
    config = EngineArgs(smol_path, max_model_len=160, num_gpu_blocks_override=NUM_BLOCKS).create_engine_config()
    return EngineCore(dataclasses.replace(config, profile=True))


def _params(schema: dict = DIGITS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=120, structured_outputs=StructuredOutputsParams(json=schema), **kw)


def _drain(core: EngineCore) -> dict[str, list[EngineCoreOutput]]:
    outs: dict[str, list[EngineCoreOutput]] = {}
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            outs.setdefault(o.request_id, []).append(o)
    return outs


def _tokens(seq: list[EngineCoreOutput]) -> list[int]:
    return [t for o in seq for t in o.new_token_ids]


def _text(core: EngineCore, tokens: list[int]) -> str:
    return core.structured_output_manager._tokenizer_now().decode(tokens, skip_special_tokens=True)


def _assert_clean(core: EngineCore) -> None:
    stats = core.get_stats()
    assert stats.num_blocks_free == stats.num_blocks_total
    assert core.structured_output_manager.num_live == 0


@pytest.mark.slow
def test_preemption_and_recompute_keep_matchers_on_output_tokens(core):
    prompts = [[10 + k] * 20 for k in range(4)]
    alone = []
    for k, ids in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"alone{k}", ids, _params(), 2, time.monotonic()))
        alone.append(_tokens(_drain(core)[f"alone{k}"]))
    preemptions = core.get_stats().num_preemptions
    for k, ids in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"r{k}", ids, _params(), 2, time.monotonic()))
    outs = _drain(core)
    assert core.get_stats().num_preemptions > preemptions, "11 blocks cannot hold four ~70-token sequences"
    for k in range(4):
        seq = outs[f"r{k}"]
        assert seq[-1].finish_reason == "stop"
        assert _tokens(seq) == alone[k]  # recompute re-samples nothing: the same greedy tokens as alone
        jsonschema.validate(json.loads(_text(core, _tokens(seq))), DIGITS)
    _assert_clean(core)


def test_request_waits_for_its_grammar_without_blocking_the_batch(core):
    manager = core.structured_output_manager
    gate = threading.Event()
    blockers = [manager._compile_pool.submit(gate.wait) for _ in range(manager._compile_pool._max_workers)]
    try:
        schema = {"type": "object", "properties": {"w": {"enum": ["waited"]}}, "required": ["w"]}
        core.add_request(EngineCoreRequest("fsm", [5, 6, 7], _params(schema), 2, time.monotonic()))
        core.add_request(EngineCoreRequest("plain", [8, 9, 10], SamplingParams(temperature=0, max_tokens=3,
                                                                               ignore_eos=True), 2, time.monotonic()))
        assert core.scheduler.requests["fsm"].status == RequestStatus.WAITING_FOR_FSM
        outs: dict[str, list[EngineCoreOutput]] = {}
        for _ in range(3):
            for o in core.step().outputs:
                outs.setdefault(o.request_id, []).append(o)
        assert outs["plain"][-1].finish_reason == "length" and "fsm" not in outs  # the batch went on without it
        assert core.scheduler.requests["fsm"].status == RequestStatus.WAITING_FOR_FSM
    finally:
        gate.set()
    for b in blockers:
        b.result()
    outs = _drain(core)
    assert outs["fsm"][-1].finish_reason == "stop"
    assert json.loads(_text(core, _tokens(outs["fsm"]))) == {"w": "waited"}
    _assert_clean(core)


def test_abort_while_waiting_for_grammar_and_while_running(core):
    manager = core.structured_output_manager
    gate = threading.Event()
    blockers = [manager._compile_pool.submit(gate.wait) for _ in range(manager._compile_pool._max_workers)]
    try:
        core.add_request(EngineCoreRequest("w", [5, 6, 7], _params({"type": "integer", "minimum": 0, "maximum": 5}),
                                           2, time.monotonic()))
        assert [o.finish_reason for o in core.abort_requests(["w"])] == ["abort"]
    finally:
        gate.set()
    for b in blockers:
        b.result()
    core.add_request(EngineCoreRequest("r", [5, 6, 7], _params(), 2, time.monotonic()))
    core.step()
    core.step()
    assert [o.finish_reason for o in core.abort_requests(["r"])] == ["abort"]
    assert not core.has_unfinished_requests()
    _assert_clean(core)


def test_grammar_sections_in_the_profiler(core):
    core.profiler.reset()
    core.add_request(EngineCoreRequest("p", [5, 6, 7], _params({"enum": ["x", "y"]}), 2, time.monotonic()))
    _drain(core)
    report = core.profiler.report()
    assert report["grammar_ms"] > 0 and report["grammar_fill_ms"] > 0
    assert report["step_ms"] >= report["grammar_ms"]
