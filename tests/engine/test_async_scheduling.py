"""Async scheduling (issue 18 item 2): step N+1 is scheduled while the model runs step N, and the tokens are those of
synchronous scheduling, token for token: mixed lengths, chunked prefill, preemption (recompute and swap), prefix
hits, n > 1 and seeded sampling, stop tokens and strings, max_tokens, aborts of requests whose steps are in flight;
in process (EngineCore, LLM) and in the engine-core process (AsyncLLM). A tiny random Llama (conftest)."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from pagemill import LLM
from pagemill.core.sched_output import SchedulerOutput
from pagemill.engine.arg_utils import EngineArgs
from pagemill.engine.async_llm import AsyncLLM
from pagemill.engine.core import EngineCore
from pagemill.entrypoints.cli import build_parser
from pagemill.entrypoints.openai.cli_args import engine_args_from_namespace
from pagemill.messages import EngineCoreRequest
from pagemill.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

# name -> engine arguments: chunked prefill, a KV pool small enough to preempt (recompute / swap), srtf order.
CONFIGS = {
    "chunked": dict(max_num_batched_tokens=16, num_gpu_blocks_override=200),
    "preempt": dict(max_num_batched_tokens=24, num_gpu_blocks_override=40),
    "swap": dict(max_num_batched_tokens=24, num_gpu_blocks_override=40, preemption_mode="swap", swap_space=0.01),
    "srtf": dict(max_num_batched_tokens=24, num_gpu_blocks_override=40, scheduling_policy="srtf"),
}


def _core(model: str, async_scheduling: bool, **kwargs) -> EngineCore:
    args = dict(block_size=4, max_model_len=128, async_scheduling=async_scheduling) | kwargs
    return EngineCore(EngineArgs(model, **args).create_engine_config())


def _requests(seed: int = 0, n: int = 10, **params) -> list[EngineCoreRequest]:
    """Mixed prompt and output lengths; every third prompt shares a 12-token prefix (prefix-cache hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(100, 5000) for _ in range(12)]
    reqs = []
    for i in range(n):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(100, 5000) for _ in range(rng.randrange(3, 40))]
        sp = SamplingParams(**({"temperature": 0, "max_tokens": rng.randrange(4, 30), "ignore_eos": True} | params))
        reqs.append(EngineCoreRequest(f"r{i}", prompt, sp, None, time.monotonic()))
    return reqs


class Run:
    """Drives an EngineCore to the end: tokens and finish reasons per request, the steps seen in flight."""

    def __init__(self, core: EngineCore, requests: list[EngineCoreRequest],
                 aborts: dict[int, list[str]] | None = None, resets: set[int] = frozenset()) -> None:
        self.tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
        self.finish: dict[str, str] = {}
        self.scheduled: dict[str, int] = {}  # tokens scheduled per request over the steps submitted (async)
        self.overlapped = 0  # steps returned while another step was in flight
        self.aborted_in_flight: set[str] = set()
        submit = core.executor.execute_model_async

        def counted(so: SchedulerOutput):  # the real submission, with the step's tokens counted
            for rid, n in so.num_scheduled_tokens.items():
                self.scheduled[rid] = self.scheduled.get(rid, 0) + n
            return submit(so)

        core.executor.execute_model_async = counted
        for r in requests:
            core.add_request(r)
        step = 0
        while core.has_unfinished_requests():
            for o in core.step().outputs:
                self._record(o)
            step += 1
            self.overlapped += bool(core.batch_queue)
            if step in resets:  # preempts every running request, two steps of some of them in flight
                core.reset_prefix_cache(reset_running_requests=True)
            for rid in (aborts or {}).get(step, []):
                if any(rid in so.num_scheduled_tokens for so in self._in_flight(core)):
                    self.aborted_in_flight.add(rid)
                for o in core.abort_requests([rid]):
                    self._record(o)
        self.stats = core.get_stats()
        core.shutdown()

    @staticmethod
    def _in_flight(core: EngineCore) -> list[SchedulerOutput]:
        return [so for _, so in core.batch_queue or ()]

    def _record(self, o) -> None:
        assert o.request_id not in self.finish, f"{o.request_id}: output after it finished"
        self.tokens[o.request_id].extend(o.new_token_ids)
        if o.finish_reason is not None:
            self.finish[o.request_id] = o.finish_reason


def _assert_all_free(run: Run) -> None:
    assert run.stats.num_running_reqs == run.stats.num_waiting_reqs == 0
    assert run.stats.num_blocks_free == run.stats.num_blocks_total, "KV blocks leaked"
    assert run.stats.num_swap_blocks_free == run.stats.num_swap_blocks_total, "swap blocks leaked"


def test_flag_and_refusals(tiny_llama):
    args = build_parser().parse_args(["serve", tiny_llama, "--async-scheduling"])
    assert engine_args_from_namespace(args).create_engine_config().scheduler_config.async_scheduling
    assert not EngineArgs(tiny_llama).create_engine_config().scheduler_config.async_scheduling
    with pytest.raises(ValueError, match="async_scheduling.*speculative_config"):
        EngineArgs(tiny_llama, async_scheduling=True,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2}).create_engine_config()
    with pytest.raises(ValueError, match="async_scheduling.*tensor_parallel_size"):
        EngineArgs(tiny_llama, async_scheduling=True, tensor_parallel_size=2).create_engine_config()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_tokens_equal_sync(tiny_llama, name):
    sync = Run(_core(tiny_llama, False, **CONFIGS[name]), _requests())
    run = Run(_core(tiny_llama, True, **CONFIGS[name]), _requests())
    assert run.tokens == sync.tokens
    assert run.finish == sync.finish == {r: "length" for r in sync.tokens}
    assert run.overlapped > 10, "no step was scheduled while another ran"
    if name in ("preempt", "swap", "srtf"):
        assert run.stats.num_preemptions > 0
    if name == "swap":
        assert run.stats.num_swapped_out > 0
    assert run.stats.prefix_cache_hits > 0
    _assert_all_free(run)


def test_max_tokens_and_stop_tokens(tiny_llama):
    """A request at max_tokens gets no step beyond it; one that stops on a token gets at most one (discarded)."""
    kwargs = dict(max_num_batched_tokens=64, num_gpu_blocks_override=200,
                  enable_prefix_caching=False)  # (every prompt token is scheduled)
    free = Run(_core(tiny_llama, False, **kwargs), _requests(1, ignore_eos=False))
    stops = {rid: toks[len(toks) // 2] for rid, toks in free.tokens.items() if int(rid[1:]) % 2 == 0}

    def reqs():
        rs = _requests(1, ignore_eos=False)
        for r in rs:
            if r.request_id in stops:
                r.sampling_params = SamplingParams(temperature=0, max_tokens=r.sampling_params.max_tokens,
                                                   stop_token_ids=[stops[r.request_id]])
        return rs

    sync = Run(_core(tiny_llama, False, **kwargs), reqs())
    run = Run(_core(tiny_llama, True, **kwargs), reqs())
    assert run.tokens == sync.tokens and run.finish == sync.finish
    prompts = {r.request_id: len(r.prompt_token_ids) for r in reqs()}
    for r in reqs():
        rid, toks = r.request_id, run.tokens[r.request_id]
        assert len(toks) <= r.sampling_params.max_tokens
        if rid in stops:
            assert run.finish[rid] == "stop" and toks[-1] == stops[rid] and stops[rid] not in toks[:-1]
            assert run.scheduled[rid] - (prompts[rid] + len(toks) - 1) in (0, 1)  # at most one wasted step
        else:
            assert run.finish[rid] == "length" and len(toks) == r.sampling_params.max_tokens
            assert run.scheduled[rid] == prompts[rid] + len(toks) - 1  # no wasted step
    _assert_all_free(run)


def test_aborts_in_flight_lose_or_duplicate_no_token(tiny_llama):
    """Aborts, and preemptions outside the scheduler (reset_prefix_cache(reset_running_requests=True)), of requests
    with steps in flight."""
    kwargs = CONFIGS["preempt"]
    sync = Run(_core(tiny_llama, False, **kwargs), _requests(2, n=12))
    aborts = {3: ["r0", "r4"], 6: ["r1", "r9"], 9: ["r7"], 14: ["r2", "r11"]}
    run = Run(_core(tiny_llama, True, **kwargs), _requests(2, n=12), aborts, resets={5, 11, 20})
    aborted = {rid for ids in aborts.values() for rid in ids}
    assert run.aborted_in_flight, "no abort hit a request with a step in flight"
    for rid, toks in run.tokens.items():
        if rid in aborted and run.finish[rid] == "abort":
            assert toks == sync.tokens[rid][:len(toks)] and len(toks) < len(sync.tokens[rid])
        else:
            assert toks == sync.tokens[rid] and run.finish[rid] == "length"
    _assert_all_free(run)


def _llm_outputs(model: str, async_scheduling: bool, prompts: list, params: list[SamplingParams]) -> list:
    # batch-invariant kernels: a step's other requests (which differ between the two schedules) cannot move a seeded
    # sample by a rounding (the default kernels' sums depend on the batch's row count on some ISA variants)
    llm = LLM(model, max_model_len=128, block_size=4, kv_cache_memory="16MiB", max_num_batched_tokens=32,
              async_scheduling=async_scheduling, batch_invariant=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[(list(c.token_ids), c.text, c.finish_reason, c.stop_reason,
              [sorted((t, lp.logprob) for t, lp in d.items()) for d in c.logprobs or []])
             for c in o.outputs] for o in outs]


def _assert_same(run: list, sync: list) -> None:
    """The same tokens, text and finish; the same logprob entries within float noise (another batch around a
    request sums its matmuls in another order)."""
    assert [[c[:4] for c in o] for o in run] == [[c[:4] for c in o] for o in sync]
    for o, p in zip(run, sync):
        for c, d in zip(o, p):
            assert [[t for t, _ in x] for x in c[4]] == [[t for t, _ in x] for x in d[4]]
            assert [lp for x in c[4] for _, lp in x] == pytest.approx([lp for x in d[4] for _, lp in x], abs=1e-3)


def test_llm_n_seeded_logprobs_and_stop_strings(tiny_llama):
    """LLM(...): n > 1 (forked sequences), seeded sampling, logprobs, and a detokenizer-side stop string (the front
    end aborts the request while its next step is in flight: that step's token is never emitted)."""
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 5000) for _ in range(rng.randrange(5, 30))]}
               for _ in range(6)]
    probe = _llm_outputs(tiny_llama, False, prompts[1:2], [SamplingParams(temperature=0, max_tokens=12,
                                                                         ignore_eos=True)])
    stop = probe[0][0][1][6:9]  # a piece of the greedy text
    params = [SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]),
              SamplingParams(n=2, temperature=0, max_tokens=9, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=1.0, seed=3, max_tokens=15, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
              SamplingParams(n=2, temperature=0.9, seed=11, max_tokens=11, ignore_eos=True)]
    sync = _llm_outputs(tiny_llama, False, prompts, params)
    run = _llm_outputs(tiny_llama, True, prompts, params)
    _assert_same(run, sync)
    assert sync[1][0][2] == "stop" and sync[1][0][3] == stop


def test_engine_core_process(tiny_llama):
    """AsyncLLM: the engine core process schedules ahead too; a stop string (the front end aborts the request in
    the core) and a client abort mid-stream lose no token and no block."""
    rng = random.Random(4)
    prompts = [[rng.randrange(100, 5000) for _ in range(rng.randrange(5, 40))] for _ in range(8)]
    lengths = [rng.randrange(5, 25) for _ in prompts]
    args = dict(max_model_len=128, block_size=4, kv_cache_memory="16MiB", max_num_batched_tokens=32)
    llm = LLM(tiny_llama, **args)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    text = llm.generate([{"prompt_token_ids": prompts[1]}], params[1], use_tqdm=False)[0].outputs[0].text
    params[1] = SamplingParams(temperature=0, max_tokens=lengths[1], ignore_eos=True, stop=[text[len(text) // 2:][:3]])
    expected = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    engine = AsyncLLM.from_engine_args(EngineArgs(tiny_llama, async_scheduling=True, **args))

    async def collect(i: int) -> list[int]:
        outs = [o async for o in engine.generate({"prompt_token_ids": prompts[i]}, params[i], f"r{i}")]
        return list(outs[-1].outputs[0].token_ids)

    async def abandoned() -> list[int]:  # the client goes away after 3 tokens: the request is aborted
        sp = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        got: list[int] = []
        gen = engine.generate({"prompt_token_ids": prompts[0]}, sp, "gone")
        async for o in gen:
            got.extend(o.outputs[0].token_ids)
            if len(got) >= 3:
                break
        await gen.aclose()
        return got

    async def main() -> tuple[list[list[int]], list[int], dict]:
        outs = await asyncio.gather(*(collect(i) for i in range(len(prompts))), abandoned())
        end = time.monotonic() + 30
        while True:
            stats = await engine.get_scheduler_stats()
            if stats["num_blocks_free"] == stats["num_blocks_total"] or time.monotonic() > end:
                return outs[:-1], outs[-1], stats
            await asyncio.sleep(0.05)

    try:
        outs, gone, stats = asyncio.run(main())
    finally:
        engine.shutdown()
    assert outs == expected and len(expected[1]) < lengths[1]  # (the stop string ended request 1 early)
    assert gone == list(llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(
        temperature=0, max_tokens=len(gone), ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids)
    assert stats["num_blocks_free"] == stats["num_blocks_total"]
    assert stats.get("num_running_reqs", 0) == stats.get("num_waiting_reqs", 0) == 0


def test_structured_output_steps_run_synchronously(tiny_llama):
    """While a constrained request is live the engine does not schedule ahead (its bitmask needs the real previous
    token): the constrained outputs keep to their grammar and every output is the synchronous one."""
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 5000) for _ in range(rng.randrange(5, 30))]}
               for _ in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=8,
                             structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
              SamplingParams(temperature=0.8, seed=2, max_tokens=10,
                             structured_outputs=StructuredOutputsParams(regex="[a-c]{2,6}")),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)]
    sync = _llm_outputs(tiny_llama, False, prompts, params)
    run = _llm_outputs(tiny_llama, True, prompts, params)
    _assert_same(run, sync)
    assert run[1][0][1] in ("yes", "no") and 2 <= len(run[2][0][1]) <= 6


@pytest.mark.slow
def test_worker_process_executor(tiny_llama):
    """distributed_executor_backend='mp' with one rank: the step thread waits on the worker process, which runs the
    forward while the engine schedules the next step."""
    rng = random.Random(6)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 5000) for _ in range(rng.randrange(5, 30))]}
               for _ in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 12, 7, 15, 9)]
    args = dict(max_model_len=128, block_size=4, kv_cache_memory="16MiB", max_num_batched_tokens=32)
    expected = [o.outputs[0].token_ids for o in LLM(tiny_llama, **args).generate(prompts, params, use_tqdm=False)]
    llm = LLM(tiny_llama, distributed_executor_backend="mp", async_scheduling=True, **args)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
        assert type(llm.llm_engine.engine_core.executor).__name__ == "MultiprocExecutor"
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_pooling_requests(tiny_llama):
    """A pooling request never samples: it gets no placeholder and no step after its prompt (chunked here)."""
    texts = ["hello there " * k for k in range(1, 8)]
    embeddings, computed = [], []
    for async_scheduling in (False, True):
        llm = LLM(tiny_llama, runner="pooling", max_model_len=128, kv_cache_memory="16MiB", max_num_batched_tokens=16,
                  async_scheduling=async_scheduling)
        executor, tokens = llm.llm_engine.engine_core.executor, []
        run_step = executor.execute_model

        def counted(so: SchedulerOutput, run_step=run_step, tokens=tokens):  # the real step, its tokens counted
            tokens.append(so.total_num_scheduled_tokens)
            return run_step(so)

        executor.execute_model = counted
        embeddings.append([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
        computed.append(sum(tokens))
        stats = llm.llm_engine.get_stats()
        assert stats.num_blocks_free == stats.num_blocks_total
    assert embeddings[1] == embeddings[0]
    assert computed[1] == computed[0]  # the prompts' tokens, nothing after them


def test_request_id_reused_while_the_aborted_requests_step_is_in_flight(tiny_llama):
    """The token of the aborted request's step in flight must not reach the new request under the same id."""
    first, second = _requests(7, n=2)
    second.request_id = first.request_id
    alone = Run(_core(tiny_llama, False, num_gpu_blocks_override=100), _requests(7, n=2)[1:])
    core = _core(tiny_llama, True, num_gpu_blocks_override=100)
    core.add_request(first)
    got = []
    while len(got) < 3:
        got += [t for o in core.step().outputs for t in o.new_token_ids]
    assert any(first.request_id in so.num_scheduled_tokens for _, so in core.batch_queue)  # a step is in flight
    core.abort_requests([first.request_id])
    run = Run(core, [second])
    assert run.tokens[first.request_id] == alone.tokens["r1"] and run.finish[first.request_id] == "length"
    _assert_all_free(run)
