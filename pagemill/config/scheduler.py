"""SchedulerConfig: per-step limits and the scheduling policy (core/sched_policy.py)."""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULING_POLICIES = ("fcfs", "priority", "srtf", "two-level")
PREEMPTION_MODES = ("recompute", "swap")


@dataclass
class SchedulerConfig:
    """Per-step limits and the scheduling policy; fields mean what the EngineArgs fields they come from say
    (policy: scheduling_policy, max_passed_over / staging_size: scheduling_max_passed_over / _staging_size)."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    policy: str = "fcfs"
    preemption_mode: str = "recompute"
    max_passed_over: int = 64
    staging_size: int = 8
    async_scheduling: bool = False  # engine/core.py step_with_batch_queue
    # An image larger than the budget still runs when it is the step's first.
    max_num_encoder_input_tokens: int | None = None
    # An image's placeholder run is computed in one step, never split over two (vLLM's disable_chunked_mm_input):
    # set for models whose image tokens attend bidirectionally within their image (Gemma 3).
    disable_chunked_mm_input: bool = False

    def __post_init__(self) -> None:
        if self.max_num_encoder_input_tokens is not None and self.max_num_encoder_input_tokens < 1:
            raise ValueError("max_num_encoder_input_tokens must be >= 1.")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}.")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.policy!r}.")
        if self.max_passed_over < 0:
            raise ValueError(f"scheduling_max_passed_over must be >= 0, got {self.max_passed_over}.")
        if self.staging_size < 1:
            raise ValueError(f"scheduling_staging_size must be >= 1, got {self.staging_size}.")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1.")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1.")
