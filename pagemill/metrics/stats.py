"""Per-iteration request statistics the front end gathers from engine outputs (for /metrics and logs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import msgspec


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

    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats, now: float) -> None:
        """Account one batch of outputs."""
        ...
