"""Many concurrent streams and clients that drop mid-stream: correct texts, a free KV pool, consistent metrics."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.conftest import SMOL_PROMPTS
from tests.entrypoints.conftest import API_KEY, MODEL

NUM_COMBOS = 16


def _combo(i: int) -> tuple[str, int]:
    """(prompt, max_tokens) of mixed lengths: 1 to 7 sentences, 4 to 16 tokens."""
    prompt = " ".join(SMOL_PROMPTS[(i + j) % len(SMOL_PROMPTS)] for j in range(1 + (i * 5) % 7))
    return prompt, 4 + (i * 3) % 13


def _client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


def _delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def _successes(m: dict[str, float]) -> float:
    return sum(v for k, v in m.items() if k.startswith("pagemill:request_success_total"))


async def _reference(client: openai.AsyncOpenAI) -> list[tuple[str, int, int]]:
    """Non-streamed greedy (text, prompt tokens, completion tokens) of every combo."""
    async def one(i: int):
        prompt, max_tokens = _combo(i)
        r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
        return r.choices[0].text, r.usage.prompt_tokens, r.usage.completion_tokens

    return list(await asyncio.gather(*(one(i) for i in range(NUM_COMBOS))))


async def _stream(client: openai.AsyncOpenAI, i: int) -> tuple[str, int, int, str]:
    prompt, max_tokens = _combo(i % NUM_COMBOS)
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True})
    text, usage, finish = [], None, None
    async for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None and finish is not None
    return "".join(text), usage.prompt_tokens, usage.completion_tokens, finish


@pytest.fixture(scope="module")
def reference(server) -> list[tuple[str, int, int]]:
    """Non-streamed greedy answers of the combos, all sent at once."""
    async def run():
        async with _client(server) as client:
            return await _reference(client)

    return asyncio.run(run())


def test_64_concurrent_streams(server, reference):
    async def run():
        async with _client(server) as client:
            before = server.metrics()
            results = await asyncio.gather(*(_stream(client, i) for i in range(64)))
            return before, results

    before, results = asyncio.run(run())
    for i, (text, num_prompt, num_gen, _) in enumerate(results):
        assert (text, num_prompt, num_gen) == reference[i % NUM_COMBOS], f"stream {i} differs"
    after = server.wait_idle()
    assert after["pagemill:kv_cache_usage_perc"] == 0.0
    assert _delta(after, before, "pagemill:prompt_tokens_total") == sum(r[1] for r in results)
    assert _delta(after, before, "pagemill:generation_tokens_total") == sum(r[2] for r in results)
    assert _successes(after) - _successes(before) == 64
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert _delta(after, before, f"pagemill:{hist}_count") == 64, hist
    num_itl = sum(r[2] - 1 for r in results)
    assert _delta(after, before, "pagemill:inter_token_latency_seconds_count") <= num_itl  # merged steps
    assert _delta(after, before, "pagemill:prefix_cache_queries_total") > 0
    assert _delta(after, before, "pagemill:prefix_cache_hits_total") > 0  # the repeated prompts hit


async def _drop_after(server, i: int, chunks_wanted: int) -> int:
    """Open a long stream, read a few chunks, then drop the connection; returns the chunks read."""
    async with _client(server) as client:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Write a long essay about topic {i}."}],
            max_tokens=400, temperature=0.8, seed=i, stream=True, extra_body={"ignore_eos": True})
        got = 0
        async for chunk in stream:
            got += bool(chunk.choices and chunk.choices[0].delta.content)
            if got >= chunks_wanted:
                break
        await stream.close()
    return got


def test_clients_dropping_mid_stream_free_their_blocks(server, reference):
    async def run():
        async with _client(server) as client:
            before = server.metrics()
            dropped = [_drop_after(server, i, 2) for i in range(20)]
            survivors = [_stream(client, i) for i in range(4)]
            results = await asyncio.gather(*dropped, *survivors)
            return before, results[:20], results[20:]

    before, dropped, survivors = asyncio.run(run())
    assert dropped == [2] * 20
    for i, (text, num_prompt, num_gen, _) in enumerate(survivors):
        assert (text, num_prompt, num_gen) == reference[i], f"survivor {i} differs"
    after = server.wait_idle(timeout_s=60)
    assert after["pagemill:kv_cache_usage_perc"] == 0.0
    assert _successes(after) - _successes(before) == 4  # aborted requests are not successes
    assert _delta(after, before, "pagemill:generation_tokens_total") < 20 * 400 / 4  # they stopped early
    # the server keeps serving
    assert asyncio.run(_stream_once(server)) == reference[5][0]


async def _stream_once(server) -> str:
    async with _client(server) as client:
        return (await _stream(client, 5))[0]
