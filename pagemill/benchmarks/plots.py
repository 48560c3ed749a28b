"""PNG plots of serving sweeps: normalized latency (and throughput) against request rate."""

from __future__ import annotations

import math
from typing import Any, Sequence


def _x_positions(rates: Sequence[float]) -> tuple[list[float], list[str]]:
    finite = [r for r in rates if math.isfinite(r)]
    inf_x = max(finite) * 1.5 if finite else 1.0
    xs = [r if math.isfinite(r) else inf_x for r in rates]
    labels = [f"{r:g}" if math.isfinite(r) else "inf" for r in rates]
    return xs, labels


def plot_sweep(series: dict[str, list[dict[str, Any]]], path: str, title: str = "") -> None:
    """Draw normalized latency and output throughput vs request rate, one line per target.

    `series` maps a label (e.g. "pagemill") to its runs; each run has `request_rate`,
    `normalized_latency_s_per_token` and `output_throughput`. An infinite rate is drawn to the
    right of the largest finite one and labelled "inf".
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_lat, ax_tput) = plt.subplots(1, 2, figsize=(11, 4.2))
    all_rates = sorted({float(run["request_rate"]) for runs in series.values() for run in runs})
    xs_all, labels_all = _x_positions(all_rates)
    x_of = dict(zip(all_rates, xs_all))
    for label, runs in series.items():
        runs = sorted(runs, key=lambda run: float(run["request_rate"]))
        xs = [x_of[float(run["request_rate"])] for run in runs]
        ax_lat.plot(xs, [run["normalized_latency_s_per_token"] for run in runs], "o-", label=label)
        ax_tput.plot(xs, [run["output_throughput"] for run in runs], "o-", label=label)
    for ax, ylabel in ((ax_lat, "normalized latency (s/token)"), (ax_tput, "output tokens/s")):
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.set_xticks(xs_all, labels_all)
        ax.grid(True, alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
