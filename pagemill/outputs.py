"""Result objects returned to users, shaped like vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    import torch

_O = TypeVar("_O")


@dataclass
class Logprob:
    """The log-probability of one token, its rank in the distribution and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token plus the top-N).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        """True once the sequence stopped."""
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic) of a request's life, for latency metrics."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    """Everything the engine has produced for one request so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0


# ---- pooling models (vLLM's pooling outputs) ----
@dataclass
class PoolingOutput:
    """The pooler's vector of one request (an embedding, or a classifier's scores), float32."""

    data: torch.Tensor

    @classmethod
    def from_bytes(cls, raw: bytes) -> "PoolingOutput":
        """From the engine core's little-endian float32 bytes."""
        import torch

        return cls(torch.frombuffer(bytearray(raw), dtype=torch.float32))


@dataclass
class PoolingRequestOutput(Generic[_O]):
    """Everything a pooling request produced: its vector(s) in `outputs`."""

    request_id: str
    outputs: _O
    prompt_token_ids: list[int]
    finished: bool = True
    metrics: RequestMetrics | None = None


@dataclass
class EmbeddingOutput:
    """One embedding."""

    embedding: list[float]

    @classmethod
    def from_base(cls, output: PoolingOutput) -> "EmbeddingOutput":
        """The pooled vector as an embedding."""
        return cls(output.data.tolist())

    @property
    def hidden_size(self) -> int:
        """Its length."""
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    """The output of `LLM.embed` for one prompt (`.outputs.embedding`)."""

    @classmethod
    def from_base(cls, out: PoolingRequestOutput[PoolingOutput]) -> "EmbeddingRequestOutput":
        """From a generic pooling output."""
        return cls(out.request_id, EmbeddingOutput.from_base(out.outputs), out.prompt_token_ids, out.finished,
                   out.metrics)


@dataclass
class ClassificationOutput:
    """A classifier's class probabilities (or logits, with activation off)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        """How many classes."""
        return len(self.probs)


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    """The output of `LLM.classify` for one prompt (`.outputs.probs`)."""

    @classmethod
    def from_base(cls, out: PoolingRequestOutput[PoolingOutput]) -> "ClassificationRequestOutput":
        """From a generic pooling output."""
        return cls(out.request_id, ClassificationOutput(out.outputs.data.tolist()), out.prompt_token_ids,
                   out.finished, out.metrics)


@dataclass
class ScoringOutput:
    """The similarity or relevance score of one (text_1, text_2) pair."""

    score: float


@dataclass
class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    """The output of `LLM.score` for one pair (`.outputs.score`)."""
