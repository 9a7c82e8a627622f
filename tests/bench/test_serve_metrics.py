"""Metric math of `bench serve` against hand-computed values (no server, no model)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from sparseserve.bench import serve_prometheus
from sparseserve.bench.serve_metrics import (aggregate, parse_goodput, parse_percentile_metrics,
                                             parse_percentiles)
from sparseserve.bench.serve_runner import arrival_offsets
from sparseserve.bench.serve_types import RequestResult


def constructed() -> list[RequestResult]:
    return [
        # TPOT (0.3 - 0.1) / 3 = 66.67 ms
        RequestResult(success=True, ttft=0.1, itl=[0.05, 0.05, 0.1], latency=0.3, prompt_len=10, output_len=4),
        # TPOT (0.4 - 0.2) / 1 = 200 ms
        RequestResult(success=True, ttft=0.2, itl=[0.1], latency=0.4, prompt_len=20, output_len=2),
        # one output token: no TPOT
        RequestResult(success=True, ttft=0.5, itl=[], latency=0.5, prompt_len=30, output_len=1),
        RequestResult(success=False, latency=0.05, prompt_len=40, error="HTTP 400: bad"),
    ]


def test_aggregate_hand_computed():
    out = aggregate(constructed(), duration=2.0, percentile_metrics=("ttft", "tpot", "itl", "e2el"),
                    percentiles=(50, 90, 99), goodput={"ttft": 250, "tpot": 100})
    approx = lambda v: pytest.approx(v, rel=1e-9, abs=1e-9)  # noqa: E731
    assert out["completed"] == 3 and out["failed"] == 1
    assert out["total_input_tokens"] == 60 and out["total_output_tokens"] == 7
    assert out["request_throughput"] == approx(1.5)
    assert out["output_throughput"] == approx(3.5)
    assert out["total_token_throughput"] == approx(33.5)
    # TTFT 100, 200, 500 ms
    assert out["mean_ttft_ms"] == approx(800 / 3)
    assert out["median_ttft_ms"] == approx(200)
    assert out["std_ttft_ms"] == approx(math.sqrt((166.6666666667 ** 2 + 66.6666666667 ** 2
                                                   + 233.3333333333 ** 2) / 3))
    assert out["p50_ttft_ms"] == approx(200)
    assert out["p90_ttft_ms"] == approx(440)  # linear: 200 + 0.8 * (500 - 200)
    # TPOT 66.67 and 200 ms (the one-token request has none)
    assert out["mean_tpot_ms"] == approx((200 / 3 + 200) / 2)
    assert out["p99_tpot_ms"] == approx(200 / 3 + 0.99 * (200 - 200 / 3))
    # ITL pooled: 50, 50, 100, 100 ms
    assert out["mean_itl_ms"] == approx(75) and out["median_itl_ms"] == approx(75)
    assert out["p99_itl_ms"] == approx(100)
    assert out["mean_e2el_ms"] == approx(400) and out["p50_e2el_ms"] == approx(400)
    # good: only the first (the second misses TPOT, the third TTFT)
    assert out["request_goodput"] == approx(0.5)
    assert out["errors"] == ["", "", "", "HTTP 400: bad"]
    assert out["ttfts"][3] is None and out["e2els"] == [0.3, 0.4, 0.5, None]
    assert out["input_lens"] == [10, 20, 30, 40] and out["output_lens"] == [4, 2, 1, 0]


def test_goodput_edge_cases_and_percentile_selection():
    rs = constructed()
    # a request without a TPOT (one output token) meets any TPOT SLO
    assert aggregate(rs, 2.0, goodput={"tpot": 100})["request_goodput"] == pytest.approx(1.0)
    assert aggregate(rs, 2.0, goodput={"e2el": 400})["request_goodput"] == pytest.approx(1.0)
    assert aggregate(rs, 2.0)["request_goodput"] is None
    out = aggregate(rs, 2.0, percentile_metrics=("ttft",), percentiles=(99.9,))
    assert "p99.9_ttft_ms" in out and "p99.9_itl_ms" not in out and "mean_itl_ms" in out
    empty = aggregate([RequestResult(success=False, error="x")], 1.0, percentiles=(99,))
    assert empty["completed"] == 0 and empty["mean_ttft_ms"] is None and empty["p99_tpot_ms"] is None


def test_parse_errors_say_what_to_do():
    assert parse_goodput(["ttft:500", "TPOT:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    for bad in (["foo"], ["ttft"], ["ttft:abc"], ["itl:5"], ["e2el:-1"]):
        with pytest.raises(ValueError, match="KEY:MILLISECONDS"):
            parse_goodput(bad)
    assert parse_percentile_metrics("ttft, e2el") == ["ttft", "e2el"]
    with pytest.raises(ValueError, match="ttft, tpot, itl, e2el"):
        parse_percentile_metrics("ttft,tbt")
    assert parse_percentiles("50,99.9") == [50.0, 99.9]
    for bad in ("0", "101", "p99", ""):
        with pytest.raises(ValueError, match=r"\(0, 100\]"):
            parse_percentiles(bad)


def test_arrivals_poisson_gamma_and_inf():
    assert np.array_equal(arrival_offsets(5, math.inf), np.zeros(5))
    a = arrival_offsets(20001, 4.0, 1.0, seed=3)
    assert np.array_equal(a, arrival_offsets(20001, 4.0, 1.0, seed=3)) and a[0] == 0
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    bursty = np.diff(arrival_offsets(20001, 4.0, 0.25, seed=3))
    assert bursty.mean() == pytest.approx(0.25, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.07)  # gamma: CV 1/sqrt(k)
    with pytest.raises(ValueError, match="request-rate"):
        arrival_offsets(3, 0.0)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_offsets(3, 1.0, 0.0)


METRICS_BEFORE = """\
# TYPE sparseserve:num_preemptions counter
sparseserve:num_preemptions_total{model_name="m"} 2.0
# TYPE sparseserve:kv_cache_hits counter
sparseserve:kv_cache_hits_total{model_name="m"} 10.0
# TYPE sparseserve:kv_cache_misses counter
sparseserve:kv_cache_misses_total{model_name="m"} 5.0
# TYPE sparseserve:request_queue_time_seconds histogram
sparseserve:request_queue_time_seconds_bucket{le="+Inf",model_name="m"} 1.0
sparseserve:request_queue_time_seconds_count{model_name="m"} 1.0
sparseserve:request_queue_time_seconds_sum{model_name="m"} 4.0
# TYPE sparseserve:request_success counter
sparseserve:request_success_total{finished_reason="length",model_name="m"} 1.0
sparseserve:request_success_total{finished_reason="stop",model_name="m"} 0.0
"""
METRICS_AFTER = METRICS_BEFORE.replace("} 2.0\n# TYPE sparseserve:kv_cache_hits", "} 5.0\n# TYPE sparseserve:kv_cache_hits") \
    .replace('hits_total{model_name="m"} 10.0', 'hits_total{model_name="m"} 40.0') \
    .replace('misses_total{model_name="m"} 5.0', 'misses_total{model_name="m"} 15.0') \
    .replace('seconds_count{model_name="m"} 1.0', 'seconds_count{model_name="m"} 5.0') \
    .replace('seconds_sum{model_name="m"} 4.0', 'seconds_sum{model_name="m"} 6.0') \
    .replace('"length",model_name="m"} 1.0', '"length",model_name="m"} 5.0')


def test_prometheus_deltas_and_missing_names():
    d = serve_prometheus.deltas(METRICS_BEFORE, METRICS_AFTER)
    assert d["preemptions"] == 3.0
    assert d["kv_cache_hits"] == 30.0 and d["kv_cache_misses"] == 10.0
    assert d["kv_cache_hit_rate"] == pytest.approx(0.75)
    assert d["mean_queue_time_s"] == pytest.approx(0.5)  # (6 - 4) s over 4 requests
    assert d["requests_length"] == 4.0 and d["requests_stop"] == 0.0
    # names this server does not export are None, not 0
    assert d["bytes_loaded"] is None and d["pages_saved"] is None
    assert "bytes_loaded" in d["missing"] and "preemptions" not in d["missing"]
    none = serve_prometheus.deltas(None, None)
    assert none["preemptions"] is None and none["kv_cache_hit_rate"] is None
    assert none["missing"] == ["/metrics unavailable"]
