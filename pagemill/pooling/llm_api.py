"""The offline pooling API of `LLM` (vLLM's): encode, embed, classify and score, on a pooling model
(`LLM(model, runner="pooling")`, or `task="embed"`; BERT-like architectures are pooling models by default)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagemill.engine.processor import PromptType
from pagemill.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput, PoolingOutput,
                              PoolingRequestOutput, ScoringOutput, ScoringRequestOutput)
from pagemill.pooling.processor import truncation_length
from pagemill.pooling.score import (classifier_score, cosine_scores, cross_encoder_prompt, score_pairs,
                                   unique_inputs)
from pagemill.pooling_params import PoolingParams


def _as_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (a string, a dict or a list of token ids) or a list of them, as a list."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


class PoolingLLMMixin:
    """embed / classify / score / encode for `LLM`; every request goes through the same engine as generate."""

    def _pool(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None, task: str, use_tqdm: bool,
              truncate_prompt_tokens: int | None) -> list[PoolingRequestOutput[PoolingOutput]]:
        """Run pooling requests for the prompts (one params for all or one per prompt); outputs in prompt order."""
        prompts = _as_list(prompts)
        if pooling_params is None:
            pooling_params = PoolingParams()
        params = [pooling_params] * len(prompts) if isinstance(pooling_params, PoolingParams) \
            else list(pooling_params)
        if len(params) != len(prompts):
            raise ValueError(f"pooling_params has {len(params)} entries for {len(prompts)} prompts.")
        changes: dict[str, Any] = {"task": task}
        if truncate_prompt_tokens is not None:
            changes["truncate_prompt_tokens"] = truncate_prompt_tokens
        return self._run(prompts, [p.clone(**changes) for p in params], use_tqdm, None)

    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, use_tqdm: bool = True,
               truncate_prompt_tokens: int | None = None,
               pooling_task: str = "encode") -> list[PoolingRequestOutput[PoolingOutput]]:
        """The pooler's raw output for each prompt (`.outputs.data`, a float32 tensor): the model's default head."""
        return self._pool(prompts, pooling_params, pooling_task, use_tqdm, truncate_prompt_tokens)

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, use_tqdm: bool = True,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`.outputs.embedding`)."""
        outs = self._pool(prompts, pooling_params, "embed", use_tqdm, truncate_prompt_tokens)
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def classify(self, prompts: PromptType | Sequence[PromptType],
                 pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, use_tqdm: bool = True,
                 truncate_prompt_tokens: int | None = None) -> list[ClassificationRequestOutput]:
        """A classifier's class probabilities per prompt (`.outputs.probs`)."""
        outs = self._pool(prompts, pooling_params, "classify", use_tqdm, truncate_prompt_tokens)
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def score(self, data_1: Any, data_2: Any, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """Scores of (data_1, data_2) pairs (1 x 1, 1 x N or N x N): a cross-encoder's relevance, else the cosine
        similarity of the two embeddings (`.outputs.score`)."""
        pairs = score_pairs(data_1, data_2)
        engine = self.llm_engine
        params = (pooling_params or PoolingParams()).clone(task="score")
        if truncate_prompt_tokens is not None:
            params = params.clone(truncate_prompt_tokens=truncate_prompt_tokens)
        if engine.config.model_config.pooler_config is None:
            raise ValueError("score needs a pooling model (runner='pooling'); this one generates text.")
        if engine.config.model_config.pooler_config.head == "classify":
            truncate_to = truncation_length(params, engine.config.model_config.max_model_len)
            prompts = [cross_encoder_prompt(self.get_tokenizer(), a, b, truncate_to) for a, b in pairs]
            outs = self._run(prompts, [params] * len(prompts), use_tqdm, None)
            return [ScoringRequestOutput(o.request_id, ScoringOutput(classifier_score(o.outputs)),
                                         o.prompt_token_ids, True, o.metrics) for o in outs]
        texts, slots = unique_inputs(pairs)
        embedded = self._run(texts, [params.clone(task="embed")] * len(texts), use_tqdm, None)
        firsts, seconds = [embedded[i] for i in slots[0::2]], [embedded[i] for i in slots[1::2]]
        scores = cosine_scores([o.outputs.data for o in firsts], [o.outputs.data for o in seconds])
        return [ScoringRequestOutput(f"{a.request_id}-{b.request_id}", ScoringOutput(s),
                                     a.prompt_token_ids + b.prompt_token_ids, True, a.metrics)
                for a, b, s in zip(firsts, seconds, scores)]
