"""Messages between the front end and the engine core (msgspec structs: compact on the ZMQ wire)."""

from __future__ import annotations

import enum
import time

import msgspec

from pagemill.lora.request import LoRARequest
from pagemill.metrics.stats import SchedulerStats
from pagemill.pooling_params import PoolingParams
from pagemill.sampling_params import SamplingParams


class MultiModalFeature(msgspec.Struct, array_like=True, omit_defaults=True):
    """One image of a request, processed by the front end: its pixels for the vision encoder and where its
    placeholder tokens sit in the prompt (vLLM's MultiModalFeatureSpec)."""

    identifier: str  # content hash of the processed pixels: prefix-cache blocks over the placeholder are keyed by it
    offset: int  # index of the first placeholder token in the prompt
    length: int  # placeholder tokens (= rows of the encoder's output)
    data: bytes  # the processed pixel values, C order
    shape: list[int]
    dtype: str = "float32"
    modality: str = "image"
    grid_thw: list[int] | None = None  # (temporal, height, width) patches of a Qwen2-VL-family image (M-RoPE, ViT)


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A tokenized, validated request as the engine core receives it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    fork_of: str | None = None  # a sibling (n > 1) whose prompt blocks this sequence shares after its prefill
    lora_request: LoRARequest | None = None  # the adapter this request runs with (None: the base model)
    pooling_params: PoolingParams | None = None  # a pooling request (embed / classify / score): no tokens sampled
    token_type_ids: list[int] | None = None  # segment ids of an encoder's input (a cross-encoder's pair), else zeros
    mm_features: list[MultiModalFeature] | None = None  # the prompt's images, in placeholder order


class LogprobsLists(msgspec.Struct, array_like=True):
    """Logprobs for a run of positions: per position the chosen token first, then the top-N."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]  # rank of the chosen token at each position
    # Ranks of the tokens asked for by id (SamplingParams.logprob_token_ids), which end each position's list.
    extra_ranks: list[list[int]] = []

    def slice(self, start: int, stop: int | None = None) -> "LogprobsLists":
        """The positions [start, stop)."""
        return LogprobsLists(self.token_ids[start:stop], self.logprobs[start:stop], self.ranks[start:stop],
                             self.extra_ranks[start:stop])


class EngineCoreEventType(enum.IntEnum):
    """What happened to a request inside the engine core."""

    SCHEDULED = 1  # left the waiting queue (first time, after preemption, or a forked n > 1 sibling)
    PREEMPTED = 2


class EngineCoreEvent(msgspec.Struct, array_like=True):
    """A timestamped event (time.monotonic, comparable across processes on one host) of one request."""

    type: EngineCoreEventType
    timestamp: float

    @classmethod
    def new_event(cls, event_type: EngineCoreEventType, timestamp: float | None = None) -> "EngineCoreEvent":
        """An event stamped now (or at `timestamp`)."""
        return cls(event_type, time.monotonic() if timestamp is None else timestamp)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    events: list[EngineCoreEvent] | None = None  # since the request's previous output
    pooling_output: bytes | None = None  # a finished pooling request's vector (float32, little-endian)


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """Everything one engine step produced."""

    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
