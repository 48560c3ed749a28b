"""RequestOutputCollector: a lagging consumer gets DELTA outputs merged into one; errors win."""

from __future__ import annotations

import asyncio

import pytest

from pagemill.engine.async_llm import EngineDeadError, RequestOutputCollector
from pagemill.outputs import CompletionOutput, Logprob, RequestOutput
from pagemill.sampling_params import RequestOutputKind


def _out(text: str, tokens: list[int], index: int = 0, finish: str | None = None) -> RequestOutput:
    lps = [{t: Logprob(-0.5)} for t in tokens]
    c = CompletionOutput(index, text, list(tokens), -0.5 * len(tokens), lps, finish)
    return RequestOutput("r", "p", [1, 2], None, [c], finish is not None)


def test_delta_outputs_merge_per_sequence():
    async def run():
        col = RequestOutputCollector(RequestOutputKind.DELTA)
        col.put_nowait(_out("Hel", [5]))
        col.put_nowait(_out("lo", [6]))
        col.put_nowait(_out("x", [9], index=1))
        col.put_nowait(_out("!", [7], finish="stop"))
        merged = await col.get()
        assert col.get_nowait() is None
        return merged

    merged = asyncio.run(run())
    assert merged.finished
    first, second = merged.outputs
    assert (first.text, first.token_ids, first.finish_reason) == ("Hello!", [5, 6, 7], "stop")
    assert [list(d) for d in first.logprobs] == [[5], [6], [7]] and first.cumulative_logprob == -0.5
    assert (second.index, second.text, second.token_ids) == (1, "x", [9])


def test_final_only_keeps_the_latest():
    async def run():
        col = RequestOutputCollector(RequestOutputKind.FINAL_ONLY)
        col.put_nowait(_out("a", [1]))
        col.put_nowait(_out("ab", [1, 2], finish="length"))
        return await col.get()

    out = asyncio.run(run())
    assert out.outputs[0].text == "ab" and out.finished


def test_error_wins_and_sticks():
    async def run():
        col = RequestOutputCollector(RequestOutputKind.DELTA)
        waiter = asyncio.ensure_future(col.get())
        await asyncio.sleep(0)
        col.put_nowait(_out("a", [1]))
        assert (await waiter).outputs[0].text == "a"
        col.put_nowait(_out("b", [2]))
        col.put_nowait(EngineDeadError("gone"))
        col.put_nowait(_out("c", [3]))  # late outputs do not hide the error
        for _ in range(2):
            with pytest.raises(EngineDeadError):
                await col.get()

    asyncio.run(run())
