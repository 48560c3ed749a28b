"""POST /v1/chat/completions: render the chat template, generate, answer as JSON or as SSE chunks."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from fastapi.responses import Response, StreamingResponse

from pagemill.engine.async_llm import AsyncLLM, RequestOutputCollector
from pagemill.engine.core_client import EngineDeadError
from pagemill.entrypoints.chat_utils import ChatRenderer
from pagemill.entrypoints.openai.errors import OpenAIError
from pagemill.entrypoints.openai.logprobs import chat_logprobs
from pagemill.entrypoints.openai.protocol import (AssistantMessage, ChatCompletionRequest, ChatCompletionResponse,
                                                  ChatCompletionResponseChoice, ChatCompletionStreamChoice,
                                                  ChatCompletionStreamResponse, DeltaMessage, UsageInfo)
from pagemill.entrypoints.openai.serving_engine import (SSE_DONE, OpenAIServing, json_response, random_id, sse,
                                                       sse_error)
from pagemill.entrypoints.openai.serving_models import OpenAIServingModels
from pagemill.outputs import RequestOutput

logger = logging.getLogger(__name__)


class OpenAIServingChat(OpenAIServing):
    """Handles chat completions."""

    def __init__(self, engine: AsyncLLM, models: OpenAIServingModels, renderer: ChatRenderer) -> None:
        super().__init__(engine, models)
        self.renderer = renderer

    def _check_request(self, request: ChatCompletionRequest) -> None:
        self.check_unsupported(request)
        if request.tools:
            raise OpenAIError("tools (function calling) are not supported by this server.", 400, "tools")
        if request.tool_choice not in (None, "none", "auto"):
            raise OpenAIError("tool_choice is not supported by this server.", 400, "tool_choice")
        if request.response_format is not None and request.response_format.type != "text":
            raise OpenAIError(f"response_format type {request.response_format.type!r} is not supported "
                              "(only 'text').", 400, "response_format")

    async def create_chat_completion(self, request: ChatCompletionRequest) -> Response:
        """Validate, start the request, and answer (streamed or not)."""
        model = self.models.resolve(request.model)
        self._check_request(request)
        prompt_ids = self.renderer.render([m.to_dict() for m in request.messages], request.chat_template, request.add_generation_prompt,
                                          request.continue_final_message, request.chat_template_kwargs)
        max_tokens = request.max_completion_tokens or request.max_tokens
        self.check_length(len(prompt_ids), max_tokens, "messages",
                          "max_completion_tokens" if request.max_completion_tokens else "max_tokens")
        top_n = (request.top_logprobs or 0) if request.logprobs else None
        if request.top_logprobs and not request.logprobs:
            raise OpenAIError("top_logprobs needs logprobs to be true.", 400, "top_logprobs")
        params = self.sampling_params(request, max_tokens, top_n, request.stream, {"logprobs": "top_logprobs"})
        request_id = random_id("chatcmpl")
        collector = self.add_request(request_id, prompt_ids, params, request, "messages")
        created = int(time.time())
        if request.stream:
            stream = self.release_when_dropped(
                self._stream(request, request_id, collector, model, created, len(prompt_ids)), [request_id])
            return StreamingResponse(stream, media_type="text/event-stream")
        final: RequestOutput | None = None
        async for out in self.engine.iterate(request_id, collector):
            final = out
        assert final is not None
        return json_response(self._response(request, final, request_id, model, created))

    def _response(self, request: ChatCompletionRequest, final: RequestOutput, request_id: str, model: str,
                  created: int) -> ChatCompletionResponse:
        choices = []
        for c in final.outputs:
            lps = chat_logprobs(c.token_ids, c.logprobs, request.top_logprobs or 0) \
                if request.logprobs and c.logprobs is not None else None
            choices.append(ChatCompletionResponseChoice(index=c.index, message=AssistantMessage(content=c.text),
                                                        logprobs=lps, finish_reason=c.finish_reason,
                                                        stop_reason=c.stop_reason))
        num_prompt = len(final.prompt_token_ids)
        num_gen = sum(len(c.token_ids) for c in final.outputs)
        return ChatCompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                      usage=UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_gen,
                                                      total_tokens=num_prompt + num_gen))

    async def _stream(self, request: ChatCompletionRequest, request_id: str, collector: RequestOutputCollector,
                      model: str, created: int, num_prompt: int) -> AsyncIterator[str]:
        """SSE chunks: a role chunk per choice, content deltas, optional usage, then [DONE]."""
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        continuous = include_usage and request.stream_options.continuous_usage_stats  # type: ignore[union-attr]
        num_gen = 0

        def chunk(choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> str:
            resp = ChatCompletionStreamResponse(id=request_id, object="chat.completion.chunk", created=created,
                                                model=model, choices=choices)
            if usage is not None or include_usage:
                resp.usage = usage
            return sse(resp.model_dump_json(exclude_unset=True))

        def usage() -> UsageInfo:
            return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_gen, total_tokens=num_prompt + num_gen)

        try:
            for i in range(request.n):
                yield chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""),
                                                        logprobs=None, finish_reason=None)])
            async for out in self.engine.iterate(request_id, collector):
                for c in out.outputs:
                    num_gen += len(c.token_ids)
                    if not c.text and c.finish_reason is None and not c.token_ids:
                        continue
                    lps = chat_logprobs(c.token_ids, c.logprobs, request.top_logprobs or 0) \
                        if request.logprobs and c.logprobs is not None else None
                    choice = ChatCompletionStreamChoice(index=c.index, delta=DeltaMessage(content=c.text),
                                                        logprobs=lps, finish_reason=c.finish_reason)
                    if c.finish_reason is not None:
                        choice.stop_reason = c.stop_reason
                    yield chunk([choice], usage() if continuous else None)
            if include_usage:
                yield sse(ChatCompletionStreamResponse(id=request_id, object="chat.completion.chunk",
                                                       created=created, model=model, choices=[],
                                                       usage=usage()).model_dump_json(exclude_unset=True))
        except EngineDeadError as e:
            yield sse_error(str(e), 500)
        except ValueError as e:
            yield sse_error(str(e), 400)
        yield SSE_DONE
