"""What verifying draft tokens costs, measured: decode-step seconds by the step's token count, and from them the
price of one verified draft token relative to a plain step of the same batch (the back-off's verification term).

Verification is nearly free only while a step is bound by reading the weights: on two cores a Q4_1 step over 20
rows (4 requests, 4 drafts each) cost 2.9x one over 4 rows (23.4 vs 8.0 ms), so 45% acceptance lost 8% there while
it wins at batch 1. A draft token pays when its acceptance rate exceeds (T(B + D) / T(B) - 1) B / D for a step of B requests
and D drafts: the extra seconds of the D rows over the plain step's, per draft, in plain-step units. While every
step verifies, plain steps are never measured: the scheduler then leaves one step in PLAIN_PROBE_EVERY without
proposals (`plain_due`), so T(B) is known and fresh.
"""

from __future__ import annotations

import bisect

PLAIN_PROBE_EVERY = 64  # steps between two steps left without drafts to time the plain step
PLAIN_STALE_STEPS = 512  # a plain step's time older than this many steps is measured again


class VerifyCostModel:
    """Moving averages of decode-only step seconds keyed by the step's token count (interpolated where unmeasured),
    and the relative cost of a draft token they imply."""

    def __init__(self, decay: float = 0.8) -> None:
        self.decay = decay
        self.counts: list[int] = []  # token counts measured, sorted
        self.seconds: dict[int, float] = {}
        self.recorded_at: dict[int, int] = {}  # the step of each count's last measurement
        self.last_probe = -PLAIN_PROBE_EVERY

    def record(self, num_tokens: int, seconds: float, step: int = 0) -> None:
        """One decode-only step (no prefill tokens) of `num_tokens` tokens, drafts included, took `seconds`."""
        if num_tokens <= 0 or seconds <= 0:
            return
        self.recorded_at[num_tokens] = step
        old = self.seconds.get(num_tokens)
        if old is None:
            bisect.insort(self.counts, num_tokens)
            self.seconds[num_tokens] = seconds
        else:
            self.seconds[num_tokens] = self.decay * old + (1 - self.decay) * seconds

    def step_seconds(self, num_tokens: int) -> float | None:
        """The measured step seconds at `num_tokens`, else linearly interpolated between measured counts, beyond the
        largest the largest's, below the smallest extrapolated from the two smallest (no less than proportional:
        while every step verifies drafts, plain steps are never measured); None from a single count below."""
        i = bisect.bisect_right(self.counts, num_tokens)
        if i == 0:
            if len(self.counts) < 2:
                return None
            c0, c1 = self.counts[0], self.counts[1]
            t0, t1 = self.seconds[c0], self.seconds[c1]
            return max(t0 - (t1 - t0) * (c0 - num_tokens) / (c1 - c0), t0 * num_tokens / c0)
        lo = self.counts[i - 1]
        if lo == num_tokens or i == len(self.counts):
            return self.seconds[lo]
        hi = self.counts[i]
        t_lo, t_hi = self.seconds[lo], self.seconds[hi]
        return t_lo + (t_hi - t_lo) * (num_tokens - lo) / (hi - lo)

    def cost_per_draft(self, batch: int, drafts: int) -> float:
        """Seconds one of `drafts` draft tokens adds to a step of `batch` requests, in units of one request's share of
        the plain step: (T(batch + drafts) / T(batch) - 1) * batch / drafts; 0 until both are known."""
        if drafts <= 0 or batch <= 0:
            return 0.0
        plain, verify = self.step_seconds(batch), self.seconds.get(batch + drafts)
        if plain is None or verify is None:
            return 0.0
        return max(0.0, (verify / plain - 1.0) * batch / drafts)

    def plain_due(self, batch: int, step: int) -> bool:
        """Whether step `step` should propose no drafts, so that the next one times a plain step of `batch` requests
        (and if so, records it as the last probe): verifying steps of more tokens were timed, its own time is unknown
        or stale, and the last probe is PLAIN_PROBE_EVERY steps back."""
        if batch <= 0 or not self.counts or self.counts[-1] <= batch or step - self.last_probe < PLAIN_PROBE_EVERY:
            return False
        if batch in self.seconds and step - self.recorded_at[batch] <= PLAIN_STALE_STEPS:
            return False
        self.last_probe = step
        return True
