"""Request handlers that end when their client leaves: a disconnect cancels the handler, which aborts its engine
requests (their KV blocks return to the pool)."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote

from fastapi import Request
from fastapi.responses import Response

from pagemill.entrypoints.openai.protocol import OpenAIBaseModel

logger = logging.getLogger("pagemill.entrypoints.openai.api_server")


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


IGNORED_FIELDS_HEADER = "X-Ignored-Fields"


def _note_ignored_fields(response: Any, arguments: Any) -> Any:
    """Name the request's ignored top-level fields in a response header (they were also logged)."""
    for arg in arguments:
        if isinstance(arg, OpenAIBaseModel) and arg.ignored_fields and isinstance(response, Response):
            # Percent-encoded: a header is Latin-1, and a field name may hold any character (or a comma).
            value = ",".join(quote(name, safe="") for name in arg.ignored_fields)
            response.headers[IGNORED_FIELDS_HEADER] = value if len(value) <= 1024 else value[:1021] + "..."
    return response


def with_cancellation(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Cancel the handler (which aborts its engine requests) if the client disconnects before the answer."""

    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        handler_task = asyncio.ensure_future(handler(*args, **kwargs))
        disconnect_task = asyncio.ensure_future(_wait_for_disconnect(kwargs["raw_request"]))
        done, pending = await asyncio.wait([handler_task, disconnect_task], return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        if handler_task in done:
            return _note_ignored_fields(handler_task.result(), kwargs.values())
        logger.info("Client disconnected; request cancelled.")
        return Response(status_code=499)

    return wrapper
