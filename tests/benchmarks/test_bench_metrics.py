"""Metric math of `bench serve` on hand-built timestamps."""

import math

import pytest

from pagemill.benchmarks.metrics import (RequestResult, compute_metrics, meets_slos,
                                         normalized_latency, parse_goodput, summarize)


def req(send: float, chunks: list[float], tokens: int | None = None, prompt_len: int = 10,
        success: bool = True) -> RequestResult:
    return RequestResult(send_time=send, chunk_times=chunks,
                         output_tokens=len(chunks) if tokens is None else tokens,
                         prompt_len=prompt_len, success=success)


def test_ttft_e2el_tpot_itl_of_one_request():
    r = req(10.0, [10.5, 10.7, 11.0, 11.6])
    assert r.ttft == pytest.approx(0.5)
    assert r.e2el == pytest.approx(1.6)
    # TPOT excludes the first token: (1.6 - 0.5) / 3
    assert r.tpot == pytest.approx(1.1 / 3)
    assert r.itls == pytest.approx([0.2, 0.3, 0.6])


def test_tpot_uses_usage_token_count_not_chunks():
    # 2 chunks but the server's usage reported 5 tokens (multi-token chunks)
    r = req(0.0, [1.0, 3.0], tokens=5)
    assert r.tpot == pytest.approx(2.0 / 4)


def test_tpot_is_zero_for_single_token():
    assert req(0.0, [0.3]).tpot == 0.0
    assert req(0.0, [0.3], tokens=0).tpot == 0.0


def test_compute_metrics_pools_itl_and_skips_failures():
    a = req(0.0, [1.0, 2.0, 4.0], prompt_len=100)          # itl 1, 2
    b = req(1.0, [1.5, 1.6], prompt_len=50)                 # itl 0.1
    bad = req(0.0, [], success=False, prompt_len=999)
    m = compute_metrics([a, b, bad], duration_s=4.0, percentiles=[50, 99])
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_input_tokens"] == 150 and m["total_output_tokens"] == 5
    assert m["request_throughput"] == pytest.approx(0.5)
    assert m["output_throughput"] == pytest.approx(5 / 4)
    assert m["total_token_throughput"] == pytest.approx(155 / 4)
    assert m["itl_ms"]["mean"] == pytest.approx((1000 + 2000 + 100) / 3)
    assert m["itl_ms"]["median"] == pytest.approx(1000)
    assert m["ttft_ms"]["mean"] == pytest.approx((1000 + 500) / 2)
    assert m["e2el_ms"]["mean"] == pytest.approx((4000 + 600) / 2)
    # tpot: a = (4-1)/2 = 1.5 s, b = (0.6-0.5)/1 = 0.1 s
    assert m["tpot_ms"]["mean"] == pytest.approx(800)
    assert m["tpot_ms"]["p99"] == pytest.approx(100 + 0.99 * 1400)


def test_tpot_summary_ignores_single_token_requests():
    m = compute_metrics([req(0.0, [1.0, 2.0]), req(0.0, [5.0])], duration_s=1.0)
    assert m["tpot_ms"]["mean"] == pytest.approx(1000)


def test_normalized_latency_is_mean_of_ratios():
    a = req(0.0, [1.0, 2.0, 3.0, 4.0])    # 4 s / 4 tokens = 1
    b = req(0.0, [0.5, 1.0])              # 1 s / 2 tokens = 0.5
    assert normalized_latency([a, b]) == pytest.approx(0.75)
    # not total latency / total tokens (= 5/6)
    assert not math.isclose(normalized_latency([a, b]), 5 / 6)
    assert compute_metrics([a, b], 4.0)["normalized_latency_s_per_token"] == pytest.approx(0.75)


def test_goodput_counts_requests_meeting_every_slo():
    fast = req(0.0, [0.1, 0.2, 0.3])       # ttft 100 ms, tpot 100 ms, e2el 300 ms
    slow_start = req(0.0, [0.9, 1.0])      # ttft 900 ms
    slow_decode = req(0.0, [0.1, 1.1])     # tpot 1000 ms
    slos = parse_goodput(["ttft:500", "tpot:200"])
    assert slos == {"ttft": 500.0, "tpot": 200.0}
    assert [meets_slos(r, slos) for r in (fast, slow_start, slow_decode)] == [True, False, False]
    m = compute_metrics([fast, slow_start, slow_decode], duration_s=2.0, goodput_slos_ms=slos)
    assert m["request_goodput"] == pytest.approx(0.5)
    m = compute_metrics([fast, slow_start, slow_decode], 2.0, goodput_slos_ms={"e2el": 1000})
    assert m["request_goodput"] == pytest.approx(1.0)
    assert "request_goodput" not in compute_metrics([fast], 1.0)


@pytest.mark.parametrize("bad", ["ttft", "foo:10", "ttft:-1", "tpot:0"])
def test_goodput_rejects_malformed_slos(bad):
    with pytest.raises(ValueError):
        parse_goodput([bad])


def test_summarize_empty_and_units():
    assert summarize([], [99]) == {"mean": 0.0, "median": 0.0, "std": 0.0, "p99": 0.0}
    s = summarize([0.001, 0.003], [50, 99.9])
    assert s["mean"] == pytest.approx(2.0) and s["std"] == pytest.approx(1.0)
    assert set(s) == {"mean", "median", "std", "p50", "p99.9"}


def test_duration_must_be_positive():
    with pytest.raises(ValueError):
        compute_metrics([], 0.0)
