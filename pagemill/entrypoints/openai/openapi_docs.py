"""The OpenAPI document told truthfully: errors are 400/401/404/413/500 with the OpenAI error body (never FastAPI's
422), streamed endpoints also answer text/event-stream, and /health has its small JSON body."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from pagemill.entrypoints.anthropic.protocol import AnthropicErrorResponse
from pagemill.entrypoints.openai.protocol import INT64_MAX, INT64_MIN, ErrorResponse

_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
_DESCRIPTIONS = {400: "Bad request: the error's `param` names the field at fault.",
                 401: "Missing or wrong API key (when the server runs with --api-key).",
                 404: "Unknown model (or LoRA adapter) in `model`.",
                 413: "Request body larger than --max-request-body-bytes.",
                 500: "The engine is not running.",
                 503: "The server is shutting down and the request did not finish in time."}
# Paths whose POST may answer a stream of server-sent events (`"stream": true`).
STREAMED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
# Paths that answer errors in Anthropic's shape (the Messages API).
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
_ANTHROPIC_ERROR_REF = {"$ref": "#/components/schemas/AnthropicErrorResponse"}
# Paths that resolve a `model` field (404 for an unknown one).
MODEL_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/pooling", "/classify",
               "/score", "/v1/score",
               "/rerank", "/v1/rerank", "/v2/rerank", "/tokenize", "/detokenize", "/v1/responses", "/v1/messages",
               "/v1/messages/count_tokens")


# One server-sent event of a streamed response (`"stream": true`), as the event's fields.
SSE_EVENT_SCHEMA = {
    "type": "object", "required": ["data"],
    "description": "One server-sent event: `data: <chunk JSON>`; the stream ends with `data: [DONE]`, and an error "
                   "after the stream started is a `data: {\"error\": ...}` event before it. /v1/responses names "
                   "each event (`event: <type>`), ends with response.completed or response.incomplete (no [DONE]) "
                   "and reports an error as an `error` event.",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                   "retry": {"type": "integer", "minimum": 0}},
}


class HealthResponse(BaseModel):
    """The body of GET /health while the engine runs."""

    status: str = "ok"


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses=` entries of OpenAI-style errors."""
    return {code: {"model": ErrorResponse, "description": _DESCRIPTIONS[code]} for code in codes}


def _error(code: int, anthropic: bool = False) -> dict[str, Any]:
    schema = _ANTHROPIC_ERROR_REF if anthropic else _ERROR_REF
    return {"description": _DESCRIPTIONS[code], "content": {"application/json": {"schema": schema}}}


def _bound_integers(node: Any) -> None:
    """Every integer in the document is a signed 64-bit one (larger values are refused with a 400)."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            node.setdefault("format", "int64")
            node["minimum"] = max(node.get("minimum", INT64_MIN), INT64_MIN)
            node["maximum"] = min(node.get("maximum", INT64_MAX), INT64_MAX)
        for value in node.values():
            _bound_integers(value)
    elif isinstance(node, list):
        for value in node:
            _bound_integers(value)


def truthful_openapi(app: FastAPI, open_paths: frozenset[str]) -> dict[str, Any]:
    """FastAPI's document with the responses this server really sends (`open_paths`: no API key needed)."""
    spec = get_openapi(title=app.title, version=app.version, routes=app.routes, description=app.description)
    schemas = spec.setdefault("components", {}).setdefault("schemas", {})
    error_schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(error_schema.pop("$defs", {}))
    schemas["ErrorResponse"] = error_schema
    anthropic_schema = AnthropicErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(anthropic_schema.pop("$defs", {}))
    schemas["AnthropicErrorResponse"] = anthropic_schema
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    _bound_integers(schemas)
    for path, operations in spec.get("paths", {}).items():
        for method, op in operations.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            codes = [500]
            if path not in open_paths:
                codes.append(401)
            if "requestBody" in op:
                codes += [400, 413]
            if path in MODEL_PATHS:
                codes.append(404)
            if path in STREAMED_PATHS:
                codes.append(503)
                ok = responses.setdefault("200", {"description": "Successful Response"})
                ok.setdefault("content", {})["text/event-stream"] = {"schema": SSE_EVENT_SCHEMA}
            if path == "/metrics":
                ok = responses.setdefault("200", {"description": "Successful Response"})
                ok["content"] = {"text/plain": {"schema": {"type": "string",
                                                           "description": "Prometheus text format."}}}
            for code in sorted(codes):
                responses.setdefault(str(code), _error(code, path in ANTHROPIC_PATHS))
    return spec


def document_api(app: FastAPI, open_paths: frozenset[str]) -> None:
    """Serve truthful_openapi(app) at /openapi.json (built once, on first use)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = truthful_openapi(app, open_paths)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
