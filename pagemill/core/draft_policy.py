"""What the scheduler asks of speculative decoding's policy (spec_decode/backoff.py implements it): whether a step
proposes drafts at all, how many each request gets, and what it learns from each step and each verification."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pagemill.core.sched_output import ModelRunnerOutput, SchedulerOutput
    from pagemill.request import Request


class DraftPolicy(Protocol):
    """Decides the draft tokens requests get per step; the scheduler only applies its answers."""

    def add_request(self, request: Request) -> None:
        """A new request arrived (it may start backed off)."""
        ...

    def speculate_this_step(self, num_running: int) -> bool:
        """Whether the step being scheduled (with `num_running` running requests) proposes drafts for the next."""
        ...

    def num_drafts(self, request: Request) -> int:
        """Draft tokens to propose for the request's next step (0: none)."""
        ...

    def step_done(self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput) -> None:
        """A step's output came back (its timings: what proposing and verifying drafts cost)."""
        ...

    def verified(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """The request's `num_drafts` drafts were verified and `num_accepted` of them accepted."""
        ...
