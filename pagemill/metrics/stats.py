"""Per-iteration request statistics the front end gathers from engine outputs (for /metrics and logs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import msgspec


class SpecDecodingStats(msgspec.Struct, omit_defaults=True):
    """Speculative decoding counters since the engine started (vLLM's names)."""

    num_spec_tokens: int = 0  # k: draft positions tracked per position below
    num_drafts: int = 0  # verification steps of a request that had draft tokens
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)  # [k]: drafts accepted at position i

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens produced per verification step of a drafted request: 1 + accepted drafts per draft."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


class SchedulerStats(msgspec.Struct, omit_defaults=True):
    """Snapshot of the scheduler and KV cache after a step (for logs and /metrics)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    memory: dict[str, float] | None = None  # KV memory accounting (blocks shared, fragmentation, saving)
    num_blocks_total: int = 0
    num_blocks_free: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_swapped_reqs: int = 0
    num_swapped_out: int = 0  # preemptions by swapping (counter)
    num_swap_blocks_total: int = 0
    num_swap_blocks_free: int = 0
    num_cow_copies: int = 0  # copy-on-write block copies (counter)
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    external_prefix_cache_queries: int = 0  # KV connector lookups, in tokens (counter)
    external_prefix_cache_hits: int = 0  # tokens whose KV a connector loaded instead of computing them (counter)
    spec_decoding: SpecDecodingStats | None = None  # with speculative decoding on


@dataclass
class FinishedRequestStats:
    """One sequence that finished normally (not aborted)."""

    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class IterationStats:
    """What one batch of engine outputs did, seen from the front end."""

    num_prompt_tokens: int = 0  # prompts of sequences that got their first token in this batch
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    queue_times: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


class StatLogger(Protocol):
    """Receives the stats of every output batch."""

    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats, now: float,
               engine_idx: int = 0) -> None:
        """Account one batch of outputs (of data-parallel engine `engine_idx`)."""
        ...
