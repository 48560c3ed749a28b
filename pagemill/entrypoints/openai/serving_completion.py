"""POST /v1/completions: one engine request per prompt, answered as JSON or as SSE chunks."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from fastapi.responses import Response, StreamingResponse

from pagemill.engine.core_client import EngineDeadError
from pagemill.entrypoints.openai.errors import OpenAIError
from pagemill.entrypoints.openai.logprobs import completion_logprobs
from pagemill.entrypoints.openai.protocol import (CompletionLogProbs, CompletionRequest, CompletionResponse,
                                                  CompletionResponseChoice, UsageInfo)
from pagemill.entrypoints.openai.serving_engine import (SSE_DONE, OpenAIServing, json_response,
                                                       merge_async_iterators, random_id, sse, sse_error)
from pagemill.entrypoints.openai.structured_outputs import OutputConstraint, output_constraint
from pagemill.outputs import CompletionOutput, RequestOutput

Prompt = tuple[str | None, list[int]]  # (text if given as text, token ids)


class OpenAIServingCompletion(OpenAIServing):
    """Handles legacy text completions."""

    def _check_request(self, request: CompletionRequest) -> None:
        self.check_unsupported(request)
        if request.echo:
            raise OpenAIError("echo is not supported by this server.", 400, "echo")
        if request.suffix is not None:
            raise OpenAIError("suffix is not supported by this server.", 400, "suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise OpenAIError("best_of other than n is not supported by this server.", 400, "best_of")

    async def _prompts(self, request: CompletionRequest) -> list[Prompt]:
        """The prompts of the request, tokenized (off the event loop) and length-checked."""
        p = request.prompt
        if isinstance(p, str):
            items: list = [p]
        elif not p:
            raise OpenAIError("prompt must not be empty.", 400, "prompt")
        elif isinstance(p[0], int):
            items = [p]
        else:
            items = list(p)
        prompts = []
        for item in items:
            if isinstance(item, str):
                prompts.append((item, await self.prompts.encode(item, request.add_special_tokens, "prompt")))
            else:
                prompts.append((None, list(item)))
            self.check_length(len(prompts[-1][1]), request.max_tokens, "prompt")
        return prompts

    async def create_completion(self, request: CompletionRequest) -> Response:
        """Validate, start one request per prompt, and answer (streamed or not)."""
        model = self.models.resolve(request.model)
        lora_request = self.models.lora_request(model)
        self._check_request(request)
        self.check_limits(request, request.logprobs, "logprobs")
        constraint = output_constraint(request)
        prompts = await self._prompts(request)
        params = self.sampling_params(request, request.max_tokens, request.logprobs, request.stream,
                                      constraint=constraint)
        base_id = random_id("cmpl")
        ids = [f"{base_id}-{i}" for i in range(len(prompts))]
        collectors = []
        try:
            for rid, (text, tokens) in zip(ids, prompts):
                collectors.append(self.add_request(rid, tokens, params.clone(), request, "prompt", text,
                                                   constraint, lora_request))
        except BaseException:
            for rid in ids[:len(collectors)]:
                self.engine.release(rid)
            raise
        iterators = [self.engine.iterate(rid, c) for rid, c in zip(ids, collectors)]
        created = int(time.time())
        num_prompt = sum(len(t) for _, t in prompts)
        if request.stream:
            stream = self.release_when_dropped(
                self._stream(request, base_id, iterators, model, created, num_prompt, constraint), ids)
            return StreamingResponse(stream, media_type="text/event-stream")
        finals: dict[int, RequestOutput] = {}
        try:
            async for i, out in merge_async_iterators(iterators):
                finals[i] = out
        except ValueError as e:
            raise self.request_error(e, request, "prompt", constraint) from e
        choices = [self._choice(request, i * request.n + c.index, c, c.text)
                   for i in sorted(finals) for c in finals[i].outputs]
        num_gen = sum(len(c.token_ids) for out in finals.values() for c in out.outputs)
        return json_response(CompletionResponse(
            id=base_id, created=created, model=model, choices=choices,
            usage=UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_gen, total_tokens=num_prompt + num_gen)))

    @staticmethod
    def _choice(request: CompletionRequest, index: int, c: CompletionOutput, text: str,
                text_offset: int = 0) -> CompletionResponseChoice:
        lps: CompletionLogProbs | None = None
        if request.logprobs is not None and c.logprobs is not None:
            lps = completion_logprobs(c.token_ids, c.logprobs, request.logprobs, text_offset)
        return CompletionResponseChoice(index=index, text=text, logprobs=lps, finish_reason=c.finish_reason,
                                        stop_reason=c.stop_reason)

    async def _stream(self, request: CompletionRequest, request_id: str, iterators: list[AsyncIterator[RequestOutput]],
                      model: str, created: int, num_prompt: int,
                      constraint: OutputConstraint | None = None) -> AsyncIterator[str]:
        """SSE chunks of text deltas (choice index = prompt index * n + sequence index), usage, [DONE]."""
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        offsets: dict[int, int] = {}
        num_gen = 0
        try:
            async for i, out in merge_async_iterators(iterators):
                for c in out.outputs:
                    num_gen += len(c.token_ids)
                    if not c.text and c.finish_reason is None and not c.token_ids:
                        continue
                    index = i * request.n + c.index
                    choice = self._choice(request, index, c, c.text, offsets.get(index, 0))
                    if choice.logprobs is not None and choice.logprobs.tokens:
                        offsets[index] = choice.logprobs.text_offset[-1] + len(choice.logprobs.tokens[-1])
                    resp = CompletionResponse(id=request_id, object="text_completion", created=created, model=model,
                                              choices=[choice])
                    if include_usage:
                        resp.usage = None
                    yield sse(resp.model_dump_json(exclude_unset=True))
            if include_usage:
                usage = UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_gen,
                                  total_tokens=num_prompt + num_gen)
                yield sse(CompletionResponse(id=request_id, object="text_completion", created=created, model=model,
                                             choices=[], usage=usage).model_dump_json(exclude_unset=True))
        except EngineDeadError as e:
            yield sse_error(str(e), getattr(e, "status", 500))
        except ValueError as e:
            yield sse(json.dumps(self.request_error(e, request, "prompt", constraint).body()))
        yield SSE_DONE
