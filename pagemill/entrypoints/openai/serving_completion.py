"""POST /v1/completions: one engine request per prompt, answered as JSON or as SSE chunks; `echo` (with the prompt's
logprobs, and `max_tokens=0` to score a prompt without generating), prompt logprobs, beam search."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi.responses import Response, StreamingResponse

from pagemill.engine.core_client import EngineDeadError
from pagemill.entrypoints.openai.errors import OpenAIError
from pagemill.entrypoints.openai.logprobs import completion_logprobs, prompt_logprobs_json
from pagemill.entrypoints.openai.protocol import (CompletionRequest, CompletionResponse, CompletionResponseChoice,
                                                  UsageInfo, usage_info)
from pagemill.entrypoints.openai.serving_engine import (SSE_DONE, OpenAIServing, json_response,
                                                       merge_async_iterators, random_id, sse, sse_error)
from pagemill.entrypoints.openai.structured_outputs import OutputConstraint, output_constraint
from pagemill.outputs import CompletionOutput, RequestOutput


@dataclass
class Prompt:
    """One prompt of a request: its token ids (after truncation) and its text (decoded when given as ids)."""

    text: str
    token_ids: list[int]


class OpenAIServingCompletion(OpenAIServing):
    """Handles legacy text completions."""

    def _check_request(self, request: CompletionRequest) -> None:
        self.check_unsupported(request)
        if request.suffix is not None:
            raise OpenAIError("suffix is not supported by this server.", 400, "suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise OpenAIError("best_of other than n is not supported by this server.", 400, "best_of")
        if request.max_tokens == 0 and not request.echo:
            raise OpenAIError("max_tokens must be at least 1 unless echo is true (max_tokens=0 with echo scores the "
                              "prompt without generating).", 400, "max_tokens")
        if request.use_beam_search and (request.echo or request.logprobs is not None):
            name = "echo" if request.echo else "logprobs"
            raise OpenAIError(f"{name} cannot be combined with use_beam_search.", 400, name)

    async def _prompts(self, request: CompletionRequest) -> list[Prompt]:
        """The prompts of the request, tokenized (off the event loop), truncated as asked and length-checked."""
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
                ids = await self.prompts.encode(item, request.add_special_tokens, "prompt")
            else:
                ids = list(item)
            kept = self.truncate_prompt(ids, request)
            text = item if isinstance(item, str) and len(kept) == len(ids) else None
            self.check_length(len(kept), request.max_tokens, "prompt")
            if text is None:
                text = self.tokenizer.decode(kept) if request.echo else ""
            prompts.append(Prompt(text, kept))
        return prompts

    async def create_completion(self, request: CompletionRequest) -> Response:
        """Validate, start one request per prompt, and answer (streamed or not)."""
        model = self.models.resolve(request.model)
        lora_request = self.models.lora_request(model)
        self._check_request(request)
        self.check_limits(request, request.logprobs, "logprobs")
        constraint = output_constraint(request)
        prompts = await self._prompts(request)
        # max_tokens=0 (echo only): one token is generated and dropped, as vLLM does.
        max_tokens = 1 if request.max_tokens == 0 else request.max_tokens
        prompt_logprobs = request.prompt_logprobs
        if request.echo and request.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, request.logprobs)
        params = self.sampling_params(request, max_tokens, request.logprobs, request.stream, constraint=constraint,
                                      prompt_logprobs=prompt_logprobs)
        base_id = random_id("cmpl")
        ids = [f"{base_id}-{i}" for i in range(len(prompts))]
        iterators: list[AsyncIterator[RequestOutput]]
        if request.use_beam_search:
            iterators = [self.beam_search(rid, p.token_ids, request, request.max_tokens, lora_request)
                         for rid, p in zip(ids, prompts)]
        else:
            collectors = []
            try:
                for rid, p in zip(ids, prompts):
                    collectors.append(self.add_request(rid, p.token_ids, params.clone(), request, "prompt",
                                                       p.text or None, constraint, lora_request))
            except BaseException:
                for rid in ids[:len(collectors)]:
                    self.engine.release(rid)
                raise
            iterators = [self.engine.iterate(rid, c) for rid, c in zip(ids, collectors)]
        created = int(time.time())
        if request.stream:
            stream = self.release_when_dropped(
                self._stream(request, base_id, iterators, prompts, model, created, constraint), ids)
            return StreamingResponse(stream, media_type="text/event-stream")
        finals: dict[int, RequestOutput] = {}
        try:
            async for i, out in merge_async_iterators(iterators):
                finals[i] = out
        except ValueError as e:
            raise self.request_error(e, request, "prompt", constraint) from e
        choices = [self._choice(request, i * request.n + c.index, c, finals[i], prompts[i], True)
                   for i in sorted(finals) for c in finals[i].outputs]
        num_prompt = sum(len(p.token_ids) for p in prompts)
        num_gen = 0 if request.max_tokens == 0 else sum(len(c.token_ids) for o in finals.values() for c in o.outputs)
        num_cached = sum(o.num_cached_tokens for o in finals.values())
        return json_response(CompletionResponse(id=base_id, created=created, model=model, choices=choices,
                                                usage=usage_info(num_prompt, num_gen, num_cached)))

    def _choice(self, request: CompletionRequest, index: int, c: CompletionOutput, out: RequestOutput,
                prompt: Prompt, first: bool, text_offset: int = 0) -> CompletionResponseChoice:
        """One choice (or one streamed piece of it); `first`: the choice's first piece, which carries the echoed
        prompt and the prompt-level fields."""
        text, token_ids, logprobs = c.text, c.token_ids, c.logprobs
        if request.max_tokens == 0:  # the generated token only made the engine compute the prompt
            text, token_ids, logprobs = "", [], []
        echo = request.echo and first
        choice = CompletionResponseChoice(index=index, text=prompt.text + text if echo else text,
                                          finish_reason=c.finish_reason, stop_reason=c.stop_reason)
        if request.logprobs is not None and (logprobs is not None or echo):
            lp_ids, lps = list(token_ids), list(logprobs or [])
            if echo:
                prompt_lps = out.prompt_logprobs or [None] * len(prompt.token_ids)
                lp_ids, lps = prompt.token_ids + lp_ids, list(prompt_lps) + lps
            choice.logprobs = completion_logprobs(lp_ids, lps, request.logprobs, text_offset,
                                                  request.return_tokens_as_token_ids, self._token_text,
                                                  frozenset(request.logprob_token_ids or ()))
        if first and request.prompt_logprobs is not None:
            choice.prompt_logprobs = prompt_logprobs_json(out.prompt_logprobs)
        if request.return_token_ids or self.no_tokenizer:
            if first:
                choice.prompt_token_ids = prompt.token_ids
            choice.token_ids = list(token_ids)
        return choice

    def _token_text(self, token_id: int) -> str:
        if self.no_tokenizer:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    async def _stream(self, request: CompletionRequest, request_id: str, iterators: list[AsyncIterator[RequestOutput]],
                      prompts: list[Prompt], model: str, created: int,
                      constraint: OutputConstraint | None = None) -> AsyncIterator[str]:
        """SSE chunks of text deltas (choice index = prompt index * n + sequence index), usage, [DONE]."""
        include_usage, continuous = self.stream_usage(request.stream_options)
        num_prompt = sum(len(p.token_ids) for p in prompts)
        offsets: dict[int, int] = {}
        cached: dict[int, int] = {}
        num_gen = 0
        try:
            async for i, out in merge_async_iterators(iterators):
                cached[i] = out.num_cached_tokens
                for c in out.outputs:
                    if request.max_tokens != 0:
                        num_gen += len(c.token_ids)
                    if not c.text and c.finish_reason is None and not c.token_ids:
                        continue
                    index = i * request.n + c.index
                    choice = self._choice(request, index, c, out, prompts[i], index not in offsets,
                                          offsets.get(index, 0))
                    offsets[index] = offsets.get(index, 0) + len(choice.text)
                    resp = CompletionResponse(id=request_id, object="text_completion", created=created, model=model,
                                              choices=[choice])
                    if continuous:
                        resp.usage = usage_info(num_prompt, num_gen, sum(cached.values()))
                    elif include_usage:
                        resp.usage = None
                    yield sse(resp.model_dump_json(exclude_unset=True))
            if include_usage:
                usage: UsageInfo = usage_info(num_prompt, num_gen, sum(cached.values()))
                yield sse(CompletionResponse(id=request_id, object="text_completion", created=created, model=model,
                                             choices=[], usage=usage).model_dump_json(exclude_unset=True))
        except EngineDeadError as e:
            yield sse_error(str(e), getattr(e, "status", 500))
        except ValueError as e:
            yield sse(json.dumps(self.request_error(e, request, "prompt", constraint).body()))
        yield SSE_DONE
