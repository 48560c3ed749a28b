"""The engine core's view of a request: tokens, progress counters, status."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from pagemill.lora.request import LoRARequest
from pagemill.messages import EngineCoreEvent, EngineCoreEventType, EngineCoreRequest, MultiModalFeature
from pagemill.pooling_params import PoolingParams
from pagemill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagemill.structured_output.request import StructuredOutputRequest


class RequestStatus(enum.IntEnum):
    """Where a request is in its life."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    WAITING_FOR_FSM = 6  # waiting for its structured-output grammar to compile

    @property
    def finished(self) -> bool:
        """True for the three finished states."""
        return RequestStatus.FINISHED_STOPPED <= self <= RequestStatus.FINISHED_ABORTED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI finish_reason of a finished status."""
        return {3: "stop", 4: "length", 5: "abort"}.get(int(self))


class Request:
    """One sequence being generated; `num_computed_tokens` catches up with `num_tokens` step by step."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_id: int | None, arrival_time: float, priority: int = 0,
                 cache_salt: str | None = None, fork_of: str | None = None,
                 lora_request: LoRARequest | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.fork_of = fork_of
        self.lora_request = lora_request
        self.lora_int_id = lora_request.lora_int_id if lora_request is not None else 0  # 0: the base model
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.num_cached_tokens = -1  # prefix-cache hit length at first scheduling
        self.num_prompt_logprobs_sent = 0  # prompt positions whose logprobs went out (a recompute repeats them)
        self.block_hashes: list[int] = []
        self.max_tokens = sampling_params.max_tokens
        self.events: list[EngineCoreEvent] = []  # not yet sent to the front end
        self.swapped_blocks: list[int] | None = None  # swap block ids while swapped out
        self.structured_output: StructuredOutputRequest | None = None  # its grammar matcher (set by the engine core)
        # Async scheduling: tokens of steps in flight, scheduled but not sampled yet (vLLM's num_output_placeholders).
        self.num_output_placeholders = 0
        self.spec_token_ids: list[int] = []  # draft tokens proposed for the next step (speculative decoding)
        self.spec_acceptance = 1.0  # moving average of the fraction of its draft tokens accepted
        self.spec_backoff_until = 0  # no drafts before this many outputs (poor acceptance)
        self.spec_backoff_len = 0  # the current back-off's length (doubles while acceptance stays poor)
        # srtf aging (core/sched_policy.py): (admissions counted, queue order) when the request was first queued.
        self.first_queued: tuple[int, int] | None = None
        # A pooling request (set from the EngineCoreRequest by the engine core): finishes when its prompt is computed.
        self.pooling_params: PoolingParams | None = None
        self.token_type_ids: list[int] | None = None  # an encoder's segment ids (None: all zeros)
        self.mm_features: list[MultiModalFeature] | None = None  # the prompt's images (set by the engine core)
        self.num_images_scheduled = 0  # its images (in order) whose encoder run a step has been given

    @classmethod
    def from_engine_core_request(cls, r: EngineCoreRequest) -> "Request":
        """Build from the wire message."""
        return cls(r.request_id, r.prompt_token_ids, r.sampling_params, r.eos_token_id, r.arrival_time,
                   r.priority, r.cache_salt, r.fork_of, r.lora_request)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """Tokens including the draft tokens proposed for the next step."""
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        """Record a sampled token."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def record_event(self, event_type: EngineCoreEventType, timestamp: float | None = None) -> None:
        """Note an event for the request's next output."""
        self.events.append(EngineCoreEvent.new_event(event_type, timestamp))

    def take_events(self) -> list[EngineCoreEvent] | None:
        """The events recorded since the last call, or None."""
        if not self.events:
            return None
        events, self.events = self.events, []
        return events

    def __lt__(self, other: "Request") -> bool:  # heap order for the priority policy
        return (self.priority, self.arrival_time) < (other.priority, other.arrival_time)
