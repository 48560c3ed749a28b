"""POST /v1/responses (OpenAI's Responses API, the text-only subset vLLM serves without tools): the input items are
rendered with the chat template, generated like a chat completion, and answered as a response object or as its
stream of named events; GET /v1/responses/{id} reads the responses kept in memory."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from pagemill.engine.async_llm import AsyncLLM, RequestOutputCollector
from pagemill.engine.core_client import EngineDeadError
from pagemill.entrypoints.chat_utils import ChatTemplateError
from pagemill.entrypoints.openai.cancellation import with_cancellation
from pagemill.entrypoints.openai.errors import OpenAIError
from pagemill.entrypoints.openai.logprobs import chat_logprobs
from pagemill.entrypoints.openai.prompt_preparer import PromptPreparer
from pagemill.entrypoints.openai.protocol import ChatLogProbsContent, ErrorResponse, SamplingRequest
from pagemill.entrypoints.openai.protocol_responses import (INCLUDE_LOGPROBS, IncompleteDetails,
                                                            InputTokensDetails, ResponseOutputMessage,
                                                            ResponseOutputText, ResponsesRequest, ResponsesResponse,
                                                            ResponseUsage)
from pagemill.entrypoints.openai.responses_store import ResponsesStore
from pagemill.entrypoints.openai.serving_engine import OpenAIServing, json_response
from pagemill.entrypoints.openai.serving_models import OpenAIServingModels
from pagemill.entrypoints.openai.structured_outputs import OutputConstraint
from pagemill.outputs import CompletionOutput, RequestOutput
from pagemill.sampling_params import StructuredOutputsParams

# Names the shared chat / sampling code gives to errors -> the Responses API field they come from.
FIELD_ALIASES = {"max_tokens": "max_output_tokens", "logprobs": "top_logprobs", "messages": "input",
                 "response_format": "text.format"}


def response_id() -> str:
    """A fresh response id, 'resp_' and 32 hex digits as OpenAI's."""
    return f"resp_{uuid.uuid4().hex}"


def message_id(rid: str) -> str:
    """The id of a response's output message: 'msg_' and the response's hex digits."""
    return "msg_" + rid.removeprefix("resp_")


def _rename(param: str | None) -> str | None:
    if param is None:
        return None
    head, dot, rest = param.partition(".")
    return FIELD_ALIASES.get(head, head) + dot + rest


@contextmanager
def responses_field_names() -> Iterator[None]:
    """Errors raised by the shared chat code name the Responses API's fields (input, max_output_tokens, ...)."""
    try:
        yield
    except ChatTemplateError as e:
        raise OpenAIError(e.message, 400, _rename(e.param)) from e
    except OpenAIError as e:
        e.param = _rename(e.param)
        raise


def check_supported(request: ResponsesRequest) -> None:
    """400 naming the field for what this subset does not serve (tools, background runs, automatic truncation)."""
    if request.tools:
        raise OpenAIError("tools are not supported by /v1/responses on this server (use /v1/chat/completions).",
                          400, "tools")
    if request.tool_choice not in (None, "none", "auto"):
        raise OpenAIError("tool_choice needs tools, which /v1/responses on this server does not support.", 400,
                          "tool_choice")
    if request.background:
        raise OpenAIError("background responses are not supported by this server.", 400, "background")
    if request.truncation == "auto":
        raise OpenAIError("truncation 'auto' is not supported by this server; only 'disabled'.", 400, "truncation")
    unknown = [x for x in request.include or [] if x != INCLUDE_LOGPROBS]
    if unknown:
        raise OpenAIError(f"include: only {INCLUDE_LOGPROBS!r} is supported, got {', '.join(map(repr, unknown))}.",
                          400, "include")


def text_format_constraint(request: ResponsesRequest) -> OutputConstraint | None:
    """The output constraint of `text.format` (json_object or json_schema), or None for plain text."""
    fmt = request.text.format if request.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        kwargs: dict[str, Any] = {"json_object": True}
    elif fmt.json_schema is None:
        raise OpenAIError("text.format of type json_schema needs a schema.", 400, "text.format.schema")
    else:
        kwargs = {"json": fmt.json_schema}
    try:
        return OutputConstraint(StructuredOutputsParams(**kwargs), "text.format")
    except ValueError as e:
        raise OpenAIError(f"text.format: {e}", 400, "text.format") from e


class EventWriter:
    """Named server-sent events (`event: <type>` and `data: {"type", "sequence_number", ...}`), numbered from 0."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, event_type: str, **fields: Any) -> str:
        payload = {"type": event_type, "sequence_number": self.sequence_number}
        payload.update({k: v.model_dump(mode="json") if hasattr(v, "model_dump") else v for k, v in fields.items()})
        self.sequence_number += 1
        return f"event: {event_type}\ndata: {json.dumps(payload)}\n\n"


class OpenAIServingResponses(OpenAIServing):
    """Handles /v1/responses: create (streamed or not) and retrieve."""

    def __init__(self, engine: AsyncLLM, models: OpenAIServingModels, prompts: PromptPreparer,
                 store: ResponsesStore | None = None) -> None:
        super().__init__(engine, models, prompts)
        self.store = store if store is not None else ResponsesStore()

    def _conversation(self, request: ResponsesRequest) -> list[dict[str, str]]:
        """The previous response's conversation (404 if unknown) and this request's input, without instructions."""
        history: list[dict[str, str]] = []
        if request.previous_response_id is not None:
            stored = self.store.get(request.previous_response_id)
            if stored is None:
                raise OpenAIError(f"Response with id '{request.previous_response_id}' not found (it was not stored, "
                                  "or the server dropped it to keep its limit).", 404, "previous_response_id")
            history = list(stored.conversation)
        if isinstance(request.input, str):
            return history + [{"role": "user", "content": request.input}]
        if not request.input and not history:
            raise OpenAIError("input must not be empty.", 400, "input")
        return history + [m.to_dict() for m in request.input]

    async def create_response(self, request: ResponsesRequest) -> Response:
        """Validate, start the request, and answer (streamed or not)."""
        model = self.models.resolve(request.model)
        lora_request = self.models.lora_request(model)
        check_supported(request)
        with responses_field_names():
            sampling = request.sampling_request()
            self.check_unsupported(sampling)
            top_n = (request.top_logprobs or 0) if request.wants_logprobs() else None
            self.check_limits(sampling, top_n, "top_logprobs")
            constraint = text_format_constraint(request)
            conversation = self._conversation(request)
            instructions = [{"role": "system", "content": request.instructions}] if request.instructions else []
            prompt_ids = await self.prompts.render(instructions + conversation)
            self.check_length(len(prompt_ids), request.max_output_tokens, "input", "max_output_tokens")
            params = self.sampling_params(sampling, request.max_output_tokens, top_n, request.stream, FIELD_ALIASES,
                                          constraint)
            rid = response_id()
            collector = self.add_request(rid, prompt_ids, params, sampling, "input", constraint=constraint,
                                         lora_request=lora_request)
        base = self._response(request, rid, model)
        if request.stream:
            stream = self._stream(request, sampling, base, collector, conversation, constraint)
            return StreamingResponse(self.release_when_dropped(stream, [rid]), media_type="text/event-stream")
        with responses_field_names():
            final = await self.final_output(self.engine.iterate(rid, collector), sampling, "input", constraint)
        c = final.outputs[0]
        done = self._finish(base, c.text, self._logprobs(request, c), c.finish_reason, len(final.prompt_token_ids),
                            len(c.token_ids), final.num_cached_tokens)
        self._keep(request, done, conversation)
        return json_response(done)

    @staticmethod
    def _response(request: ResponsesRequest, rid: str, model: str) -> ResponsesResponse:
        """The response object as it starts: in progress, no output yet, the request's settings echoed."""
        text = request.text.model_dump(mode="json", by_alias=True, exclude_none=True) if request.text else None
        return ResponsesResponse(
            id=rid, status="in_progress", instructions=request.instructions,
            max_output_tokens=request.max_output_tokens, metadata=request.metadata, model=model,
            previous_response_id=request.previous_response_id,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p, top_logprobs=request.top_logprobs,
            user=request.user, store=request.store, tool_choice=request.tool_choice or "auto",
            parallel_tool_calls=True if request.parallel_tool_calls is None else request.parallel_tool_calls,
            **({"text": text} if text else {}))

    @staticmethod
    def _logprobs(request: ResponsesRequest, c: CompletionOutput) -> list[ChatLogProbsContent]:
        """The logprobs of the tokens of an output (or of its latest delta); empty unless asked for."""
        if not request.wants_logprobs() or c.logprobs is None:
            return []
        return chat_logprobs(c.token_ids, c.logprobs, request.top_logprobs or 0).content or []

    @staticmethod
    def _finish(base: ResponsesResponse, text: str, lps: list[ChatLogProbsContent], finish_reason: str | None,
                num_in: int, num_out: int, num_cached: int) -> ResponsesResponse:
        """The finished response: completed, or incomplete when the output hit the token limit."""
        incomplete = finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        message = ResponseOutputMessage(id=message_id(base.id), status=status,
                                        content=[ResponseOutputText(text=text, logprobs=lps)])
        usage = ResponseUsage(input_tokens=num_in, output_tokens=num_out, total_tokens=num_in + num_out,
                              input_tokens_details=InputTokensDetails(cached_tokens=max(num_cached, 0)))
        return base.model_copy(update=dict(
            status=status, output=[message], usage=usage,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if incomplete else None))

    def _keep(self, request: ResponsesRequest, response: ResponsesResponse,
              conversation: list[dict[str, str]]) -> None:
        """Store a finished response (`store: true`) with its conversation, the reply appended."""
        if request.store:
            reply = {"role": "assistant", "content": response.output_text}
            self.store.put(response, conversation + [reply])

    async def _stream(self, request: ResponsesRequest, sampling: SamplingRequest, base: ResponsesResponse,
                      collector: RequestOutputCollector, conversation: list[dict[str, str]],
                      constraint: OutputConstraint | None) -> AsyncIterator[str]:
        """The events of a streamed response: lifecycle, one output_text.delta per text delta, then the done
        events and response.completed (response.incomplete when cut off); an `error` event if generation fails."""
        event = EventWriter()
        item_id = message_id(base.id)
        at = dict(item_id=item_id, output_index=0, content_index=0)
        yield event("response.created", response=base)
        yield event("response.in_progress", response=base)
        yield event("response.output_item.added", output_index=0,
                    item=ResponseOutputMessage(id=item_id, status="in_progress"))
        yield event("response.content_part.added", **at, part=ResponseOutputText(text=""))
        pieces: list[str] = []
        lps: list[ChatLogProbsContent] = []
        num_out = 0
        last: RequestOutput | None = None
        finish_reason: str | None = None
        try:
            async for out in self.engine.iterate(base.id, collector):
                last, c = out, out.outputs[0]
                num_out += len(c.token_ids)
                finish_reason = c.finish_reason or finish_reason
                if not c.text and not c.token_ids:
                    continue
                delta_lps = self._logprobs(request, c)
                pieces.append(c.text)
                lps += delta_lps
                if c.text or delta_lps:
                    yield event("response.output_text.delta", **at, delta=c.text,
                                logprobs=[lp.model_dump(mode="json") for lp in delta_lps])
        except EngineDeadError as e:
            yield event("error", code=str(getattr(e, "status", 500)), message=str(e), param=None)
            return
        except ValueError as e:
            err = self.request_error(e, sampling, "input", constraint)
            yield event("error", code=str(err.status), message=err.message, param=_rename(err.param))
            return
        assert last is not None
        text = "".join(pieces)
        part = ResponseOutputText(text=text, logprobs=lps)
        yield event("response.output_text.done", **at, text=text, logprobs=[lp.model_dump(mode="json") for lp in lps])
        yield event("response.content_part.done", **at, part=part)
        done = self._finish(base, text, lps, finish_reason, len(last.prompt_token_ids), num_out,
                            last.num_cached_tokens)
        yield event("response.output_item.done", output_index=0, item=done.output[0])
        self._keep(request, done, conversation)
        yield event("response.incomplete" if done.status == "incomplete" else "response.completed", response=done)

    def retrieve(self, rid: str) -> Response:
        """GET /v1/responses/{id}: a stored response, or a 404."""
        stored = self.store.get(rid)
        if stored is None:
            raise OpenAIError(f"Response with id '{rid}' not found.", 404, "response_id")
        return json_response(stored.response)


def add_responses_routes(app: FastAPI, engine: AsyncLLM, models: OpenAIServingModels, prompts: PromptPreparer,
                         store: ResponsesStore | None = None) -> OpenAIServingResponses:
    """Register POST /v1/responses and GET /v1/responses/{response_id} on the app."""
    from pagemill.entrypoints.openai.serving_pooling import check_generate_model

    serving = OpenAIServingResponses(engine, models, prompts, store)
    generates = engine.model_config.pooler_config is None

    @app.post("/v1/responses", include_in_schema=generates)
    @with_cancellation
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        """OpenAI Responses API (text in and out, no tools)."""
        check_generate_model(engine, "/v1/responses")
        return await serving.create_response(request)

    not_found = {404: {"model": ErrorResponse, "description": "No stored response has this id."}}

    @app.get("/v1/responses/{response_id}", include_in_schema=generates, responses=not_found)
    async def retrieve_response(response_id: str) -> Response:
        """A response kept with `store: true` (in memory, the least recently used dropped first)."""
        return serving.retrieve(response_id)

    return serving
