"""Speculative decoding figures from the engine's cumulative SpecDecodingStats: interval deltas and rates."""

from __future__ import annotations

from typing import Any

from pagemill.metrics.stats import SpecDecodingStats


def spec_delta(now: SpecDecodingStats, before: SpecDecodingStats | None) -> SpecDecodingStats:
    """What happened between two cumulative snapshots (all of `now` if there is no earlier one or the
    counters went back, as after an engine restart)."""
    if before is None or now.num_drafts < before.num_drafts or now.num_draft_tokens < before.num_draft_tokens:
        return SpecDecodingStats(num_spec_tokens=now.num_spec_tokens, num_drafts=now.num_drafts,
                                 num_draft_tokens=now.num_draft_tokens, num_accepted_tokens=now.num_accepted_tokens,
                                 num_accepted_tokens_per_pos=list(now.num_accepted_tokens_per_pos))
    old_pos = before.num_accepted_tokens_per_pos
    per_pos = [n - (old_pos[i] if i < len(old_pos) else 0) for i, n in enumerate(now.num_accepted_tokens_per_pos)]
    return SpecDecodingStats(num_spec_tokens=now.num_spec_tokens, num_drafts=now.num_drafts - before.num_drafts,
                             num_draft_tokens=now.num_draft_tokens - before.num_draft_tokens,
                             num_accepted_tokens=now.num_accepted_tokens - before.num_accepted_tokens,
                             num_accepted_tokens_per_pos=per_pos)


def draft_acceptance_rate(stats: SpecDecodingStats) -> float:
    """Accepted draft tokens / proposed draft tokens (0 when nothing was proposed)."""
    return stats.num_accepted_tokens / stats.num_draft_tokens if stats.num_draft_tokens else 0.0


def per_position_acceptance(stats: SpecDecodingStats) -> list[float]:
    """For each draft position i, the fraction of drafts whose token i was accepted (vLLM's definition)."""
    return [n / stats.num_drafts if stats.num_drafts else 0.0 for n in stats.num_accepted_tokens_per_pos]


def spec_summary(stats: SpecDecodingStats) -> dict[str, Any]:
    """The counters and derived rates as a JSON-ready dict (for `bench` results)."""
    return {"num_speculative_tokens": stats.num_spec_tokens, "num_drafts": stats.num_drafts,
            "num_draft_tokens": stats.num_draft_tokens, "num_accepted_tokens": stats.num_accepted_tokens,
            "mean_acceptance_length": stats.mean_acceptance_length,
            "draft_acceptance_rate": draft_acceptance_rate(stats),
            "per_position_acceptance_rate": per_position_acceptance(stats)}


def spec_log_line(stats: SpecDecodingStats, elapsed_s: float) -> str:
    """vLLM's `SpecDecoding metrics: ...` line for the drafts of an interval of `elapsed_s` seconds."""
    elapsed = max(elapsed_s, 1e-9)
    rates = ", ".join(f"{r:.3f}" for r in per_position_acceptance(stats))
    return ("SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s, "
            "Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, "
            "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%") % (
        stats.mean_acceptance_length, stats.num_accepted_tokens / elapsed, stats.num_draft_tokens / elapsed,
        stats.num_accepted_tokens, stats.num_draft_tokens, rates, 100 * draft_acceptance_rate(stats))
