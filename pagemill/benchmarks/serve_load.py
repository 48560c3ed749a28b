"""The load generator of `bench serve`: requests sent on a Poisson / gamma arrival schedule to an OpenAI-compatible
streaming endpoint, and the model name to send them with."""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from typing import Any, Sequence

import numpy as np

from pagemill.benchmarks.datasets import SampleRequest
from pagemill.benchmarks.metrics import RequestResult
from pagemill.benchmarks.openai_client import build_payload, send_request

REQUEST_TIMEOUT_S = 6 * 3600


def arrival_times(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Send offsets (s) of `n` requests: gamma inter-arrival gaps (shape=burstiness, mean 1/rate).

    burstiness 1.0 is a Poisson process; an infinite rate sends everything at time 0.
    """
    if rate <= 0:
        raise ValueError(f"--request-rate must be positive, got {rate}")
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be positive, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0  # the first request goes out immediately, as in `vllm bench serve`
    return [float(t) for t in np.cumsum(gaps)]


async def run_load(samples: Sequence[SampleRequest], url: str, model: str, chat: bool,
                   request_rate: float, burstiness: float, max_concurrency: int | None,
                   ignore_eos: bool, temperature: float, seed: int,
                   extra_body: dict[str, Any] | None = None,
                   disable_tqdm: bool = False,
                   per_request_bodies: Sequence[dict[str, Any]] | None = None) -> tuple[list[RequestResult], float]:
    """Send every sample on its arrival schedule; return per-request results and wall time. `per_request_bodies`:
    fields merged into each sample's own request (after `extra_body`)."""
    import aiohttp
    from tqdm.asyncio import tqdm

    offsets = arrival_times(len(samples), request_rate, burstiness, np.random.default_rng(seed))
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    progress = tqdm(total=len(samples), disable=disable_tqdm, desc=f"rate={request_rate:g}")
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()

        async def one(sample: SampleRequest, offset: float, body: dict[str, Any] | None) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            payload = build_payload(sample, model, chat, ignore_eos, temperature, extra_body)
            payload.update(body or {})
            if semaphore is None:
                result = await send_request(session, url, payload, sample.prompt_len, chat)
            else:
                async with semaphore:
                    result = await send_request(session, url, payload, sample.prompt_len, chat)
            progress.update(1)
            return result

        bodies = per_request_bodies or [None] * len(samples)
        results = await asyncio.gather(*(one(s, t, b) for s, t, b in zip(samples, offsets, bodies)))
        duration = time.perf_counter() - start
    progress.close()
    return list(results), duration


async def served_model_names(base_url: str) -> list[str]:
    """Model ids listed by the server's /v1/models."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.get(base_url.rstrip("/") + "/v1/models") as resp:
            resp.raise_for_status()
            body = await resp.json()
    return [m["id"] for m in body.get("data", [])]


def choose_model_name(args: argparse.Namespace, served: Sequence[str]) -> str:
    """The `model` field to send: --served-model-name, else --model if served, else the only one."""
    if args.served_model_name:
        return args.served_model_name
    if args.model in served:
        return args.model
    if served:
        return served[0]
    if args.model:
        return args.model
    raise ValueError("the server lists no models; pass --served-model-name")
