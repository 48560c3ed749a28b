"""Table rows for a peer engine's own timings (llama-batched-bench's last row)."""

from __future__ import annotations

from typing import Any


def peer_rows(result: dict[str, Any]) -> list[tuple[str, Any]]:
    """Rows with llama-batched-bench's T_PP / S_PP / T_TG / S_TG of the last run, if present."""
    row = result.get("llama_batched_bench")
    if not row:
        return []
    return [("--llama-batched-bench, last run", ""),
            ("PP / TG / B", f"{row['pp']} / {row['tg']} / {row['pl']}"),
            ("T_PP prefill (s)", row["t_pp"]), ("S_PP prefill tok/s", row["speed_pp"]),
            ("T_TG decode (s)", row["t_tg"]), ("S_TG decode tok/s", row["speed_tg"])]
