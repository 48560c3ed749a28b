"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right HTTP status."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 413: "RequestTooLargeError", 500: "InternalServerError",
               503: "ServiceUnavailableError"}

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "null"}


class OpenAIError(Exception):
    """An error to answer with an OpenAI-style body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param

    def body(self) -> dict[str, Any]:
        """The JSON body."""
        return error_body(self.message, self.status, self.param)

    def response(self) -> JSONResponse:
        """The JSON response."""
        return JSONResponse(self.body(), status_code=self.status)


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """`{"error": {...}}` for a status code."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "BadRequestError"), "param": param,
                      "code": status}}


def _loc_to_param(loc: Sequence[Any]) -> str | None:
    """'messages.0.role' from ('body', 'messages', 0, 'role'); stops at pydantic's union-member tags (type names,
    model class names)."""
    parts: list[str] = []
    for x in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(x, int):
            parts.append(str(x))
        elif isinstance(x, str) and x.isidentifier() and x.lower() not in _TYPE_TAGS and not x[0].isupper():
            parts.append(x)
        else:
            break
    return ".".join(parts) or None


def from_validation_error(exc: RequestValidationError) -> OpenAIError:
    """A 400 naming the offending field(s) for what FastAPI would answer with a 422."""
    messages: dict[str | None, str] = {}
    for err in exc.errors():
        kind, loc = err.get("type", ""), err.get("loc", ())
        if kind == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            return OpenAIError(f"The request body is not valid JSON: {detail}".rstrip(": "), 400, None)
        param = _loc_to_param(loc)
        if kind == "extra_forbidden":
            msg = f"Unknown field '{param}': it is not a parameter of this endpoint."
        elif kind == "missing" and param is None:
            msg = "The request body is missing or is not a JSON object."
        elif kind == "missing":
            msg = f"{param}: field required."
        else:
            msg = f"{param}: {err.get('msg', 'invalid value')}." if param else f"{err.get('msg', 'invalid body')}."
        messages.setdefault(param, msg)
    params = [p for p in messages if p]
    return OpenAIError(" ".join(messages.values()) or "Invalid request.", 400, ",".join(params) or None)


def from_value_error(exc: ValueError, fields: Iterable[str], default_param: str | None = None) -> OpenAIError:
    """A 400 for a ValueError from SamplingParams / Processor, whose message starts with the field name."""
    message = str(exc)
    m = re.match(r"\s*([A-Za-z_][A-Za-z0-9_]*)", message)
    param = m.group(1) if m and m.group(1) in set(fields) else default_param
    return OpenAIError(message, 400, param)
