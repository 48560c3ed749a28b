"""Which CPU cores each worker rank runs on (vLLM's `VLLM_CPU_OMP_THREADS_BIND`)."""

from __future__ import annotations

import os

THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def _parse_cores(spec: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8]."""
    cores: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return cores


def rank_cores(world_size: int, bind: str | None = None) -> list[list[int] | None]:
    """Per rank, the cores to pin it to (None: not pinned).

    `bind` (default: $VLLM_CPU_OMP_THREADS_BIND, else "auto"): "auto" gives each rank an equal share of the cores
    this process may use (all of them, shared, when there are fewer cores than ranks); "nobind" pins nothing;
    otherwise one core list per rank separated by "|", e.g. "0-3|4-7".
    """
    bind = (bind if bind is not None else os.environ.get(THREADS_BIND_ENV, "auto")).strip() or "auto"
    if bind == "nobind":
        return [None] * world_size
    if bind == "auto":
        allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if not allowed:
            return [None] * world_size
        share = len(allowed) // world_size
        if share == 0:
            return [allowed] * world_size
        return [allowed[r * share:(r + 1) * share] for r in range(world_size)]
    try:
        per_rank = [_parse_cores(part) for part in bind.split("|")]
    except ValueError:
        raise ValueError(f"{THREADS_BIND_ENV} must be auto, nobind or core lists per rank like '0-3|4-7', "
                         f"got {bind!r}.") from None
    if len(per_rank) != world_size:
        raise ValueError(f"{THREADS_BIND_ENV}={bind!r} lists {len(per_rank)} ranks' cores; the engine has "
                         f"{world_size} ranks.")
    return per_rank


def pin_to_cores(cores: list[int] | None) -> int | None:
    """Pin this process to `cores` (where the OS allows it); returns how many threads that gives (None: unpinned)."""
    if cores is None:
        return None
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    return len(cores)
