"""Per-request bounds of the HTTP server that are not engine arguments: request body size, request chat templates
and their rendering time, and how long a shutdown waits for requests in flight."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagemill.entrypoints.openai.errors import error_body

MiB = 2**20


@dataclass(frozen=True)
class ServerLimits:
    """What one request may cost the server (the engine's own limits, such as max_logprobs, are EngineArgs)."""

    max_request_body_bytes: int = 32 * MiB
    trust_request_chat_template: bool = False  # vLLM's --trust-request-chat-template
    chat_template_timeout_s: float = 10.0
    shutdown_timeout_s: float = 30.0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerLimits:
        """The limits of `pagemill serve`'s flags."""
        return cls(max_request_body_bytes=args.max_request_body_bytes,
                   trust_request_chat_template=args.trust_request_chat_template,
                   chat_template_timeout_s=args.chat_template_timeout,
                   shutdown_timeout_s=args.shutdown_timeout)


def add_limit_args(group: argparse._ArgumentGroup) -> None:
    """The server flags of ServerLimits."""
    group.add_argument("--max-request-body-bytes", type=int, default=ServerLimits.max_request_body_bytes,
                       help="Largest request body accepted (a larger one gets a 413).")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="Allow requests to bring their own chat_template (refused by default).")
    group.add_argument("--chat-template-timeout", type=float, default=ServerLimits.chat_template_timeout_s,
                       help="Seconds a chat template may take to render one request (then a 400).")
    group.add_argument("--shutdown-timeout", type=float, default=ServerLimits.shutdown_timeout_s,
                       help="On SIGTERM, seconds to let requests in flight finish before they are ended with an "
                            "error (a second signal exits at once).")


class BodySizeLimitMiddleware:
    """Answers 413 to a request whose body is larger than the limit: at once from Content-Length, or as soon as a
    streamed (chunked) body passes it, before anything parses it (pure ASGI, stream-safe)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> JSONResponse:
        error = _BodyTooLarge(self.max_bytes)
        return JSONResponse(error_body(error.detail, 413), status_code=413)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._too_large()(scope, receive, send)
            return
        received = 0
        response_started = False

        async def send_tracked(message: Message) -> None:
            nonlocal response_started
            response_started = response_started or message["type"] == "http.response.start"
            await send(message)

        async def receive_limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge(self.max_bytes)
            return message

        try:
            await self.app(scope, receive_limited, send_tracked)
        except _BodyTooLarge:
            if not response_started:
                await self._too_large()(scope, receive, send)


class _BodyTooLarge(HTTPException):
    """A streamed request body passed the limit (an HTTPException, so the app's handler answers the 413)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"The request body is larger than {max_bytes} bytes (--max-request-body-bytes).")
