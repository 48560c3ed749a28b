"""PoolerConfig (vLLM's): how a pooling model turns hidden states into one vector per request, and the runner names.

Resolving it from a model's files lives in pagemill/pooling/config.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagemill.utils.config_json import config_from_user

RUNNERS = ("auto", "generate", "pooling")
POOLING_TYPES = ("CLS", "MEAN", "LAST")
# Architectures that only pool, and their head: embed (hidden states) or classify (a classifier's logits). All are
# encoder-only (bidirectional attention, no KV cache).
POOLING_ARCHITECTURES = {"BertModel": "embed", "BertForSequenceClassification": "classify"}
# vLLM's older `task` argument: the runner each value implies.
TASK_RUNNERS = {"generate": "generate", "embed": "pooling", "embedding": "pooling", "classify": "pooling",
                "score": "pooling", "encode": "pooling", "reward": "pooling"}


@dataclass
class PoolerConfig:
    """How hidden states become one vector per request: pooling type and normalisation (the user's fields, the keys
    of --pooler-config), plus what the engine resolved about the model (its head, attention kind, Matryoshka
    support, length limit)."""

    pooling_type: str | None = None  # CLS | MEAN | LAST (None: the model's sentence-transformers Pooling or default)
    normalize: bool | None = None  # embeddings are L2-normalised unless a request says otherwise (None: model's)
    # Resolved by the engine, not user input:
    head: str = "embed"  # embed (pooled hidden states) | classify (a classifier's logits)
    encoder_only: bool = False  # bidirectional attention over the whole prompt, no KV cache
    is_matryoshka: bool = False  # `dimensions` may shorten embeddings
    matryoshka_dimensions: list[int] | None = None  # the allowed `dimensions` (None: any up to the hidden size)
    max_seq_length: int | None = None  # sentence-transformers' input limit (caps max_model_len)

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            self.pooling_type = str(self.pooling_type).upper()
            if self.pooling_type not in POOLING_TYPES:
                raise ValueError(f"pooler_config.pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                                 f"got {self.pooling_type!r}.")

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        """The pooling tasks requests may ask of this model."""
        return ("embed", "encode", "score") if self.head == "embed" else ("classify", "score", "encode")

    @classmethod
    def from_user(cls, value: dict[str, Any] | str | PoolerConfig | None) -> PoolerConfig:
        """From a dict, its JSON text (the CLI's --pooler-config) or a config; unknown keys raise a ValueError."""
        if value is None:
            return cls()
        if isinstance(value, PoolerConfig):
            return cls(pooling_type=value.pooling_type, normalize=value.normalize)
        return config_from_user(cls, value, "pooler_config", {"pooling_type", "normalize"})
