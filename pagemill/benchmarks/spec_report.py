"""Speculative decoding rows of the `bench` tables (from the engine's counters, see PagemillBackend.spec_decoding)."""

from __future__ import annotations

from typing import Any


def backend_spec_decoding(backend: Any) -> dict[str, Any]:
    """`{"spec_decoding": summary}` for a backend that speculated, else {} (for merging into its result)."""
    spec = getattr(backend, "spec_decoding", None)
    summary = spec() if callable(spec) else None
    return {"spec_decoding": summary} if summary else {}


def format_rates(rates: list[float]) -> str:
    """Per-position acceptance rates as '0.81, 0.62, ...'."""
    return ", ".join(f"{r:.2f}" for r in rates)


def spec_rows(result: dict[str, Any]) -> list[tuple[str, Any]]:
    """Table rows for a result's `spec_decoding` summary (none when the run did not speculate)."""
    spec = result.get("spec_decoding")
    if not spec:
        return []
    return [("--speculative decoding", ""),
            ("Drafts / draft tokens", f"{spec['num_drafts']} / {spec['num_draft_tokens']}"),
            ("Accepted draft tokens", spec["num_accepted_tokens"]),
            ("Mean acceptance length", float(spec["mean_acceptance_length"])),
            ("Draft acceptance rate (%)", 100.0 * spec["draft_acceptance_rate"]),
            ("Per-position acceptance", format_rates(spec["per_position_acceptance_rate"]))]
