"""The disaggregated prefill proxy (vLLM's disagg_proxy examples): each completion request is first sent to a
prefill instance with max_tokens=1 (it computes the prompt's KV and hands it to its connector), then, unchanged,
to a decode instance, which loads that KV instead of computing the prompt and streams the answer back.

    pagemill serve MODEL --port 8100 --kv-transfer-config '{"kv_connector": "ZmqConnector", "kv_role": "kv_producer"}'
    pagemill serve MODEL --port 8200 --kv-transfer-config '{"kv_connector": "ZmqConnector", "kv_role": "kv_consumer"}'
    pagemill disagg-proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
"""

from __future__ import annotations

import argparse
import itertools
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger(__name__)
_FORWARDED_HEADERS = ("authorization", "x-request-id")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as the prefill instance gets it: one token, one sequence, no streaming."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "best_of")}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["n"] = 1
    return out


def build_proxy_app(prefill_urls: Sequence[str], decode_urls: Sequence[str], timeout_s: float = 600.0) -> FastAPI:
    """A FastAPI app routing /v1/completions and /v1/chat/completions through prefill then decode instances
    (round robin over each list)."""
    if not prefill_urls or not decode_urls:
        raise ValueError("disagg-proxy needs at least one --prefill and one --decode URL.")
    prefills, decodes = itertools.cycle(prefill_urls), itertools.cycle(decode_urls)
    clients: dict[str, httpx.AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        clients["http"] = httpx.AsyncClient(timeout=timeout_s)
        yield
        await clients["http"].aclose()

    app = FastAPI(title="pagemill disaggregated prefill proxy", lifespan=lifespan)

    async def route(request: Request, path: str) -> Response:
        try:
            return await forward(request, path)
        except httpx.HTTPError as e:  # an instance is down or hung up: a gateway error, not a proxy crash
            return JSONResponse({"error": {"message": f"upstream instance failed: {e!r}", "type": "BadGateway",
                                           "code": 502}}, 502)

    async def forward(request: Request, path: str) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": {"message": "the request body must be JSON", "type": "BadRequestError",
                                           "code": 400}}, 400)
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "the request body must be a JSON object",
                                           "type": "BadRequestError", "code": 400}}, 400)
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}
        client = clients["http"]
        prefill = await client.post(next(prefills) + path, json=prefill_body(body), headers=headers)
        if prefill.status_code != 200:  # a bad request fails on the prefill instance already: pass its error on
            return Response(prefill.content, prefill.status_code, media_type="application/json")
        url = next(decodes) + path
        if not body.get("stream"):
            decode = await client.post(url, json=body, headers=headers)
            return Response(decode.content, decode.status_code, media_type="application/json")
        upstream = await client.send(client.build_request("POST", url, json=body, headers=headers), stream=True)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(relay(), upstream.status_code,
                                 media_type=upstream.headers.get("content-type", "text/event-stream"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await route(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await route(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        r = await clients["http"].get(decode_urls[0] + "/v1/models",
                                      headers={k: v for k, v in request.headers.items()
                                               if k.lower() in _FORWARDED_HEADERS})
        return Response(r.content, r.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        status = {}
        for url in (*prefill_urls, *decode_urls):
            try:
                status[url] = (await clients["http"].get(url + "/health", timeout=5)).status_code
            except httpx.HTTPError:
                status[url] = 0
        ok = all(code == 200 for code in status.values())
        return JSONResponse({"instances": status}, 200 if ok else 503)

    return app


def add_proxy_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `pagemill disagg-proxy`."""
    parser.add_argument("--prefill", action="append", required=True, metavar="URL",
                        help="a prefill instance (kv_producer), e.g. http://127.0.0.1:8100; repeat for several")
    parser.add_argument("--decode", action="append", required=True, metavar="URL",
                        help="a decode instance (kv_consumer), e.g. http://127.0.0.1:8200; repeat for several")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per upstream request")


def run_proxy(args: argparse.Namespace) -> None:
    """`pagemill disagg-proxy`: serve until SIGINT/SIGTERM."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s [%(name)s] %(message)s")
    strip = [u.rstrip("/") for u in args.prefill], [u.rstrip("/") for u in args.decode]
    app = build_proxy_app(*strip, timeout_s=args.timeout)
    logger.info("Disaggregated prefill proxy on http://%s:%d: prefill %s, decode %s", args.host, args.port, *strip)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
