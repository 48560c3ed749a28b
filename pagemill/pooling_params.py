"""Pooling parameters of a request (embed, classify, score, encode), named and validated as in vLLM."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagemill.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from pagemill.config.pooling import PoolerConfig

POOLING_TASKS = ("embed", "classify", "score", "encode")


@dataclass
class PoolingParams:
    """How to pool one request's hidden states: vLLM's PoolingParams fields.

    `dimensions` keeps the first N values of the embedding and renormalises (Matryoshka); only for models whose
    config declares Matryoshka training (`is_matryoshka` / `matryoshka_dimensions`), as vLLM does.
    `truncate_prompt_tokens`: k keeps k tokens of an over-long input (-1: max_model_len); None rejects it.
    """

    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None  # embeddings: L2-normalise (None: the model's default)
    activation: bool | None = None  # classify / score: sigmoid (one label) or softmax (None: yes)
    task: str | None = None  # embed | classify | score | encode (set by LLM.embed / score / ...; None: encode)

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}.")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}.")
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens must be a positive integer or -1, got {t!r}.")

    @property
    def output_kind(self) -> RequestOutputKind:
        """A pooling request reports once, when it finishes."""
        return RequestOutputKind.FINAL_ONLY

    def clone(self, **changes: object) -> "PoolingParams":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def verify(self, pooler_config: "PoolerConfig", hidden_size: int) -> "PoolingParams":
        """Check the request against the model; returns a copy with `task` resolved (ValueError naming the field)."""
        task = self.task or "encode"
        supported = pooler_config.supported_tasks
        if task not in supported:
            raise ValueError(f"task {task!r} is not supported by this model (supported: {', '.join(supported)}).")
        if self.dimensions is not None:
            if pooler_config.head != "embed":
                raise ValueError("dimensions applies to embeddings only; this model classifies.")
            if not pooler_config.is_matryoshka:
                raise ValueError("dimensions: this model does not support Matryoshka representations, so its "
                                 "embeddings cannot be shortened; leave dimensions unset.")
            allowed = pooler_config.matryoshka_dimensions
            if allowed and self.dimensions not in allowed:
                raise ValueError(f"dimensions must be one of {allowed} for this model, got {self.dimensions}.")
            if self.dimensions > hidden_size:
                raise ValueError(f"dimensions must be at most the embedding size ({hidden_size}), "
                                 f"got {self.dimensions}.")
        return self if self.task == task else self.clone(task=task)
