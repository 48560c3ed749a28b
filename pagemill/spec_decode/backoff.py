"""The speculative back-off (a core.draft_policy.DraftPolicy): when drafting pays and when it does not.

No drafts while the running batch is `max_batch_size` or more (verification stops being free), nor for a request
whose recent acceptance is below the threshold: the configured `min_acceptance_rate`, or the measured cost of
proposing and verifying a draft token if higher (verify_cost.py). A poor request backs off for a while (doubling
while it stays poor), then tries again; once acceptance is poor engine-wide, new requests start backed off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagemill.config import SpeculativeConfig
from pagemill.spec_decode.verify_cost import VerifyCostModel

if TYPE_CHECKING:
    from pagemill.core.sched_output import ModelRunnerOutput, SchedulerOutput
    from pagemill.request import Request


class SpeculativeBackoff:
    """Engine-wide moving averages of draft acceptance and of what drafting costs, and each request's back-off."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        # Engine-wide moving averages: draft acceptance (a new request starts from it) and what proposing one draft
        # token costs relative to a target step (a draft model's forwards; ~0 for n-gram / suffix).
        self.spec_acceptance = 1.0
        self.draft_cost = 0.0
        # What a verified draft token costs at the batch size of the last verifying step (in plain-step units).
        self.verify_costs, self.verify_cost = VerifyCostModel(), 0.0
        self.num_steps = 0  # steps scheduled (the verification cost model's clock)
        self.spec_backoff_len = 0  # the last back-off's length: a new request starts with it while acceptance is poor

    def acceptance_threshold(self) -> float:
        """The draft acceptance rate below which speculation costs more than it gives: the measured costs of
        proposing a draft token and of verifying it at the current batch (in target steps), at least the configured
        minimum; a negative minimum turns the back-off off (every step then verifies its drafts)."""
        if self.config.min_acceptance_rate < 0:
            return self.config.min_acceptance_rate
        return max(self.config.min_acceptance_rate, self.draft_cost + self.verify_cost)

    def add_request(self, request: Request) -> None:
        """A new request starts backed off while drafts have been paying poorly engine-wide."""
        if self.spec_acceptance < self.acceptance_threshold():
            # ... and probes within its own length (the probes are what lift the engine-wide average: with requests
            # shorter than the back-off and no probe, one poor spell stopped speculation for good).
            wait = self.spec_backoff_len if request.max_tokens is None else min(self.spec_backoff_len,
                                                                                 request.max_tokens // 2)
            request.spec_backoff_len = request.spec_backoff_until = wait
            request.spec_acceptance = self.acceptance_threshold()

    def speculate_this_step(self, num_running: int) -> bool:
        """Drafts unless the batch is too large to verify for free, or the step is due to time a plain step."""
        speculate = num_running < self.config.max_batch_size
        self.num_steps += 1
        if speculate and self.verify_costs.plain_due(num_running, self.num_steps):
            speculate = False  # no drafts next step: it times the plain step the verification cost compares with
        return speculate

    def num_drafts(self, request: Request) -> int:
        """None while the request backs off after poor acceptance, else num_speculative_tokens."""
        if request.num_output_tokens < request.spec_backoff_until:
            return 0
        return self.config.num_speculative_tokens

    def step_done(self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput) -> None:
        """Fold in the step's draft cost and, for a decode-only step, its time (verify_cost.py)."""
        if output.draft_cost is not None:
            self.draft_cost = 0.8 * self.draft_cost + 0.2 * output.draft_cost
        if output.target_seconds is not None:
            self._measure_verify_cost(scheduler_output, output.target_seconds)

    def _measure_verify_cost(self, sched: SchedulerOutput, seconds: float) -> None:
        """Record a decode-only step's time (no prefill tokens in it) and, if it verified drafts, the cost of a draft
        token at its batch size."""
        batch = len(sched.num_scheduled_tokens)
        drafts = sum(len(d) for d in sched.scheduled_spec_decode_tokens.values())
        if not batch or sched.total_num_scheduled_tokens != batch + drafts:
            return
        self.verify_costs.record(batch + drafts, seconds, self.num_steps)
        if drafts:
            self.verify_cost = self.verify_costs.cost_per_draft(batch, drafts)

    def verified(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """Update the acceptance averages; back the request off while its acceptance is below the threshold."""
        rate, threshold = num_accepted / num_drafts, self.acceptance_threshold()
        self.spec_acceptance = 0.9 * self.spec_acceptance + 0.1 * rate
        # (slow enough that one rejected draft run among well-accepted ones does not cross a threshold near 0.5)
        request.spec_acceptance = 0.75 * request.spec_acceptance + 0.25 * rate
        if request.spec_acceptance < threshold:
            # Poor acceptance: no drafts for a while (doubling while it stays poor), then one more try, which
            # starts the next back-off at once if it is poor too.
            request.spec_backoff_len = self.spec_backoff_len = min(max(8, 2 * request.spec_backoff_len), 256)
            request.spec_backoff_until = request.num_output_tokens + request.spec_backoff_len
            request.spec_acceptance = threshold
        elif request.spec_acceptance >= 2 * threshold:
            request.spec_backoff_len = 0
