"""POST /v1/embeddings (OpenAI) and /pooling (vLLM): one pooling request per input, through the async engine."""

from __future__ import annotations

import base64
import json
import sys
import time
from typing import Any

import torch
from fastapi.responses import Response
from pydantic import BaseModel

from pagemill.engine.async_llm import AsyncLLM
from pagemill.entrypoints.openai.errors import OpenAIError, from_value_error
from pagemill.entrypoints.openai.prompt_preparer import PromptPreparer
from pagemill.entrypoints.openai.protocol import (ClassificationData, ClassificationRequest, ClassificationResponse,
                                                  EmbeddingRequest, EmbeddingResponse, EmbeddingResponseData,
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


EMBED_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def vector_bytes(data: torch.Tensor, embed_dtype: str = "float32", endianness: str = "native") -> bytes:
    """A vector's values as `embed_dtype` in the byte order `endianness` (vLLM's tensor2binary)."""
    values = data.detach().to("cpu").contiguous().to(EMBED_DTYPES[embed_dtype])
    width = values.element_size()
    raw = values.view(torch.uint8)
    order = sys.byteorder if endianness == "native" else endianness
    if width > 1 and order != sys.byteorder:
        raw = raw.view(-1, width).flip(1)
    return raw.numpy().tobytes()


def encode_vector(output: PoolingOutput, encoding_format: str, embed_dtype: str = "float32",
                  endianness: str = "native") -> list[float] | str:
    """A vector as floats, or base64 of its bytes (float32 little-endian by default: OpenAI's base64 format)."""
    if encoding_format == "base64":
        return base64.b64encode(vector_bytes(output.data, embed_dtype, endianness)).decode("ascii")
    return output.data.tolist()


def bytes_response(outs: list[PoolingRequestOutput], request: PoolingInputRequest, request_id: str, created: int,
                   model: str) -> Response:
    """vLLM's `bytes` / `bytes_only` formats: the vectors' bytes back to back as application/octet-stream; with
    `bytes`, a `metadata` header (JSON) gives id, created, model, usage and each vector's byte range and shape."""
    body, items, offset = [], [], 0
    for i, out in enumerate(outs):
        raw = vector_bytes(out.outputs.data, request.embed_dtype, request.endianness)
        items.append({"index": i, "embed_dtype": request.embed_dtype, "endianness": request.endianness,
                      "start": offset, "end": offset + len(raw), "shape": list(out.outputs.data.shape)})
        body.append(raw)
        offset += len(raw)
    headers = None
    if request.encoding_format == "bytes":
        headers = {"metadata": json.dumps({"id": request_id, "created": created, "model": model, "data": items,
                                           "usage": _usage(outs).model_dump(exclude_none=True)})}
    return Response(b"".join(body), media_type="application/octet-stream", headers=headers)


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

    async def request_prompts(self, request: PoolingInputRequest) -> list[Any]:
        """The prompts of a request's `input`, or of its `messages` rendered with the chat template (vLLM's chat
        form of the pooling endpoints): exactly one of the two."""
        if request.input is None and request.messages is None:
            raise OpenAIError("input is required (or give chat-style messages instead).", 400, "input")
        if request.input is not None and request.messages is not None:
            raise OpenAIError("Give exactly one of input and messages.", 400, "messages")
        if request.messages is None:
            return self.input_prompts(request.input, "input")
        if not request.messages:
            raise OpenAIError("messages must not be empty.", 400, "messages")
        conversation = [m.to_dict() for m in request.messages]
        ids = await self.prompts.render(conversation, request.chat_template, request.add_generation_prompt,
                                        request.continue_final_message, request.chat_template_kwargs,
                                        add_special_tokens=bool(request.add_special_tokens))
        return [{"prompt_token_ids": ids}]

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

    def _tokenized(self, prompts: list[Any], add_special_tokens: bool | None = None) -> list[Any]:
        """Text prompts with their token ids (run in a worker thread: the engine then tokenizes nothing)."""
        special = add_special_tokens is not False
        return [{"prompt": p, "prompt_token_ids": self.tokenizer.encode(p, add_special_tokens=special)}
                if isinstance(p, str) and p else p for p in prompts]

    async def run(self, prompts: list[Any], params: PoolingParams, request: BaseModel, prefix: str,
                  default_param: str) -> list[PoolingRequestOutput]:
        """Pool every prompt (one engine request each, sharing engine steps); outputs in prompt order. A request
        the engine rejects is a 400 naming the field (`default_param` when the message names none)."""
        fields = type(request).model_fields
        base = random_id(prefix)
        ids = [f"{base}-{i}" for i in range(len(prompts))]
        collectors = []
        priority = getattr(request, "priority", 0)
        prompts = await self.prompts.worker.run(self._tokenized, prompts, getattr(request, "add_special_tokens", None))
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
        request_id, created = random_id("embd"), int(time.time())
        if request.encoding_format in ("bytes", "bytes_only"):
            return bytes_response(outs, request, request_id, created, model)
        data = [EmbeddingResponseData(index=i, embedding=encode_vector(o.outputs, request.encoding_format,
                                                                       request.embed_dtype, request.endianness))
                for i, o in enumerate(outs)]
        return json_response(EmbeddingResponse(id=request_id, created=created, model=model, data=data,
                                               usage=_usage(outs)))

    async def create_pooling(self, request: PoolingRequest) -> Response:
        """The pooler's output for every input (embeddings, or a classifier's probabilities)."""
        model = self.models.resolve(request.model)
        self.check_task("encode", "/pooling")
        outs = await self._pool(request, "encode", "pool", normalize=request.normalize,
                                activation=request.activation)
        request_id, created = random_id("pool"), int(time.time())
        if request.encoding_format in ("bytes", "bytes_only"):
            return bytes_response(outs, request, request_id, created, model)
        data = [PoolingResponseData(index=i, data=encode_vector(o.outputs, request.encoding_format,
                                                                request.embed_dtype, request.endianness))
                for i, o in enumerate(outs)]
        return json_response(PoolingResponse(id=request_id, created=created, model=model, data=data,
                                             usage=_usage(outs)))

    async def create_classify(self, request: ClassificationRequest) -> Response:
        """Class probabilities of every input, with the most likely class's label (vLLM's /classify)."""
        model = self.models.resolve(request.model)
        self.check_task("classify", "/classify")
        if request.encoding_format != "float" or request.dimensions is not None:
            param = "dimensions" if request.dimensions is not None else "encoding_format"
            raise OpenAIError(f"/classify does not take {param}.", 400, param)
        outs = await self._pool(request, "classify", "classify", activation=request.activation)
        labels = getattr(self.engine.model_config.hf_config, "id2label", None) or {}
        data = []
        for i, o in enumerate(outs):
            probs = o.outputs.data.float().reshape(-1).tolist()
            best = max(range(len(probs)), key=probs.__getitem__)
            label = labels.get(best, labels.get(str(best), f"LABEL_{best}"))
            data.append(ClassificationData(index=i, label=label, probs=probs, num_classes=len(probs)))
        return json_response(ClassificationResponse(id=random_id("classify"), created=int(time.time()), model=model,
                                                    data=data, usage=_usage(outs)))

    async def _pool(self, request: PoolingInputRequest, task: str, prefix: str,
                    **fields: Any) -> list[PoolingRequestOutput]:
        params = self.pooling_params(request, task, dimensions=request.dimensions, **fields)
        return await self.run(await self.request_prompts(request), params, request, prefix, "input")


def _usage(outs: list[PoolingRequestOutput]) -> UsageInfo:
    """Prompt tokens (= total tokens) of the pooled inputs."""
    n = sum(len(o.prompt_token_ids) for o in outs)
    return UsageInfo(prompt_tokens=n, total_tokens=n)
