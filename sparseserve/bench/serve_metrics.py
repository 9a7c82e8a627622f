"""Serving metrics from per-request measurements: TTFT, TPOT, ITL, E2EL, throughputs, goodput.

Definitions (those of `vllm bench serve`, so numbers compare):

* TTFT: time to first token of each successful request.
* TPOT: per request, (E2EL - TTFT) / (output tokens - 1); requests with one output token
  have no TPOT (no decode step) and are left out of its statistics.
* ITL: every gap between consecutive token-carrying stream events, pooled over requests.
* E2EL: end-to-end latency of each successful request.
* request / output / total-token throughput: completed requests, output tokens, input plus
  output tokens, each divided by the benchmark's duration (first send to last response).
* goodput: successful requests that meet every given SLO (TTFT, TPOT, E2EL, milliseconds),
  per second of duration. A request without a TPOT meets any TPOT SLO.

Statistics: mean, median, population std (numpy defaults), percentiles by numpy's linear
interpolation. A statistic over no values is None (never a made-up 0). Result keys follow
vLLM: `mean_ttft_ms`, `median_tpot_ms`, `std_itl_ms`, `p99_e2el_ms`, ...
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

import numpy as np

from sparseserve.bench.serve_types import RequestResult

METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def parse_percentile_metrics(text: str) -> list[str]:
    """'ttft,tpot,itl' -> ['ttft', 'tpot', 'itl']; ValueError naming the allowed names."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in METRICS]
    if not names or bad:
        raise ValueError(f"--percentile-metrics {text!r}: give a comma-separated list of "
                         f"{', '.join(METRICS)} (e.g. ttft,tpot,itl,e2el).")
    return names


def parse_percentiles(text: str) -> list[float]:
    """'50,90,99' -> [50.0, 90.0, 99.0]; each must be in (0, 100]."""
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        values = []
    if not values or any(not 0 < p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles {text!r}: give comma-separated percentiles in "
                         "(0, 100], e.g. 50,90,99.")
    return values


def parse_goodput(items: Optional[Sequence[str]]) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        key = key.strip().lower()
        try:
            ms = float(value) if sep else float("nan")
        except ValueError:
            ms = float("nan")
        if key not in GOODPUT_METRICS or not ms >= 0:
            raise ValueError(f"--goodput {item!r}: expected KEY:MILLISECONDS with KEY one of "
                             f"{', '.join(GOODPUT_METRICS)} and a number >= 0, "
                             "e.g. --goodput ttft:2000 tpot:50 e2el:30000.")
        slos[key] = ms
    return slos


def percentile_key(p: float) -> str:
    """99 -> 'p99', 99.9 -> 'p99.9' (vLLM's naming)."""
    return f"p{p:g}"


def tpot_of(r: RequestResult) -> Optional[float]:
    """Seconds per output token after the first; None without a decode step."""
    if not r.success or r.ttft is None or r.output_len <= 1:
        return None
    return (r.latency - r.ttft) / (r.output_len - 1)


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    """Whether a successful request meets every SLO (milliseconds)."""
    if not r.success:
        return False
    tpot = tpot_of(r)
    values = {"ttft": r.ttft, "tpot": tpot if tpot is not None else 0.0, "e2el": r.latency}
    for key, limit_ms in slos.items():
        v = values[key]
        if v is None or v * 1000.0 > limit_ms:
            return False
    return True


def _stats(name: str, values_s: Iterable[float], percentiles: Sequence[float],
           with_percentiles: bool) -> dict[str, Optional[float]]:
    ms = np.asarray(list(values_s), dtype=np.float64) * 1000.0
    out: dict[str, Optional[float]] = {}
    empty = ms.size == 0
    out[f"mean_{name}_ms"] = None if empty else float(np.mean(ms))
    out[f"median_{name}_ms"] = None if empty else float(np.median(ms))
    out[f"std_{name}_ms"] = None if empty else float(np.std(ms))
    if with_percentiles:
        for p in percentiles:
            out[f"{percentile_key(p)}_{name}_ms"] = None if empty else float(np.percentile(ms, p))
    return out


def aggregate(results: Sequence[RequestResult], duration: float,
              percentile_metrics: Sequence[str] = ("ttft", "tpot", "itl"),
              percentiles: Sequence[float] = (99.0,),
              goodput: Optional[dict[str, float]] = None) -> dict:
    """The summary numbers and per-request lists of one benchmark run.

    `duration` (seconds) must be > 0. Failed requests count in `failed` and `errors` and in
    nothing else. `request_goodput` is None when no SLO was given.
    """
    if duration <= 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration}")
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    values = {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [t for t in (tpot_of(r) for r in ok) if t is not None],
        "itl": [g for r in ok for g in r.itl],
        "e2el": [r.latency for r in ok],
    }
    out: dict = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": (sum(meets_slos(r, goodput) for r in ok) / duration
                            if goodput else None),
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    for name in METRICS:
        out.update(_stats(name, values[name], percentiles, name in percentile_metrics))
    out.update({
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [list(r.itl) for r in results],
        "e2els": [r.latency if r.success else None for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
        "datasets": [r.dataset for r in results],
        "usage_sources": sorted({r.usage_source for r in ok}),
    })
    return out
