"""Serving metrics from per-request timestamps, with the definitions of `vllm bench serve`.

TTFT = first chunk - send; TPOT = (E2EL - TTFT) / (output tokens - 1), 0 for <= 1 token;
ITL = every gap between successive chunks, pooled over requests; E2EL = last chunk - send;
goodput = requests meeting every given SLO / duration; normalized latency (PagedAttention
paper) = mean over requests of E2EL / output tokens (its distribution, in ms per token, too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    """What the client observed for one request (times in seconds, perf_counter clock)."""

    send_time: float
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_len: int = 0
    success: bool = False
    error: str = ""
    generated_text: str = ""

    @property
    def ttft(self) -> float:
        """Time to first chunk (s)."""
        return self.chunk_times[0] - self.send_time

    @property
    def e2el(self) -> float:
        """End-to-end latency up to the last chunk (s)."""
        return self.chunk_times[-1] - self.send_time

    @property
    def tpot(self) -> float:
        """Time per output token after the first (s); 0 when at most one token was produced."""
        if self.output_tokens <= 1:
            return 0.0
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between successive chunks (s)."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def summarize(values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean/median/std/pXX of a list of seconds, reported in milliseconds (zeros when empty)."""
    arr = np.asarray(values_s, dtype=np.float64) * 1000.0
    out = {"mean": 0.0, "median": 0.0, "std": 0.0}
    out.update({f"p{_fmt(p)}": 0.0 for p in percentiles})
    if arr.size:
        out.update(mean=float(arr.mean()), median=float(np.median(arr)), std=float(arr.std()))
        out.update({f"p{_fmt(p)}": float(np.percentile(arr, p)) for p in percentiles})
    return out


def _fmt(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """Parse `--goodput ttft:MS tpot:MS e2el:MS` into {metric: milliseconds}."""
    slos: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput expects ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        ms = float(value)
        if ms <= 0:
            raise ValueError(f"--goodput {name} SLO must be positive, got {value}")
        slos[name] = ms
    return slos


def meets_slos(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    """True when the request's TTFT/TPOT/E2EL are all within the given SLOs (ms)."""
    values = {"ttft": result.ttft, "tpot": result.tpot, "e2el": result.e2el}
    return all(values[name] * 1000.0 <= limit for name, limit in slos_ms.items())


def normalized_latencies(results: Sequence[RequestResult]) -> list[float]:
    """E2EL / output tokens (s/token) of every request that produced a token."""
    return [r.e2el / r.output_tokens for r in results if r.output_tokens > 0]


def normalized_latency(results: Sequence[RequestResult]) -> float:
    """PagedAttention paper's normalized latency: mean of E2EL / output tokens (s/token)."""
    ratios = normalized_latencies(results)
    return float(np.mean(ratios)) if ratios else 0.0


def compute_metrics(results: Sequence[RequestResult], duration_s: float,
                    percentiles: Sequence[float] = (99,),
                    goodput_slos_ms: dict[str, float] | None = None) -> dict[str, object]:
    """All serving metrics for one run; only successful requests with a chunk enter latencies."""
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    ok = [r for r in results if r.success and r.chunk_times]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    metrics: dict[str, object] = {
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "input_throughput": input_tokens / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "normalized_latency_s_per_token": normalized_latency(ok),
        "normalized_latency_ms": summarize(normalized_latencies(ok), percentiles),  # ms per output token
        "ttft_ms": summarize([r.ttft for r in ok], percentiles),
        "tpot_ms": summarize([r.tpot for r in ok if r.output_tokens > 1], percentiles),
        "itl_ms": summarize([gap for r in ok for gap in r.itls], percentiles),
        "e2el_ms": summarize([r.e2el for r in ok], percentiles),
    }
    if goodput_slos_ms:
        good = sum(meets_slos(r, goodput_slos_ms) for r in ok)
        metrics["goodput_slos_ms"] = dict(goodput_slos_ms)
        metrics["request_goodput"] = good / duration_s
    return metrics
