"""Human-readable result tables, the run environment, and JSON result files."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from typing import Any, Iterable

import numpy as np


def git_commit() -> str | None:
    """`git rev-parse HEAD` of the checkout this package lives in, or None."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def cpu_model() -> str | None:
    """CPU model name from /proc/cpuinfo (Linux), else platform.processor()."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def environment_info() -> dict[str, Any]:
    """Machine and software facts recorded with every result."""
    info: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        info["torch"] = None
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    from pagemill.env import collect_env

    info["pagemill_env"] = collect_env()
    return info


def config_dict(args: argparse.Namespace) -> dict[str, Any]:
    """Every parsed flag (JSON-safe) of a benchmark run."""
    return {k: v for k, v in sorted(vars(args).items()) if not callable(v)}


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    return str(obj)


def save_result(path: str, payload: dict[str, Any]) -> None:
    """Write `payload` as pretty JSON (infinite rates become the string "inf")."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_finite(payload), f, indent=2, default=_json_default)
        f.write("\n")


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and (obj != obj or obj in (float("inf"), float("-inf"))):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def format_table(title: str, rows: Iterable[tuple[str, Any]], width: int = 56) -> str:
    """A two-column table in the style of `vllm bench` output."""
    lines = [f"{' ' + title + ' ':=^{width}}"]
    for label, value in rows:
        if label.startswith("--"):
            lines.append(f"{' ' + label.strip('- ') + ' ':-^{width}}")
            continue
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label + ':':<{width - 16}}{text:>16}")
    lines.append("=" * width)
    return "\n".join(lines)


def check_machine_idle() -> float | None:
    """The 1-minute load average before a run; warn on stderr when it exceeds half the cores."""
    if not hasattr(os, "getloadavg"):
        return None
    load = os.getloadavg()[0]
    cores = os.cpu_count() or 1
    if load > 0.5 * cores:
        print(f"WARNING: load average {load:.1f} on {cores} cores before the run; other jobs "
              f"compete for the CPU and the numbers will be noisy", file=sys.stderr)
    return load
