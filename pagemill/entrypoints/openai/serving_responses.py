"""POST /v1/responses (OpenAI's Responses API as vLLM serves it): the input items (messages, function calls and their
outputs) are rendered with the chat template and the function tools, generated like a chat completion (tool_choice
as there), and answered as a response object (reasoning, message and function_call items) or as its stream of named
events; GET /v1/responses/{id} reads the responses kept in memory."""

from __future__ import annotations

import json
import types
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
from pagemill.entrypoints.openai.protocol import (ChatCompletionToolsParam, ChatLogProbsContent, ErrorResponse,
                                                  FunctionDefinition, NamedFunction, NamedToolChoice,
                                                  SamplingRequest)
from pagemill.entrypoints.openai.protocol_responses import (INCLUDE_LOGPROBS, FunctionCallItem,
                                                            FunctionCallOutputItem, IncompleteDetails,
                                                            InputMessage, InputTokensDetails, OutputItem,
                                                            OutputTokensDetails, ReasoningInputItem,
                                                            ResponseFunctionToolCall, ResponseOutputMessage,
                                                            ResponseOutputText, ResponseReasoningItem,
                                                            ResponseReasoningText, ResponsesRequest,
                                                            ResponsesResponse, ResponseUsage)
from pagemill.entrypoints.openai.reply_split import (ReplyStream, SplitReply, load_reasoning_parser,
                                                     prompt_in_reasoning, split_reply)
from pagemill.entrypoints.openai.responses_store import ResponsesStore
from pagemill.entrypoints.openai.serving_engine import OpenAIServing, json_response
from pagemill.entrypoints.openai.serving_models import OpenAIServingModels
from pagemill.entrypoints.openai.structured_outputs import OutputConstraint, output_constraint
from pagemill.entrypoints.openai.tool_choice import ToolPlan, plan_tools
from pagemill.entrypoints.openai.tool_parsers import ToolParser
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


def reasoning_id(rid: str) -> str:
    """The id of a response's reasoning item: 'rs_' and the response's hex digits."""
    return "rs_" + rid.removeprefix("resp_")


def function_call_ids() -> tuple[str, str]:
    """(item id, call id) of a fresh function_call item: 'fc_...' and 'call_...' as OpenAI's."""
    return f"fc_{uuid.uuid4().hex}", f"call_{uuid.uuid4().hex[:24]}"


def tool_plan(request: ResponsesRequest, auto_parser: str | None) -> ToolPlan:
    """The chat completions' ToolPlan of the request's function tools and tool_choice (400s name tools or
    tool_choice, as there)."""
    tools = [ChatCompletionToolsParam(function=FunctionDefinition(
        name=t.name, description=t.description, parameters=t.parameters, strict=t.strict))
        for t in request.tools or []] or None
    choice = request.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = NamedToolChoice(function=NamedFunction(name=choice.name))
    view = types.SimpleNamespace(tools=tools, tool_choice=choice, parallel_tool_calls=request.parallel_tool_calls)
    return plan_tools(view, auto_parser)  # type: ignore[arg-type]  (it reads only these three fields)


def conversation_items(items: list[Any]) -> list[dict[str, Any]]:
    """Input items as chat-template messages: function_call items become the tool_calls of an assistant message
    (joined to the assistant message just before them), function_call_output items tool messages; reasoning items
    are dropped (thinking is not shown to the model again)."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if isinstance(item, InputMessage):
            out.append(item.to_dict())
        elif isinstance(item, FunctionCallItem):
            try:
                arguments: Any = json.loads(item.arguments)
            except ValueError:
                raise OpenAIError(f"input.{i}.arguments must be JSON text (the function's arguments).", 400,
                                  f"input.{i}.arguments") from None
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        else:
            assert isinstance(item, ReasoningInputItem)
    return out


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
    """400 naming the field for what this server does not serve (background runs, automatic truncation)."""
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
                 store: ResponsesStore | None = None, auto_tool_parser: str | None = None,
                 reasoning_parser: str | None = None) -> None:
        super().__init__(engine, models, prompts)
        self.store = store if store is not None else ResponsesStore()
        self.auto_tool_parser = auto_tool_parser
        self.reasoning_parser = load_reasoning_parser(reasoning_parser, self.tokenizer)

    def _conversation(self, request: ResponsesRequest) -> list[dict[str, Any]]:
        """The previous response's conversation (404 if unknown) and this request's input, without instructions."""
        history: list[dict[str, Any]] = []
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
        return history + conversation_items(request.input)

    @staticmethod
    def _constraint(request: ResponsesRequest, sampling: SamplingRequest, plan: ToolPlan) -> OutputConstraint | None:
        """The one output constraint: text.format, structured_outputs or a forced tool choice (a 400 if several)."""
        fmt = text_format_constraint(request)
        other = output_constraint(sampling, plan.constraint)
        if fmt is not None and other is not None:
            raise OpenAIError(f"Only one output constraint can be given; this request sets text.format and "
                              f"{other.field}.", 400, f"text.format,{other.field}")
        return fmt or other

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
            plan = tool_plan(request, self.auto_tool_parser)
            constraint = self._constraint(request, sampling, plan)
            conversation = self._conversation(request)
            instructions = [{"role": "system", "content": request.instructions}] if request.instructions else []
            prompt_ids = await self.prompts.render(instructions + conversation, None, True, False,
                                                   request.chat_template_kwargs, plan.tools)
            self.check_length(len(prompt_ids), request.max_output_tokens, "input", "max_output_tokens")
            params = self.sampling_params(sampling, request.max_output_tokens, top_n, request.stream, FIELD_ALIASES,
                                          constraint)
            rid = response_id()
            collector = self.add_request(rid, prompt_ids, params, sampling, "input", constraint=constraint,
                                         lora_request=lora_request)
        in_reasoning = prompt_in_reasoning(self.reasoning_parser, self.tokenizer, prompt_ids)
        base = self._response(request, rid, model)
        if request.stream:
            stream = self._stream(request, sampling, base, collector, conversation, constraint, plan.parser,
                                  in_reasoning)
            return StreamingResponse(self.release_when_dropped(stream, [rid]), media_type="text/event-stream")
        with responses_field_names():
            final = await self.final_output(self.engine.iterate(rid, collector), sampling, "input", constraint)
        c = final.outputs[0]
        reply = split_reply(c.text, self.reasoning_parser, in_reasoning, plan.parser)
        lps = self._logprobs(request, c)
        items = self._items(base.id, reply, lps, c.finish_reason == "length")
        done = self._finish(base, items, c.finish_reason, len(final.prompt_token_ids), len(c.token_ids),
                            final.num_cached_tokens, self._reasoning_tokens(reply.reasoning))
        self._keep(request, done, conversation)
        return json_response(done)

    def _reasoning_tokens(self, reasoning: str | None) -> int:
        """How many tokens the thinking text takes (for usage.output_tokens_details)."""
        return len(self.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0

    @staticmethod
    def _items(rid: str, reply: SplitReply, lps: list[ChatLogProbsContent], incomplete: bool) -> list[OutputItem]:
        """The output items of a finished reply: reasoning, the message (unless the reply is only calls), calls."""
        status = "incomplete" if incomplete else "completed"
        items: list[OutputItem] = []
        if reply.reasoning:
            items.append(ResponseReasoningItem(id=reasoning_id(rid), status=status,
                                               content=[ResponseReasoningText(text=reply.reasoning)]))
        if reply.content or not reply.tool_calls:
            items.append(ResponseOutputMessage(id=message_id(rid), status=status,
                                               content=[ResponseOutputText(text=reply.content, logprobs=lps)]))
        for call in reply.tool_calls:
            item_id, call_id = function_call_ids()
            items.append(ResponseFunctionToolCall(id=item_id, call_id=call_id, name=call.name,
                                                  arguments=call.arguments, status=status))
        return items

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
            tools=request.tools or [],
            parallel_tool_calls=True if request.parallel_tool_calls is None else request.parallel_tool_calls,
            **({"text": text} if text else {}))

    @staticmethod
    def _logprobs(request: ResponsesRequest, c: CompletionOutput) -> list[ChatLogProbsContent]:
        """The logprobs of the tokens of an output (or of its latest delta); empty unless asked for."""
        if not request.wants_logprobs() or c.logprobs is None:
            return []
        return chat_logprobs(c.token_ids, c.logprobs, request.top_logprobs or 0).content or []

    @staticmethod
    def _finish(base: ResponsesResponse, items: list[OutputItem], finish_reason: str | None, num_in: int,
                num_out: int, num_cached: int, num_reasoning: int = 0) -> ResponsesResponse:
        """The finished response: completed, or incomplete when the output hit the token limit."""
        incomplete = finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        usage = ResponseUsage(input_tokens=num_in, output_tokens=num_out, total_tokens=num_in + num_out,
                              input_tokens_details=InputTokensDetails(cached_tokens=max(num_cached, 0)),
                              output_tokens_details=OutputTokensDetails(reasoning_tokens=min(num_reasoning, num_out)))
        return base.model_copy(update=dict(
            status=status, output=items, usage=usage,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if incomplete else None))

    def _keep(self, request: ResponsesRequest, response: ResponsesResponse,
              conversation: list[dict[str, Any]]) -> None:
        """Store a finished response (`store: true`) with its conversation, the reply (its text and function calls,
        not its thinking) appended."""
        if not request.store:
            return
        reply: dict[str, Any] = {"role": "assistant", "content": response.output_text}
        calls = [{"id": item.call_id, "type": "function",
                  "function": {"name": item.name, "arguments": _arguments(item.arguments)}}
                 for item in response.output if isinstance(item, ResponseFunctionToolCall)]
        if calls:
            reply["tool_calls"] = calls
        self.store.put(response, conversation + [reply])

    async def _stream(self, request: ResponsesRequest, sampling: SamplingRequest, base: ResponsesResponse,
                      collector: RequestOutputCollector, conversation: list[dict[str, Any]],
                      constraint: OutputConstraint | None, parser: ToolParser | None,
                      in_reasoning: bool | None) -> AsyncIterator[str]:
        """The events of a streamed response: lifecycle; per output item, output_item.added, its deltas
        (reasoning_text, output_text, function_call_arguments) and done events; then response.completed
        (response.incomplete when cut off); an `error` event if generation fails."""
        event = EventWriter()
        yield event("response.created", response=base)
        yield event("response.in_progress", response=base)
        items = StreamedItems(base.id, event)
        splitting = parser is not None or self.reasoning_parser is not None
        reply = ReplyStream(self.reasoning_parser, in_reasoning, parser) if splitting else None
        if not splitting:  # plain text: the message opens at once
            for e in items.open_message():
                yield e
        lps: list[ChatLogProbsContent] = []
        num_out = 0
        last: RequestOutput | None = None
        finish_reason: str | None = None
        try:
            async for out in self.engine.iterate(base.id, collector):
                last, c = out, out.outputs[0]
                num_out += len(c.token_ids)
                finish_reason = c.finish_reason or finish_reason
                if not c.text and not c.token_ids and c.finish_reason is None:
                    continue
                delta_lps = self._logprobs(request, c)
                lps += delta_lps
                if reply is None:
                    if c.text or delta_lps:
                        for e in items.text(c.text, delta_lps):
                            yield e
                    continue
                thought, content, calls = reply.update(c.text, final=c.finish_reason is not None)
                for e in items.reasoning(thought):
                    yield e
                for e in items.text(content, []):
                    yield e
                for call in calls:
                    for e in items.call(call.index, call.name, call.arguments):
                        yield e
        except EngineDeadError as e:
            yield event("error", code=str(getattr(e, "status", 500)), message=str(e), param=None)
            return
        except ValueError as e:
            err = self.request_error(e, sampling, "input", constraint)
            yield event("error", code=str(err.status), message=err.message, param=_rename(err.param))
            return
        assert last is not None
        status = "incomplete" if finish_reason == "length" else "completed"
        for e in items.close_all(status, lps if reply is None else []):
            yield e
        num_reasoning = self._reasoning_tokens(reply.reasoning.reasoning) \
            if reply is not None and reply.reasoning is not None else 0
        done = self._finish(base, items.done_items, finish_reason, len(last.prompt_token_ids), num_out,
                            last.num_cached_tokens, num_reasoning)
        self._keep(request, done, conversation)
        yield event("response.incomplete" if done.status == "incomplete" else "response.completed", response=done)

    def retrieve(self, rid: str) -> Response:
        """GET /v1/responses/{id}: a stored response, or a 404."""
        stored = self.store.get(rid)
        if stored is None:
            raise OpenAIError(f"Response with id '{rid}' not found.", 404, "response_id")
        return json_response(stored.response)


def _arguments(text: str) -> Any:
    """Function-call arguments as a JSON value for the chat template (the text itself if it is not JSON)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


class StreamedItems:
    """The output items of a streamed response, opened as their first piece arrives (reasoning, then the message,
    then function calls, each at the next output_index), and their events."""

    def __init__(self, rid: str, event: EventWriter) -> None:
        self.rid = rid
        self.event = event
        self.done_items: list[OutputItem] = []
        self.open: str | None = None  # "reasoning" | "message" | None (calls stay open until the end)
        self.index = -1  # output_index of the newest item
        self.reasoning_text = ""
        self.message_text = ""
        self.message_index = -1
        self.calls: dict[int, list[Any]] = {}  # call index -> [output_index, item id, call id, name, arguments]

    def _close_open(self, status: str, lps: list[ChatLogProbsContent] | None = None) -> Iterator[str]:
        ev = self.event
        if self.open == "reasoning":
            at = dict(item_id=reasoning_id(self.rid), output_index=self.index, content_index=0)
            part = ResponseReasoningText(text=self.reasoning_text)
            yield ev("response.reasoning_text.done", **at, text=self.reasoning_text)
            yield ev("response.content_part.done", **at, part=part)
            item = ResponseReasoningItem(id=reasoning_id(self.rid), status=status, content=[part])
            self.done_items.append(item)
            yield ev("response.output_item.done", output_index=self.index, item=item)
        elif self.open == "message":
            at = dict(item_id=message_id(self.rid), output_index=self.message_index, content_index=0)
            lps = lps or []
            part = ResponseOutputText(text=self.message_text, logprobs=lps)
            yield ev("response.output_text.done", **at, text=self.message_text,
                     logprobs=[lp.model_dump(mode="json") for lp in lps])
            yield ev("response.content_part.done", **at, part=part)
            item = ResponseOutputMessage(id=message_id(self.rid), status=status, content=[part])
            self.done_items.append(item)
            yield ev("response.output_item.done", output_index=self.message_index, item=item)
        self.open = None

    def reasoning(self, delta: str) -> Iterator[str]:
        """A piece of the thinking (opens the reasoning item first)."""
        if not delta:
            return
        ev = self.event
        at = dict(item_id=reasoning_id(self.rid), content_index=0)
        if self.open != "reasoning":
            self.index += 1
            self.open = "reasoning"
            yield ev("response.output_item.added", output_index=self.index,
                     item=ResponseReasoningItem(id=reasoning_id(self.rid), status="in_progress"))
            yield ev("response.content_part.added", **at, output_index=self.index,
                     part=ResponseReasoningText(text=""))
        self.reasoning_text += delta
        yield ev("response.reasoning_text.delta", **at, output_index=self.index, delta=delta)

    def open_message(self) -> Iterator[str]:
        """Open the output message (closing the reasoning item)."""
        yield from self._close_open("completed")
        self.index += 1
        self.message_index = self.index
        self.open = "message"
        at = dict(item_id=message_id(self.rid), output_index=self.index, content_index=0)
        yield self.event("response.output_item.added", output_index=self.index,
                         item=ResponseOutputMessage(id=message_id(self.rid), status="in_progress"))
        yield self.event("response.content_part.added", **at, part=ResponseOutputText(text=""))

    def text(self, delta: str, lps: list[ChatLogProbsContent]) -> Iterator[str]:
        """A piece of the answer text (opens the message first)."""
        if not delta and not lps:
            return
        if self.open != "message":
            if self.message_index >= 0:  # text after a call: vLLM drops it too (the parsers keep none)
                return
            yield from self.open_message()
        self.message_text += delta
        yield self.event("response.output_text.delta", item_id=message_id(self.rid), output_index=self.message_index,
                         content_index=0, delta=delta, logprobs=[lp.model_dump(mode="json") for lp in lps])

    def call(self, index: int, name: str | None, arguments: str) -> Iterator[str]:
        """A piece of function call `index`: its first piece (with the name) opens its item."""
        ev = self.event
        if index not in self.calls:
            yield from self._close_open("completed")
            self.index += 1
            item_id, call_id = function_call_ids()
            self.calls[index] = [self.index, item_id, call_id, name or "", ""]
            yield ev("response.output_item.added", output_index=self.index, item=ResponseFunctionToolCall(
                id=item_id, call_id=call_id, name=name or "", arguments="", status="in_progress"))
        entry = self.calls[index]
        if arguments:
            entry[4] += arguments
            yield ev("response.function_call_arguments.delta", item_id=entry[1], output_index=entry[0],
                     delta=arguments)

    def close_all(self, status: str, lps: list[ChatLogProbsContent]) -> Iterator[str]:
        """Close every open item (an empty message if nothing was output at all)."""
        if self.open is None and self.message_index < 0 and not self.calls:
            yield from self.open_message()
        yield from self._close_open(status, lps)
        for output_index, item_id, call_id, name, arguments in self.calls.values():
            yield self.event("response.function_call_arguments.done", item_id=item_id, output_index=output_index,
                             name=name, arguments=arguments)
            item = ResponseFunctionToolCall(id=item_id, call_id=call_id, name=name, arguments=arguments,
                                            status=status)
            self.done_items.append(item)
            yield self.event("response.output_item.done", output_index=output_index, item=item)


def add_responses_routes(app: FastAPI, engine: AsyncLLM, models: OpenAIServingModels, prompts: PromptPreparer,
                         store: ResponsesStore | None = None, auto_tool_parser: str | None = None,
                         reasoning_parser: str | None = None) -> OpenAIServingResponses:
    """Register POST /v1/responses and GET /v1/responses/{response_id} on the app."""
    from pagemill.entrypoints.openai.serving_pooling import check_generate_model

    serving = OpenAIServingResponses(engine, models, prompts, store, auto_tool_parser, reasoning_parser)
    generates = engine.model_config.pooler_config is None

    @app.post("/v1/responses", include_in_schema=generates)
    @with_cancellation
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        """OpenAI Responses API (text and function tools)."""
        check_generate_model(engine, "/v1/responses")
        return await serving.create_response(request)

    not_found = {404: {"model": ErrorResponse, "description": "No stored response has this id."}}

    @app.get("/v1/responses/{response_id}", include_in_schema=generates, responses=not_found)
    async def retrieve_response(response_id: str) -> Response:
        """A response kept with `store: true` (in memory, the least recently used dropped first)."""
        return serving.retrieve(response_id)

    return serving
