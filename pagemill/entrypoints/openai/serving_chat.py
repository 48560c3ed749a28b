"""POST /v1/chat/completions: render the chat template (with tools), generate under the request's output
constraint, and answer as JSON or as SSE chunks, with tool calls parsed out of the reply."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import Response, StreamingResponse

from pagemill.engine.async_llm import AsyncLLM
from pagemill.engine.core_client import EngineDeadError
from pagemill.entrypoints.openai.errors import OpenAIError
from pagemill.entrypoints.openai.logprobs import chat_logprobs, prompt_logprobs_json
from pagemill.entrypoints.openai.prompt_preparer import PromptPreparer
from pagemill.entrypoints.openai.reply_split import (ReplyStream, load_reasoning_parser, prompt_in_reasoning,
                                                     split_reply)
from pagemill.entrypoints.openai.protocol import (AssistantMessage, ChatCompletionRequest, ChatCompletionResponse,
                                                  ChatCompletionResponseChoice, ChatCompletionStreamChoice,
                                                  ChatCompletionStreamResponse, DeltaFunctionCall, DeltaMessage,
                                                  DeltaToolCall, FunctionCall, ToolCall, UsageInfo, usage_info)
from pagemill.entrypoints.openai.serving_engine import (SSE_DONE, OpenAIServing, json_response, random_id, sse,
                                                       sse_error)
from pagemill.entrypoints.openai.serving_models import OpenAIServingModels
from pagemill.entrypoints.openai.structured_outputs import OutputConstraint, output_constraint
from pagemill.entrypoints.openai.tool_choice import plan_tools
from pagemill.entrypoints.openai.tool_parsers import ToolParser, get_tool_parser
from pagemill.entrypoints.openai.tool_streaming import ToolCallDelta, tool_call_id
from pagemill.outputs import CompletionOutput, RequestOutput
from pagemill.reasoning import ReasoningParser

logger = logging.getLogger(__name__)


def finish_reason(reason: str | None, has_tool_calls: bool) -> str | None:
    """'tool_calls' for a reply that stopped on its own after calling tools (a cut-off reply keeps 'length')."""
    return "tool_calls" if has_tool_calls and reason == "stop" else reason


def delta_tool_call(d: ToolCallDelta) -> DeltaToolCall:
    """The wire form of a streamed call piece: id, type and name only in a call's first piece."""
    if d.id is None:
        return DeltaToolCall(index=d.index, function=DeltaFunctionCall(arguments=d.arguments))
    return DeltaToolCall(index=d.index, id=d.id, type="function",
                         function=DeltaFunctionCall(name=d.name, arguments=d.arguments))


class OpenAIServingChat(OpenAIServing):
    """Handles chat completions."""

    def __init__(self, engine: AsyncLLM, models: OpenAIServingModels, prompts: PromptPreparer,
                 auto_tool_parser: str | None = None, reasoning_parser: str | None = None) -> None:
        """`auto_tool_parser`: the --tool-call-parser of tool_choice="auto" (None: auto tool choice is off);
        `reasoning_parser`: the --reasoning-parser that splits the thinking from the answer (None: none)."""
        super().__init__(engine, models, prompts)
        self.reasoning_parser = load_reasoning_parser(reasoning_parser, self.tokenizer)
        self.renderer = prompts.renderer
        if auto_tool_parser is not None:
            get_tool_parser(auto_tool_parser)  # fail at start-up, not per request
        self.auto_tool_parser = auto_tool_parser
        self._warned_no_tools_branch = False

    def _warn_if_template_ignores_tools(self, request: ChatCompletionRequest) -> None:
        template = request.chat_template or self.renderer.default_template or ""
        if "tools" not in template and not self._warned_no_tools_branch:
            self._warned_no_tools_branch = True
            logger.warning("The chat template has no tools branch, so the model is not shown the request's tools; "
                           "start the server with --chat-template chatml_tools (or a template of your own).")

    @staticmethod
    def _conversation(request: ChatCompletionRequest) -> list[dict[str, Any]]:
        """The messages as the template takes them; 400 for tool fields on the wrong role."""
        for i, m in enumerate(request.messages):
            if m.role == "tool" and not m.tool_call_id:
                raise OpenAIError("A tool message needs the tool_call_id of the call it answers.", 400,
                                  f"messages.{i}.tool_call_id")
            if m.tool_calls and m.role != "assistant":
                raise OpenAIError("Only assistant messages carry tool_calls.", 400, f"messages.{i}.tool_calls")
        return [m.to_dict() for m in request.messages]

    async def create_chat_completion(self, request: ChatCompletionRequest) -> Response:
        """Validate, start the request, and answer (streamed or not)."""
        model = self.models.resolve(request.model)
        lora_request = self.models.lora_request(model)
        self.check_unsupported(request)
        if request.use_beam_search and request.logprobs:
            raise OpenAIError("logprobs cannot be combined with use_beam_search.", 400, "logprobs")
        self.check_limits(request, request.top_logprobs if request.logprobs else None, "top_logprobs")
        self.prompts.check_request_template(request.chat_template)
        plan = plan_tools(request, self.auto_tool_parser)
        constraint = output_constraint(request, plan.constraint)
        if plan.tools:
            self._warn_if_template_ignores_tools(request)
        mm_features = None
        if any(m.has_images() for m in request.messages):
            if request.use_beam_search:
                raise OpenAIError("use_beam_search does not take images.", 400, "use_beam_search")
            prompt_ids, mm_features = await self.prompts.render_multimodal(
                self._conversation(request), self.engine.processor.mm_processor, request.chat_template,
                request.add_generation_prompt, request.continue_final_message, request.chat_template_kwargs,
                plan.tools)
        else:
            prompt_ids = await self.prompts.render(self._conversation(request), request.chat_template,
                                                   request.add_generation_prompt, request.continue_final_message,
                                                   request.chat_template_kwargs, plan.tools)
        prompt_ids = self.truncate_prompt(prompt_ids, request)
        max_tokens = request.max_completion_tokens or request.max_tokens
        self.check_length(len(prompt_ids), max_tokens, "messages",
                          "max_completion_tokens" if request.max_completion_tokens else "max_tokens")
        top_n = (request.top_logprobs or 0) if request.logprobs else None
        if request.top_logprobs and not request.logprobs:
            raise OpenAIError("top_logprobs needs logprobs to be true.", 400, "top_logprobs")
        params = self.sampling_params(request, max_tokens, top_n, request.stream, {"logprobs": "top_logprobs"},
                                      constraint)
        request_id = random_id("chatcmpl")
        outputs: AsyncIterator[RequestOutput]
        if request.use_beam_search:
            outputs = self.beam_search(request_id, prompt_ids, request, max_tokens, lora_request)
        else:
            collector = self.add_request(request_id, prompt_ids, params, request, "messages", constraint=constraint,
                                         lora_request=lora_request, mm_features=mm_features)
            outputs = self.engine.iterate(request_id, collector)
        created = int(time.time())
        in_reasoning = prompt_in_reasoning(self.reasoning_parser, self.tokenizer, prompt_ids)
        if request.stream:
            stream = self.release_when_dropped(
                self._stream(request, request_id, outputs, model, created, prompt_ids, plan.parser,
                             constraint, in_reasoning), [request_id])
            return StreamingResponse(stream, media_type="text/event-stream")
        final = await self.final_output(outputs, request, "messages", constraint)
        return json_response(self._response(request, final, request_id, model, created, plan.parser, in_reasoning))

    def _message(self, c: CompletionOutput, parser: ToolParser | None, include_reasoning: bool = True,
                 in_reasoning: bool | None = None) -> tuple[AssistantMessage, str | None]:
        """The reply message (the reasoning split off, tool calls parsed out of the answer) and its finish
        reason."""
        if parser is None and self.reasoning_parser is None:
            return AssistantMessage(content=c.text), c.finish_reason
        reply = split_reply(c.text, self.reasoning_parser, in_reasoning, parser)
        thought = reply.reasoning if include_reasoning else None
        content: str | None = reply.content
        if self.reasoning_parser is not None:
            content = content or None  # (vLLM: no answer after the thinking is null)
        if not reply.tool_calls:
            return AssistantMessage(content=content, reasoning=thought or None,
                                    reasoning_content=thought or None), c.finish_reason
        calls = [ToolCall(id=tool_call_id(), function=FunctionCall(name=t.name, arguments=t.arguments))
                 for t in reply.tool_calls]
        return (AssistantMessage(content=content or None, tool_calls=calls, reasoning=thought or None,
                                 reasoning_content=thought or None), finish_reason(c.finish_reason, True))

    def _response(self, request: ChatCompletionRequest, final: RequestOutput, request_id: str, model: str,
                  created: int, parser: ToolParser | None, in_reasoning: bool | None = None) -> ChatCompletionResponse:
        choices = []
        for c in final.outputs:
            lps = chat_logprobs(c.token_ids, c.logprobs, request.top_logprobs or 0, request.return_tokens_as_token_ids,
                                frozenset(request.logprob_token_ids or ())) \
                if request.logprobs and c.logprobs is not None else None
            message, reason = self._message(c, parser, request.include_reasoning, in_reasoning)
            choice = ChatCompletionResponseChoice(index=c.index, message=message, logprobs=lps, finish_reason=reason,
                                                  stop_reason=c.stop_reason)
            if request.return_token_ids:
                choice.token_ids = list(c.token_ids)
            choices.append(choice)
        num_prompt = len(final.prompt_token_ids)
        num_gen = sum(len(c.token_ids) for c in final.outputs)
        response = ChatCompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                          usage=usage_info(num_prompt, num_gen, final.num_cached_tokens))
        if request.prompt_logprobs is not None:
            response.prompt_logprobs = prompt_logprobs_json(final.prompt_logprobs)
        if request.return_token_ids:
            response.prompt_token_ids = list(final.prompt_token_ids)
        return response

    async def _stream(self, request: ChatCompletionRequest, request_id: str, outputs: AsyncIterator[RequestOutput],
                      model: str, created: int, prompt_ids: list[int], parser: ToolParser | None,
                      constraint: OutputConstraint | None, in_reasoning: bool | None = None) -> AsyncIterator[str]:
        """SSE chunks: a role chunk per choice, reasoning, content and tool-call deltas, optional usage, then
        [DONE]."""
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        continuous = include_usage and request.stream_options.continuous_usage_stats  # type: ignore[union-attr]
        num_prompt = len(prompt_ids)
        num_gen = num_cached = 0
        reasoning: ReasoningParser | None = self.reasoning_parser
        streamers = [ReplyStream(reasoning, in_reasoning, parser) for _ in range(request.n)] \
            if parser is not None or reasoning is not None else []

        def chunk(choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> str:
            resp = ChatCompletionStreamResponse(id=request_id, object="chat.completion.chunk", created=created,
                                                model=model, choices=choices)
            if usage is not None or include_usage:
                resp.usage = usage
            return sse(resp.model_dump_json(exclude_unset=True))

        def usage() -> UsageInfo:
            return usage_info(num_prompt, num_gen, num_cached)

        try:
            for i in range(request.n):
                first = ChatCompletionStreamResponse(
                    id=request_id, object="chat.completion.chunk", created=created, model=model,
                    choices=[ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""),
                                                        logprobs=None, finish_reason=None)])
                if request.return_token_ids:
                    first.prompt_token_ids = list(prompt_ids)
                if include_usage:
                    first.usage = None
                yield sse(first.model_dump_json(exclude_unset=True))
            async for out in outputs:
                num_cached = out.num_cached_tokens
                for c in out.outputs:
                    num_gen += len(c.token_ids)
                    if not c.text and c.finish_reason is None and not c.token_ids:
                        continue
                    lps = chat_logprobs(c.token_ids, c.logprobs, request.top_logprobs or 0,
                                        request.return_tokens_as_token_ids, frozenset(request.logprob_token_ids or ())) \
                        if request.logprobs and c.logprobs is not None else None
                    delta, reason = DeltaMessage(content=c.text), c.finish_reason
                    if streamers:
                        streamer = streamers[c.index]
                        thought, content, calls = streamer.update(c.text, final=c.finish_reason is not None)
                        if not request.include_reasoning:
                            thought = ""
                        delta = DeltaMessage()
                        if thought:
                            delta.reasoning = delta.reasoning_content = thought
                        if content:
                            delta.content = content
                        if calls:
                            delta.tool_calls = [delta_tool_call(d) for d in calls]
                        reason = finish_reason(reason, streamer.has_calls)
                        if not thought and not content and not calls and reason is None and lps is None:
                            continue  # text held back: it may be the start of a marker or a tool call
                    choice = ChatCompletionStreamChoice(index=c.index, delta=delta, logprobs=lps,
                                                        finish_reason=reason)
                    if c.finish_reason is not None:
                        choice.stop_reason = c.stop_reason
                    if request.return_token_ids:
                        choice.token_ids = list(c.token_ids)
                    yield chunk([choice], usage() if continuous else None)
            if include_usage:
                yield sse(ChatCompletionStreamResponse(id=request_id, object="chat.completion.chunk",
                                                       created=created, model=model, choices=[],
                                                       usage=usage()).model_dump_json(exclude_unset=True))
        except EngineDeadError as e:
            yield sse_error(str(e), getattr(e, "status", 500))
        except ValueError as e:
            yield sse(json.dumps(self.request_error(e, request, "messages", constraint).body()))
        yield SSE_DONE
