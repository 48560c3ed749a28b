"""Anthropic's Messages API on the chat path: a Messages request becomes a chat completion request (system prompt,
turns, tool_use / tool_result blocks as tool calls and tool messages, tools and tool_choice), and the chat answer,
whole or streamed, becomes a Message or Anthropic's event stream (message_start, content_block_start / delta /
stop, message_delta, message_stop). Errors have Anthropic's shape."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from pagemill.entrypoints.anthropic.protocol import (CountTokensRequest, InputMessage, MessagesRequest, TextBlock,
                                                     ToolResultBlock, ToolUseBlock)
from pagemill.entrypoints.openai.cancellation import with_cancellation
from pagemill.entrypoints.openai.errors import OpenAIError
from pagemill.entrypoints.openai.protocol import ChatCompletionRequest
from pagemill.entrypoints.openai.serving_chat import OpenAIServingChat

MESSAGES_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
# HTTP status -> Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


def anthropic_error(message: str, status: int = 400) -> JSONResponse:
    """`{"type": "error", "error": {"type": ..., "message": ...}}` with the status code."""
    body = {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}
    return JSONResponse(body, status_code=status)


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "\n".join(b.text for b in content)


def _chat_messages(system: str | list[TextBlock] | None, turns: list[InputMessage]) -> list[dict[str, Any]]:
    """OpenAI chat messages of an Anthropic conversation: tool_use blocks become the assistant's tool calls,
    tool_result blocks tool messages (before the user's own text of that turn)."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _text(system)})
    for turn in turns:
        if isinstance(turn.content, str):
            out.append({"role": turn.role, "content": turn.content})
            continue
        texts = [b.text for b in turn.content if isinstance(b, TextBlock)]
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                 for b in turn.content if isinstance(b, ToolUseBlock)]
        for b in turn.content:
            if isinstance(b, ToolResultBlock):
                result = _text(b.content)
                out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                            "content": f"Error: {result}" if b.is_error else result})
        if texts or calls:
            message: dict[str, Any] = {"role": turn.role, "content": "\n".join(texts)}
            if calls:
                message["tool_calls"] = calls
            out.append(message)
    return out


def _tool_fields(request: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    """The chat request's tools and tool_choice."""
    fields: dict[str, Any] = {}
    if request.tools:
        fields["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                             "parameters": t.input_schema}} for t in request.tools]
    choice = request.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise OpenAIError("tool_choice.name is required when tool_choice.type is 'tool'.", 400)
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return fields


def _thinking_fields(request: MessagesRequest, reasoning: bool) -> dict[str, Any]:
    """`thinking` as chat fields: enabled -> enable_thinking for the template and, on a server with a reasoning
    parser, budget_tokens as thinking_token_budget; disabled -> enable_thinking False."""
    thinking = request.thinking
    if thinking is None:
        return {}
    if thinking.type == "disabled":
        return {"chat_template_kwargs": {"enable_thinking": False}}
    fields: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": True}}
    if thinking.budget_tokens is not None and reasoning:
        if thinking.budget_tokens >= request.max_tokens:
            raise OpenAIError("thinking.budget_tokens must be less than max_tokens.", 400, "thinking.budget_tokens")
        fields["thinking_token_budget"] = thinking.budget_tokens
    return fields


def chat_request(request: MessagesRequest, reasoning: bool = False) -> ChatCompletionRequest:
    """The chat completion request a Messages request stands for (`reasoning`: the server runs a reasoning parser,
    so a thinking budget applies)."""
    fields: dict[str, Any] = {"model": request.model, "messages": _chat_messages(request.system, request.messages),
                              "max_tokens": request.max_tokens, "stream": request.stream, **_tool_fields(request),
                              **_thinking_fields(request, reasoning)}
    if request.stop_sequences:
        fields["stop"] = request.stop_sequences
    for name in ("temperature", "top_p", "top_k"):
        if getattr(request, name) is not None:
            fields[name] = getattr(request, name)
    if request.stream:  # the prompt's length for message_start, the output's for message_delta
        fields["return_token_ids"] = True
        fields["stream_options"] = {"include_usage": True}
    return _chat_completion_request(fields)


def _chat_completion_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request, or a 400 naming what the conversation lacks (e.g. a turn with nothing in it)."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        first = e.errors()[0]
        raise OpenAIError(f"messages: {first['msg']} ({'.'.join(str(p) for p in first['loc'])})", 400,
                          "messages") from None


def _stop(choice: dict[str, Any], stop_sequences: list[str] | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat choice."""
    matched = choice.get("stop_reason")
    if isinstance(matched, str) and stop_sequences and matched in stop_sequences:
        return "stop_sequence", matched
    return STOP_REASONS.get(choice.get("finish_reason") or "stop", "end_turn"), None


def _tool_use_id(call_id: str | None) -> str:
    return call_id if call_id and call_id.startswith("toolu_") else f"toolu_{uuid.uuid4().hex[:24]}"


def message_body(request: MessagesRequest, chat: dict[str, Any]) -> dict[str, Any]:
    """A Message from a chat completion response."""
    choice = chat["choices"][0]
    content: list[dict[str, Any]] = []
    thought = choice["message"].get("reasoning_content") or choice["message"].get("reasoning")
    if thought:  # --reasoning-parser: the thinking comes first, as Claude's does
        content.append({"type": "thinking", "thinking": thought, "signature": ""})
    if choice["message"].get("content"):
        content.append({"type": "text", "text": choice["message"]["content"]})
    for call in choice["message"].get("tool_calls") or []:
        content.append({"type": "tool_use", "id": _tool_use_id(call.get("id")), "name": call["function"]["name"],
                        "input": json.loads(call["function"]["arguments"] or "{}")})
    reason, sequence = _stop(choice, request.stop_sequences)
    usage = chat.get("usage") or {}
    return {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant", "model": request.model,
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0)}}


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


async def message_events(request: MessagesRequest, chunks: AsyncIterator[Any]) -> AsyncIterator[str]:
    """Anthropic's event stream from the chat stream's SSE chunks."""
    started, block, block_kind, output_tokens = False, -1, None, 0
    reason, sequence = "end_turn", None
    message_id = f"msg_{uuid.uuid4().hex[:24]}"

    def close_block() -> list[str]:
        if block_kind is None:
            return []
        # a thinking block ends with its signature (none here: the thinking is the model's own, unsigned)
        signature = [_event("content_block_delta", {"index": block, "delta": {"type": "signature_delta",
                                                                              "signature": ""}})] \
            if block_kind == "thinking" else []
        return signature + [_event("content_block_stop", {"index": block})]

    def open_block(kind: str, start: dict[str, Any]) -> list[str]:
        nonlocal block, block_kind
        events = close_block()
        block, block_kind = block + 1, kind
        return events + [_event("content_block_start", {"index": block, "content_block": start})]

    async for raw in chunks:
        for line in (raw.decode() if isinstance(raw, bytes) else raw).splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                err = chunk["error"]
                yield _event("error", {"error": {"type": ERROR_TYPES.get(err.get("code", 500), "api_error"),
                                                 "message": err.get("message", "")}})
                return
            if not started:
                started = True
                usage = {"input_tokens": len(chunk.get("prompt_token_ids") or []), "output_tokens": 0}
                yield _event("message_start", {"message": {
                    "id": message_id, "type": "message", "role": "assistant", "model": request.model, "content": [],
                    "stop_reason": None, "stop_sequence": None, "usage": usage}})
            if chunk.get("usage"):
                output_tokens = chunk["usage"].get("completion_tokens", output_tokens)
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                thought = delta.get("reasoning_content") or delta.get("reasoning")
                if thought:
                    if block_kind != "thinking":
                        for e in open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                            yield e
                    yield _event("content_block_delta", {"index": block, "delta": {"type": "thinking_delta",
                                                                                   "thinking": thought}})
                if delta.get("content"):
                    if block_kind != "text":
                        for e in open_block("text", {"type": "text", "text": ""}):
                            yield e
                    yield _event("content_block_delta", {"index": block, "delta": {"type": "text_delta",
                                                                                   "text": delta["content"]}})
                for call in delta.get("tool_calls") or []:
                    fn = call.get("function") or {}
                    if call.get("id") or fn.get("name"):
                        for e in open_block("tool_use", {"type": "tool_use", "id": _tool_use_id(call.get("id")),
                                                         "name": fn.get("name", ""), "input": {}}):
                            yield e
                    if fn.get("arguments"):
                        yield _event("content_block_delta", {"index": block, "delta": {
                            "type": "input_json_delta", "partial_json": fn["arguments"]}})
                if choice.get("finish_reason"):
                    reason, sequence = _stop(choice, request.stop_sequences)
    for e in close_block():
        yield e
    yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                   "usage": {"output_tokens": output_tokens}})
    yield _event("message_stop", {})


class AnthropicServingMessages:
    """POST /v1/messages and /v1/messages/count_tokens over the chat server."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create_message(self, request: MessagesRequest) -> Response:
        """A Message, or its event stream."""
        response = await self.chat.create_chat_completion(
            chat_request(request, reasoning=self.chat.reasoning_parser is not None))
        if isinstance(response, StreamingResponse):
            return StreamingResponse(message_events(request, response.body_iterator), media_type="text/event-stream")
        body = json.loads(response.body)
        if response.status_code != 200:
            return anthropic_error(body.get("error", {}).get("message", "error"), response.status_code)
        return JSONResponse(message_body(request, body))

    async def count_tokens(self, request: CountTokensRequest) -> JSONResponse:
        """`{"input_tokens": n}`: the rendered prompt's length, tools included."""
        fields = {"model": request.model, "messages": _chat_messages(request.system, request.messages),
                  **_tool_fields(request)}
        chat = _chat_completion_request(fields)
        tools = [t.model_dump(exclude_none=True) for t in chat.tools] if chat.tools else None  # as the chat renders them
        ids = await self.chat.prompts.render(OpenAIServingChat._conversation(chat), None, True, False, None, tools)
        return JSONResponse({"input_tokens": len(ids)})


def add_messages_routes(app: FastAPI, chat: OpenAIServingChat) -> AnthropicServingMessages:
    """Register POST /v1/messages and /v1/messages/count_tokens."""
    serving = AnthropicServingMessages(chat)

    @app.post("/v1/messages")
    @with_cancellation
    async def create_message(request: MessagesRequest, raw_request: Request) -> Response:
        """Anthropic Messages API (text, tools, streaming); errors in Anthropic's shape."""
        try:
            return await serving.create_message(request)
        except OpenAIError as e:
            return anthropic_error(e.message, e.status)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: CountTokensRequest) -> Response:
        """The prompt's token count for a Messages request."""
        try:
            return await serving.count_tokens(request)
        except OpenAIError as e:
            return anthropic_error(e.message, e.status)

    return serving
