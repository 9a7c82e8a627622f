"""Server-side counters of a benchmark run: the deltas of /metrics read before and after.

The server exports vLLM's metric names under the prefix `sparseserve:` (see
sparseserve/server/metrics.py). A name the server does not export (an older server, or a
counter not added yet) is reported as None, never as 0: "not measured" and "zero" differ.

Reported (all deltas over the run):
  preemptions, kv_cache_hits / kv_cache_misses (selected pages found in / loaded into the
  device tier), kv_cache_hit_rate (hits / (hits + misses); None when both are 0 or absent),
  pages_loaded / pages_saved (dedicated page counters if the server has them), bytes_loaded /
  bytes_saved (host <-> device KV traffic), save_wait_s (the engine's host thread waiting on
  saves), prompt_tokens / generation_tokens (the server's own token counts),
  mean_queue_time_s / mean_prefill_time_s (from the histograms' sum and count; SparseServe's
  goodput needs the mean queueing delay), requests_<reason>,
  triton_compiles / triton_compile_s (Triton kernels compiled during the run: each one is a
  stall some request paid).
"""
from __future__ import annotations

from typing import Optional

from prometheus_client.parser import text_string_to_metric_families

PREFIX = "sparseserve:"

# result key -> sample name (without the prefix)
COUNTERS = {
    "preemptions": "num_preemptions_total",
    "kv_cache_hits": "kv_cache_hits_total",
    "kv_cache_misses": "kv_cache_misses_total",
    "pages_loaded": "kv_pages_loaded_total",
    "pages_saved": "kv_pages_saved_total",
    "bytes_loaded": "kv_bytes_loaded_total",
    "bytes_saved": "kv_bytes_saved_total",
    "prompt_tokens": "prompt_tokens_total",
    "generation_tokens": "generation_tokens_total",
    "save_wait_s": "kv_save_wait_seconds_total",
    "triton_compiles": "triton_compiles_total",
    "triton_compile_s": "triton_compile_seconds_total",
}
HISTOGRAM_MEANS = {
    "mean_queue_time_s": "request_queue_time_seconds",
    "mean_prefill_time_s": "request_prefill_time_seconds",
}
FINISH_REASONS = ("stop", "length", "abort")


def parse(text: Optional[str]) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted label items): value} of a Prometheus text body ({} for None)."""
    out: dict[tuple[str, tuple], float] = {}
    if not text:
        return out
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def total(samples: dict[tuple[str, tuple], float], name: str, **labels: str) -> Optional[float]:
    """Sum of the samples called PREFIX + name whose labels include `labels`; None if none."""
    want = set(labels.items())
    vals = [v for (n, ls), v in samples.items() if n == PREFIX + name and want <= set(ls)]
    return sum(vals) if vals else None


def _delta(before: dict, after: dict, name: str, **labels: str) -> Optional[float]:
    a = total(after, name, **labels)
    if a is None:
        return None
    b = total(before, name, **labels)
    return a - (b or 0.0)  # a counter absent before the run started at 0


def deltas(before_text: Optional[str], after_text: Optional[str]) -> dict:
    """The run's server-side numbers (see the module docstring); every key always present."""
    before, after = parse(before_text), parse(after_text)
    out: dict = {k: _delta(before, after, n) for k, n in COUNTERS.items()}
    hits, misses = out["kv_cache_hits"], out["kv_cache_misses"]
    looked_up = (hits or 0.0) + (misses or 0.0)
    out["kv_cache_hit_rate"] = (hits or 0.0) / looked_up if looked_up > 0 else None
    for key, hist in HISTOGRAM_MEANS.items():
        s, c = _delta(before, after, hist + "_sum"), _delta(before, after, hist + "_count")
        out[key] = s / c if s is not None and c else None
    for reason in FINISH_REASONS:
        out[f"requests_{reason}"] = _delta(before, after, "request_success_total",
                                           finished_reason=reason)
    out["missing"] = sorted(k for k, v in out.items()
                            if v is None and k in COUNTERS) if after else ["/metrics unavailable"]
    return out
