"""What the completion and chat handlers share: length checks, sampling params, request start, SSE."""

from __future__ import annotations

import asyncio
import json
import uuid
import weakref
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from pagemill.beam_search import BeamSearchParams
from pagemill.engine.async_llm import AsyncLLM, RequestOutputCollector
from fastapi.responses import Response
from pydantic import BaseModel

from pagemill.entrypoints.openai.errors import OpenAIError, error_body, from_value_error
from pagemill.entrypoints.openai.prompt_preparer import PromptPreparer
from pagemill.entrypoints.openai.protocol import SamplingRequest
from pagemill.entrypoints.openai.serving_models import OpenAIServingModels
from pagemill.entrypoints.openai.structured_outputs import OutputConstraint
from pagemill.lora.request import LoRARequest
from pagemill.outputs import RequestOutput
from pagemill.sampling_params import RequestOutputKind, SamplingParams

T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"


def sse(payload: str) -> str:
    """One server-sent event carrying a JSON payload."""
    return f"data: {payload}\n\n"


def sse_error(message: str, status: int) -> str:
    """An SSE event carrying an OpenAI error body (sent when a stream fails after it started)."""
    return sse(json.dumps(error_body(message, status)))


def json_response(model: BaseModel) -> Response:
    """A JSON response serialized by pydantic."""
    return Response(content=model.model_dump_json(), media_type="application/json")


def random_id(prefix: str) -> str:
    """A fresh request id such as 'chatcmpl-3f2a...'."""
    return f"{prefix}-{uuid.uuid4().hex}"


async def merge_async_iterators(iterators: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators, yielding (iterator index, item); closing it closes them all."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    loop = asyncio.get_running_loop()
    pending = {loop.create_task(anext(it)): i for i, it in enumerate(iterators)}  # type: ignore[arg-type]
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[loop.create_task(anext(iterators[i]))] = i  # type: ignore[arg-type]
                yield i, item
    finally:
        for task in pending:
            task.cancel()  # the CancelledError runs each iterator's own clean-up
        if pending:
            await asyncio.wait(pending)
        for it in iterators:
            await it.aclose()  # type: ignore[attr-defined]


def request_sampling_params(request: SamplingRequest, max_tokens: int | None, logprobs: int | None, stream: bool,
                            constraint: OutputConstraint | None = None,
                            prompt_logprobs: int | None = None) -> SamplingParams:
    """SamplingParams of a completions or chat request (OpenAI's fields, vLLM's extras, speculative_decoding);
    raises SamplingParams' ValueError for bad values. `prompt_logprobs`: overrides the request's (echo needs them)."""
    return SamplingParams(
        n=request.n, temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p, top_k=request.top_k or 0,
        min_p=request.min_p or 0.0, presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
        seed=request.seed, stop=request.stop, stop_token_ids=request.stop_token_ids,
        ignore_eos=request.ignore_eos, max_tokens=max_tokens, min_tokens=request.min_tokens,
        logprobs=logprobs, skip_special_tokens=request.skip_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
        output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        structured_outputs=constraint.params if constraint is not None else None,
        speculative_decoding=request.speculative_decoding, expected_output_tokens=request.expected_output_tokens,
        allowed_token_ids=request.allowed_token_ids, logit_bias=request.logit_bias,
        logprob_token_ids=request.logprob_token_ids, thinking_token_budget=request.thinking_token_budget,
        prompt_logprobs=request.prompt_logprobs if prompt_logprobs is None else prompt_logprobs)


class OpenAIServing:
    """Base of the endpoint handlers that generate text."""

    request_fields: frozenset[str] = frozenset()

    def __init__(self, engine: AsyncLLM, models: OpenAIServingModels, prompts: PromptPreparer) -> None:
        self.engine = engine
        self.models = models
        self.prompts = prompts
        self.tokenizer = engine.get_tokenizer()
        self.max_model_len = engine.model_config.max_model_len

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str,
                     max_tokens_param: str = "max_tokens") -> None:
        """400 if the prompt, or the prompt plus max_tokens, does not fit in the context."""
        if num_prompt_tokens == 0:
            raise OpenAIError(f"{prompt_param} must not be empty.", 400, prompt_param)
        if num_prompt_tokens >= self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"{prompt_param} resulted in {num_prompt_tokens} tokens, leaving no room to generate. "
                f"Please reduce the length of the {prompt_param}.", 400, prompt_param)
        if max_tokens is not None and num_prompt_tokens + max_tokens > self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {prompt_param}, "
                f"{max_tokens} in the completion). Please reduce {max_tokens_param} or the length of the "
                f"{prompt_param}.", 400, max_tokens_param)

    def truncate_prompt(self, prompt_ids: list[int], request: SamplingRequest) -> list[int]:
        """The prompt cut to `truncate_prompt_tokens` tokens (-1: the model's context length minus one) from the
        `truncation_side` ("left" keeps the last ones); unchanged when no truncation is asked for."""
        k = request.truncate_prompt_tokens
        if k is None:
            return prompt_ids
        if k == -1:
            k = self.max_model_len - 1
        if k >= self.max_model_len:
            raise OpenAIError(f"truncate_prompt_tokens ({k}) must be less than the model's maximum context length "
                              f"({self.max_model_len}).", 400, "truncate_prompt_tokens")
        if len(prompt_ids) <= k:
            return prompt_ids
        return prompt_ids[-k:] if request.truncation_side == "left" else prompt_ids[:k]

    def check_unsupported(self, request: SamplingRequest) -> None:
        """400 for fields this server accepts but cannot honour, or that contradict each other."""
        logprobs = getattr(request, "logprobs", None)  # chat: a bool; completions: top-N or None
        if request.logprob_token_ids is not None and (logprobs is None or logprobs is False):
            raise OpenAIError("logprob_token_ids needs logprobs (their values are returned with the logprobs).", 400,
                              "logprob_token_ids")
        if request.truncate_prompt_tokens == 0:
            raise OpenAIError("truncate_prompt_tokens must be -1 or at least 1.", 400, "truncate_prompt_tokens")
        if request.use_beam_search:
            self.check_beam_search(request)
        if request.stream_options is not None and not request.stream:
            raise OpenAIError("stream_options can only be given when stream is true.", 400, "stream_options")
        if request.priority != 0 and self.engine.config.scheduler_config.policy != "priority":
            raise OpenAIError("priority needs the server to run with --scheduling-policy priority.", 400,
                              "priority")

    def check_limits(self, request: SamplingRequest, num_logprobs: int | None, logprobs_param: str) -> None:
        """400 for more sequences (n, best_of) or logprobs than the server allows (--max-n, --max-logprobs)."""
        mc = self.engine.model_config
        best_of = getattr(request, "best_of", None) or 0
        if max(request.n, best_of) > mc.max_n:
            name = "best_of" if best_of > request.n else "n"
            raise OpenAIError(f"{name} must be at most {mc.max_n} (--max-n), got {getattr(request, name)}.", 400,
                              name)
        for param, k in ((logprobs_param, num_logprobs), ("prompt_logprobs", request.prompt_logprobs)):
            if k is not None and 0 <= mc.max_logprobs < k:
                raise OpenAIError(f"{param} must be at most {mc.max_logprobs} (--max-logprobs), got {k}.", 400, param)

    @staticmethod
    def check_beam_search(request: SamplingRequest) -> None:
        """400 for sampling fields that mean nothing to beam search (it scores beams by their logprobs)."""
        for name in ("structured_outputs", "response_format", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar", "logit_bias", "allowed_token_ids", "prompt_logprobs"):
            if getattr(request, name) is not None:
                raise OpenAIError(f"{name} cannot be combined with use_beam_search.", 400, name)

    def sampling_params(self, request: SamplingRequest, max_tokens: int | None, logprobs: int | None,
                        stream: bool, field_aliases: dict[str, str] | None = None,
                        constraint: OutputConstraint | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """SamplingParams from the request (with its output constraint); a ValueError becomes a 400 naming the
        field."""
        try:
            return request_sampling_params(request, max_tokens, logprobs, stream, constraint, prompt_logprobs)
        except (ValueError, TypeError) as e:
            err = from_value_error(ValueError(str(e)), type(request).model_fields)
            if err.param and field_aliases and err.param in field_aliases:
                err.param = field_aliases[err.param]
            raise err from e

    async def beam_search(self, request_id: str, prompt_ids: list[int], request: SamplingRequest,
                          max_tokens: int | None, lora_request: LoRARequest | None) -> AsyncIterator[RequestOutput]:
        """`use_beam_search`: the `n` best beams as one final output (an iterator, like a streamed request's)."""
        params = BeamSearchParams(beam_width=request.n, max_tokens=max_tokens or self.max_model_len - len(prompt_ids),
                                  ignore_eos=request.ignore_eos, temperature=request.temperature or 0.0,
                                  length_penalty=request.length_penalty,
                                  include_stop_str_in_output=request.include_stop_str_in_output)
        yield await self.engine.beam_search(prompt_ids, request_id, params, lora_request)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    request: SamplingRequest, prompt_param: str, prompt_text: str | None = None,
                    constraint: OutputConstraint | None = None,
                    lora_request: LoRARequest | None = None,
                    mm_features: list[Any] | None = None) -> RequestOutputCollector:
        """Start a request in the engine (with the LoRA adapter its `model` selected); a validation ValueError becomes
        a 400 (about `prompt_param` if unnamed). `mm_features`: the prompt's processed images."""
        prompt: dict[str, Any] = {"prompt_token_ids": prompt_ids}
        if mm_features:
            prompt["mm_features"] = mm_features
        if prompt_text is not None:
            prompt["prompt"] = prompt_text
        try:
            return self.engine.add_request(request_id, prompt, params, priority=request.priority,
                                           cache_salt=request.cache_salt, lora_request=lora_request)
        except ValueError as e:
            raise self.request_error(e, request, prompt_param, constraint) from e

    @staticmethod
    def request_error(exc: ValueError, request: SamplingRequest, default_param: str | None,
                      constraint: OutputConstraint | None) -> OpenAIError:
        """The 400 for an engine ValueError: it names the field the message starts with; an error about the output
        constraint (structured_outputs / guided_decoding) names the request field that gave the constraint."""
        err = from_value_error(exc, type(request).model_fields, default_param)
        message = str(exc)
        about_constraint = err.param == "structured_outputs" or any(
            word in message for word in ("structured_outputs", "guided_decoding"))
        if constraint is not None and about_constraint:
            err.param = constraint.blamed_field
            if not message.startswith(err.param):
                err.message = f"{err.param}: {message}"
        return err

    async def final_output(self, outputs: AsyncIterator[RequestOutput], request: SamplingRequest,
                           default_param: str | None, constraint: OutputConstraint | None) -> RequestOutput:
        """The last output of a non-streamed request; a ValueError the engine reports later becomes a 400."""
        final: RequestOutput | None = None
        try:
            async for out in outputs:
                final = out
        except ValueError as e:
            raise self.request_error(e, request, default_param, constraint) from e
        assert final is not None
        return final

    def release_when_dropped(self, stream: AsyncIterator[str], request_ids: list[str]) -> AsyncIterator[str]:
        """Abort the requests if the response stream is dropped before it ever started."""
        for rid in request_ids:
            weakref.finalize(stream, self.engine.release, rid)
        return stream
