"""POST /score and /rerank (vLLM's; /rerank takes Jina / Cohere-style bodies): a cross-encoder's relevance of each
pair, or the cosine similarity of the two texts' embeddings for an embedding model."""

from __future__ import annotations

import time
from typing import Any

from fastapi.responses import Response

from pagemill.entrypoints.openai.errors import OpenAIError, from_value_error
from pagemill.entrypoints.openai.protocol import (RerankDocument, RerankRequest, RerankResponse, RerankResult,
                                                  RerankUsage, ScoreRequest, ScoreResponse, ScoreResponseData,
                                                  UsageInfo)
from pagemill.entrypoints.openai.serving_engine import json_response, random_id
from pagemill.entrypoints.openai.serving_pooling import OpenAIServingPooling
from pagemill.pooling.processor import truncation_length
from pagemill.pooling.score import (classifier_score, cosine_scores, cross_encoder_prompt, score_pairs,
                                    unique_inputs)


class OpenAIServingScore(OpenAIServingPooling):
    """Scores text pairs for /score and ranks documents for /rerank."""

    async def create_score(self, request: ScoreRequest) -> Response:
        """The score of every (text_1, text_2) pair: 1 x 1, 1 x N or N x N."""
        model = self.models.resolve(request.model)
        self.check_task("score", "/score")
        for name in ("text_1", "text_2"):
            value = getattr(request, name)
            if not value or (isinstance(value, list) and not all(value)):
                raise OpenAIError(f"{name} must not be empty or contain empty strings.", 400, name)
        try:
            pairs = score_pairs(request.text_1, request.text_2)
        except ValueError as e:
            raise from_value_error(e, type(request).model_fields, "text_2") from e
        scores, num_tokens = await self._scores(pairs, request, "text_2")
        data = [ScoreResponseData(index=i, score=s) for i, s in enumerate(scores)]
        return json_response(ScoreResponse(id=random_id("score"), created=int(time.time()), model=model, data=data,
                                           usage=UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens)))

    async def rerank(self, request: RerankRequest) -> Response:
        """The documents by relevance to the query, best first (the `top_n` best when given)."""
        model = self.models.resolve(request.model)
        self.check_task("score", "/rerank")
        if not request.query:
            raise OpenAIError("query must not be empty.", 400, "query")
        if not request.documents or not all(request.documents):
            raise OpenAIError("documents must not be empty or contain empty strings.", 400, "documents")
        scores, num_tokens = await self._scores([(request.query, d) for d in request.documents], request,
                                                "documents")
        order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
        if request.top_n:
            order = order[:request.top_n]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=request.documents[i]) if request.return_documents
                                else None) for i in order]
        return json_response(RerankResponse(id=random_id("rerank"), model=model,
                                            usage=RerankUsage(total_tokens=num_tokens), results=results))

    async def _scores(self, pairs: list[tuple[str, str]], request: ScoreRequest | RerankRequest,
                      default_param: str) -> tuple[list[float], int]:
        """(score of each pair, tokens used)."""
        params = self.pooling_params(request, "score", activation=request.activation)
        if self.pooler_config.head == "classify":
            try:
                truncate_to = truncation_length(params, self.max_model_len)
            except ValueError as e:
                raise from_value_error(e, type(request).model_fields) from e
            prompts: list[Any] = await self.prompts.worker.run(
                lambda: [cross_encoder_prompt(self.tokenizer, a, b, truncate_to) for a, b in pairs])
            outs = await self.run(prompts, params, request, "score", default_param)
            try:
                scores = [classifier_score(o.outputs) for o in outs]
            except ValueError as e:
                raise OpenAIError(str(e), 400, "model") from e
            return scores, sum(len(o.prompt_token_ids) for o in outs)
        inputs, slots = unique_inputs(pairs)
        outs = await self.run(inputs, params.clone(task="embed"), request, "score", default_param)
        vectors = [outs[i].outputs.data for i in slots]
        return cosine_scores(vectors[0::2], vectors[1::2]), sum(len(o.prompt_token_ids) for o in outs)
