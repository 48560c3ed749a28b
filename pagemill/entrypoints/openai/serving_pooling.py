"""POST /v1/embeddings (OpenAI) and /pooling (vLLM): one pooling request per input, through the async engine."""

from __future__ import annotations

import base64
import time
from typing import Any

from fastapi.responses import Response
from pydantic import BaseModel

from pagemill.engine.async_llm import AsyncLLM
from pagemill.entrypoints.openai.errors import OpenAIError, from_value_error
from pagemill.entrypoints.openai.prompt_preparer import PromptPreparer
from pagemill.entrypoints.openai.protocol import (EmbeddingRequest, EmbeddingResponse, EmbeddingResponseData,
                                                  PoolingInputRequest, PoolingRequest, PoolingResponse,
                                                  PoolingResponseData, UsageInfo)
from pagemill.entrypoints.openai.serving_engine import json_response, merge_async_iterators, random_id
from pagemill.entrypoints.openai.serving_models import OpenAIServingModels
from pagemill.outputs import PoolingOutput, PoolingRequestOutput
from pagemill.pooling_params import PoolingParams

GENERATE_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
POOLING_ENDPOINTS = ("/v1/embeddings", "/pooling", "/score", "/rerank")


def check_generate_model(engine: AsyncLLM, endpoint: str) -> None:
    """400 for a text-generation endpoint on a pooling model."""
    if engine.model_config.runner_type == "pooling":
        raise OpenAIError(f"This model is a pooling model (runner 'pooling'): it has no {endpoint}; use "
                          f"{', '.join(POOLING_ENDPOINTS)}.", 400, "model")


def encode_vector(output: PoolingOutput, encoding_format: str) -> list[float] | str:
    """A vector as floats, or base64 of its little-endian float32 bytes (what OpenAI's base64 format is)."""
    if encoding_format == "base64":
        return base64.b64encode(output.data.numpy().astype("<f4").tobytes()).decode("ascii")
    return output.data.tolist()


class OpenAIServingPooling:
    """Base of the pooling endpoints: runner and task checks, PoolingParams, inputs, running the requests."""

    def __init__(self, engine: AsyncLLM, models: OpenAIServingModels, prompts: PromptPreparer) -> None:
        self.engine = engine
        self.models = models
        self.prompts = prompts
        self.tokenizer = engine.get_tokenizer()
        self.pooler_config = engine.model_config.pooler_config
        self.max_model_len = engine.model_config.max_model_len

    def check_task(self, task: str, endpoint: str) -> None:
        """400 unless the model is a pooling model that does `task`."""
        if self.pooler_config is None:
            raise OpenAIError(f"{endpoint} needs a pooling model; this model generates text (runner 'generate'): "
                              f"use {', '.join(GENERATE_ENDPOINTS)}.", 400, "model")
        tasks = self.pooler_config.supported_tasks
        if task not in tasks:
            raise OpenAIError(f"{endpoint}: this model does not support the {task!r} task (it supports "
                              f"{', '.join(tasks)}).", 400, "model")

    def pooling_params(self, request: BaseModel, task: str, **fields: Any) -> PoolingParams:
        """PoolingParams from the request; a ValueError becomes a 400 naming the field."""
        if getattr(request, "priority", 0) != 0 and self.engine.config.scheduler_config.policy != "priority":
            raise OpenAIError("priority needs the server to run with --scheduling-policy priority.", 400, "priority")
        try:
            return PoolingParams(truncate_prompt_tokens=getattr(request, "truncate_prompt_tokens", None), task=task,
                                 **fields)
        except ValueError as e:
            raise from_value_error(e, type(request).model_fields) from e

    @staticmethod
    def input_prompts(value: Any, param: str) -> list[Any]:
        """The prompts of an OpenAI `input`: a string, strings, token ids, or lists of token ids."""
        if isinstance(value, str):
            items = [value]
        elif not value:
            raise OpenAIError(f"{param} must not be empty.", 400, param)
        elif isinstance(value[0], int):
            items = [value]
        else:
            items = list(value)
        for item in items:
            if not item:
                raise OpenAIError(f"{param} must not contain an empty string or an empty token list.", 400, param)
        return [item if isinstance(item, str) else {"prompt_token_ids": list(item)} for item in items]

    def _tokenized(self, prompts: list[Any]) -> list[Any]:
        """Text prompts with their token ids (run in a worker thread: the engine then tokenizes nothing)."""
        return [{"prompt": p, "prompt_token_ids": self.tokenizer.encode(p)} if isinstance(p, str) and p else p
                for p in prompts]

    async def run(self, prompts: list[Any], params: PoolingParams, request: BaseModel, prefix: str,
                  default_param: str) -> list[PoolingRequestOutput]:
        """Pool every prompt (one engine request each, sharing engine steps); outputs in prompt order. A request
        the engine rejects is a 400 naming the field (`default_param` when the message names none)."""
        fields = type(request).model_fields
        base = random_id(prefix)
        ids = [f"{base}-{i}" for i in range(len(prompts))]
        collectors = []
        priority = getattr(request, "priority", 0)
        prompts = await self.prompts.worker.run(self._tokenized, prompts)
        try:
            for rid, prompt in zip(ids, prompts):
                collectors.append(self.engine.add_request(rid, prompt, params, priority=priority))
        except BaseException as e:
            for rid in ids[:len(collectors)]:
                self.engine.release(rid)
            if isinstance(e, ValueError):
                raise from_value_error(e, fields, default_param) from e
            raise
        finals: dict[int, PoolingRequestOutput] = {}
        try:
            async for i, out in merge_async_iterators([self.engine.iterate(r, c) for r, c in zip(ids, collectors)]):
                finals[i] = out
        except ValueError as e:
            raise from_value_error(e, fields, default_param) from e
        return [finals[i] for i in range(len(prompts))]


class OpenAIServingEmbedding(OpenAIServingPooling):
    """POST /v1/embeddings (embed task) and /pooling (the model's default head)."""

    async def create_embedding(self, request: EmbeddingRequest) -> Response:
        """Embed every input; floats or base64, in input order."""
        model = self.models.resolve(request.model)
        self.check_task("embed", "/v1/embeddings")
        outs = await self._pool(request, "embed", "embd", normalize=request.normalize)
        data = [EmbeddingResponseData(index=i, embedding=encode_vector(o.outputs, request.encoding_format))
                for i, o in enumerate(outs)]
        return json_response(EmbeddingResponse(id=random_id("embd"), created=int(time.time()), model=model,
                                               data=data, usage=_usage(outs)))

    async def create_pooling(self, request: PoolingRequest) -> Response:
        """The pooler's output for every input (embeddings, or a classifier's probabilities)."""
        model = self.models.resolve(request.model)
        self.check_task("encode", "/pooling")
        outs = await self._pool(request, "encode", "pool", normalize=request.normalize,
                                activation=request.activation)
        data = [PoolingResponseData(index=i, data=encode_vector(o.outputs, request.encoding_format))
                for i, o in enumerate(outs)]
        return json_response(PoolingResponse(id=random_id("pool"), created=int(time.time()), model=model, data=data,
                                             usage=_usage(outs)))

    async def _pool(self, request: PoolingInputRequest, task: str, prefix: str,
                    **fields: Any) -> list[PoolingRequestOutput]:
        params = self.pooling_params(request, task, dimensions=request.dimensions, **fields)
        return await self.run(self.input_prompts(request.input, "input"), params, request, prefix, "input")


def _usage(outs: list[PoolingRequestOutput]) -> UsageInfo:
    """Prompt tokens (= total tokens) of the pooled inputs."""
    n = sum(len(o.prompt_token_ids) for o in outs)
    return UsageInfo(prompt_tokens=n, total_tokens=n)
