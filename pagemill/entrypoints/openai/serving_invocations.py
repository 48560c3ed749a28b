"""POST /invocations (Amazon SageMaker's one inference route), routed by the body's shape as vLLM does:
`messages` -> chat completions, `prompt` -> completions, `input` -> embeddings (a pooling model)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from pagemill.engine.async_llm import AsyncLLM
from pagemill.entrypoints.openai.cancellation import with_cancellation
from pagemill.entrypoints.openai.errors import OpenAIError, from_validation_error
from pagemill.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from pagemill.entrypoints.openai.serving_chat import OpenAIServingChat
from pagemill.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagemill.entrypoints.openai.serving_pooling import OpenAIServingEmbedding, check_generate_model

# The key that picks the endpoint, in the order they are tried.
ROUTE_KEYS = (("messages", "/v1/chat/completions"), ("prompt", "/v1/completions"), ("input", "/v1/embeddings"))


def invocation_endpoint(body: Any) -> str:
    """The endpoint a SageMaker body goes to; a 400 for one that fits none."""
    if not isinstance(body, dict):
        raise OpenAIError("The request body must be a JSON object.", 400, None)
    for key, endpoint in ROUTE_KEYS:
        if key in body:
            return endpoint
    raise OpenAIError("Cannot tell which endpoint this /invocations body is for: it needs `messages` (chat "
                      "completions), `prompt` (completions) or `input` (embeddings).", 400, None)


def _parse(model: type[BaseModel], body: dict[str, Any]) -> Any:
    """The request model of `body`; a 400 naming the field at fault, as the endpoint itself answers."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(RequestValidationError(e.errors())) from e


def add_invocations_route(app: FastAPI, engine: AsyncLLM, chat: OpenAIServingChat,
                          completion: OpenAIServingCompletion, embedding: OpenAIServingEmbedding) -> None:
    """Register POST /invocations (left out of the OpenAPI document: its body is any of three endpoints')."""

    @app.post("/invocations", include_in_schema=False)
    @with_cancellation
    async def invocations(raw_request: Request) -> Response:
        try:
            body = json.loads(await raw_request.body())
        except (ValueError, UnicodeDecodeError) as e:
            raise OpenAIError(f"The request body is not valid JSON: {e}", 400, None) from e
        endpoint = invocation_endpoint(body)
        if endpoint == "/v1/chat/completions":
            check_generate_model(engine, endpoint)
            return await chat.create_chat_completion(_parse(ChatCompletionRequest, body))
        if endpoint == "/v1/completions":
            check_generate_model(engine, endpoint)
            return await completion.create_completion(_parse(CompletionRequest, body))
        return await embedding.create_embedding(_parse(EmbeddingRequest, body))
