"""PNG plots of serving runs: normalized latency (and throughput) against request rate; the KV accounting over a run."""

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


def plot_kv_metrics(runs: Sequence[tuple[str, list[dict[str, float]]]], path: str, title: str = "") -> None:
    """The KV accounting over each run (one row per run, from `bench serve --kv-metrics-plot`'s samples).

    Left: the cache's slots as the PagedAttention paper's Fig. 2 divides them (token states, internal
    fragmentation, reservation, free), in percent of all slots. Middle: blocks shared and the memory that sharing
    saves. Right: the prefix-cache hit rate between samples and since the server started.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(label, samples) for label, samples in runs if samples]
    if not rows:
        raise ValueError("no KV samples to plot (is the server pagemill, with /metrics?)")
    fig, axes = plt.subplots(len(rows), 3, figsize=(15, 3.6 * len(rows)), squeeze=False)
    for (label, samples), (ax_mem, ax_share, ax_hit) in zip(rows, axes):
        t = [s["t"] for s in samples]
        total = [max(s["kv_cache_total_slots"], 1.0) for s in samples]
        parts = {name: [100 * s[key] / n for s, n in zip(samples, total)] for name, key in (
            ("token states", "kv_cache_token_slots"), ("internal fragmentation", "kv_cache_fragmented_slots"),
            ("reservation", "kv_cache_reserved_slots"))}
        used = [sum(p) for p in zip(*parts.values())]
        ax_mem.stackplot(t, *parts.values(), [100 - u for u in used], labels=[*parts, "free"],
                         colors=["tab:blue", "tab:red", "tab:orange", "0.9"])
        ax_mem.set_ylim(0, 100)
        ax_mem.set_ylabel("KV cache slots (%)")
        ax_mem.set_title(f"{label}: KV slots")
        ax_mem.legend(loc="upper right", fontsize=8)
        ax_share.plot(t, [s["kv_cache_shared_blocks"] for s in samples], color="tab:green", label="blocks shared")
        ax_share.set_ylabel("blocks shared")
        ax_saved = ax_share.twinx()
        ax_saved.plot(t, [s["kv_cache_sharing_saved_bytes"] / 2**20 for s in samples], color="tab:purple",
                      linestyle="--", label="saved by sharing")
        ax_saved.set_ylabel("MiB saved by sharing")
        ax_share.set_title(f"{label}: block sharing")
        ax_share.legend(loc="upper left", fontsize=8)
        ax_saved.legend(loc="upper right", fontsize=8)
        interval = [math.nan]
        for a, b in zip(samples, samples[1:]):
            queries = b["prefix_cache_queries"] - a["prefix_cache_queries"]
            interval.append(100 * (b["prefix_cache_hits"] - a["prefix_cache_hits"]) / queries if queries > 0
                            else math.nan)
        ax_hit.plot(t, interval, ".", color="tab:blue", label="between samples")
        ax_hit.plot(t, [100 * s["kv_cache_prefix_hit_rate"] for s in samples], color="tab:gray",
                    label="since start")
        ax_hit.set_ylim(0, 100)
        ax_hit.set_ylabel("prefix-cache hit rate (%)")
        ax_hit.set_title(f"{label}: prefix cache")
        ax_hit.legend(loc="upper right", fontsize=8)
        for ax in (ax_mem, ax_share, ax_hit):
            ax.set_xlabel("time (s)")
            ax.grid(True, alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
