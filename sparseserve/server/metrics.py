"""Prometheus metrics with vLLM's names under the prefix `sparseserve:` and label `model_name`.

A vLLM dashboard works after replacing `vllm:` by `sparseserve:`. Gauges and the engine-wide
counters (preemptions, two-tier cache hits/misses, bytes moved) are fed from
`LLMEngine.get_stats()` after every step (counters by the delta of the engine's totals);
per-request counters and histograms are fed from the `RequestOutput`s as they stream out.
All methods are called from the engine-loop thread only (prometheus-client is thread-safe
for the scrape side).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from prometheus_client import (CollectorRegistry, Counter, Gauge, GCCollector, Histogram,
                               PlatformCollector, ProcessCollector)

PREFIX = "sparseserve:"

# vLLM's buckets
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


def _token_buckets(max_model_len: int) -> list[float]:
    """1-2-5 series up to max_model_len (vLLM's build_1_2_5_buckets)."""
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10 ** exp
            if v > max_model_len:
                return [float(x) for x in out]
            out.append(v)
        exp += 1


# engine-wide totals in get_stats() -> counter attribute fed by their delta
_STAT_COUNTERS = {
    "num_preemptions_total": "preemptions",
    "cache_hits_total": "cache_hits",
    "cache_misses_total": "cache_misses",
    "bytes_loaded_total": "bytes_loaded",
    "bytes_saved_total": "bytes_saved",
    "pages_loaded_total": "pages_loaded",
    "save_wait_seconds_total": "save_wait_seconds",
    "triton_compiles_total": "triton_compiles",
    "triton_compile_seconds_total": "triton_compile_seconds",
}


@dataclass
class RequestTrack:
    """Per-request bookkeeping of what has already been counted (engine-loop thread)."""

    arrival_time: float
    n: int = 1
    max_tokens: Optional[int] = None
    prompt_counted: bool = False
    num_generated: int = 0
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    seen: set = field(default_factory=set)


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int = 8192,
                 registry: Optional[CollectorRegistry] = None, process_metrics: bool = True) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        if process_metrics:
            for collector in (ProcessCollector, PlatformCollector, GCCollector):
                try:
                    collector(registry=self.registry)
                except Exception:  # pragma: no cover - platform without /proc etc.
                    pass
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Any:
            return Gauge(PREFIX + name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(PREFIX + name, doc, labels, registry=r).labels(model_name)

        def hist(name: str, doc: str, buckets: list[float]) -> Any:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_running = gauge("num_requests_running", "Number of requests in model execution batches.")
        self.num_waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("kv_cache_usage_perc",
                              "Device-tier (HBM) KV-cache usage. 1 means 100 percent usage.")
        self.host_kv_usage = gauge("host_kv_cache_usage_perc",
                                   "Host-tier (DRAM) KV-cache usage. 1 means 100 percent usage.")
        self.preemptions = counter("num_preemptions", "Cumulative number of preemptions from the engine.")
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self._success = Counter(PREFIX + "request_success", "Count of successfully processed requests.",
                                labels + ["finished_reason"], registry=r)
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)
        self.cache_hits = counter("kv_cache_hits",
                                  "Selected KV pages found in the device-tier cache (two-tier cache).")
        self.cache_misses = counter("kv_cache_misses",
                                    "Selected KV pages loaded from the host tier (two-tier cache).")
        self.bytes_loaded = counter("kv_bytes_loaded", "KV bytes copied host -> device.")
        self.pages_loaded = counter("kv_pages_loaded", "KV pages copied host -> device.")
        self.waiting_for_slots = gauge(
            "num_requests_waiting_for_slots",
            "Requests the last step left waiting because their device working sets did not fit "
            "the device cache (two-tier cache).")
        self.working_set = gauge(
            "estimated_working_set_slots",
            "Device slots per layer the last step's requests were estimated to need "
            "(working-set-aware batch control).")
        self.bytes_saved = counter("kv_bytes_saved", "KV bytes copied device -> host.")
        self.save_wait_seconds = counter(
            "kv_save_wait_seconds", "Seconds the engine's host thread waited on device -> host "
            "KV saves (fences, page frees, staging space; two-tier cache).")
        self.triton_compiles = counter(
            "triton_compiles", "Triton kernel compilations in the engine process (one while "
            "serving is a shape the start-up warm-up missed; its time lands in a request).")
        self.triton_compile_seconds = counter(
            "triton_compile_seconds", "Seconds spent compiling Triton kernels in the engine process.")
        self.ttft = hist("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        ITL_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds",
                         "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        LATENCY_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", LATENCY_BUCKETS)
        self.prefill_time = hist("request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", LATENCY_BUCKETS)
        self.decode_time = hist("request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", LATENCY_BUCKETS)
        self.inference_time = hist("request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", LATENCY_BUCKETS)
        tok = _token_buckets(max_model_len)
        self.req_prompt_tokens = hist("request_prompt_tokens", "Number of prefill tokens processed.", tok)
        self.req_generation_tokens = hist("request_generation_tokens",
                                          "Number of generation tokens processed.", tok)
        self.params_n = hist("request_params_n", "Histogram of the n request parameter.",
                             [1, 2, 5, 10, 20])
        self.params_max_tokens = hist("request_params_max_tokens",
                                      "Histogram of the max_tokens request parameter.", tok)
        self._last_totals: dict[str, float] = {}

    def success(self, reason: str) -> Any:
        return self._success.labels(self.model_name, reason)

    # ---------------------------------------------------------------- engine-wide

    def start_from(self, stats: dict[str, Any]) -> None:
        """Count engine totals from `stats` on (an engine that already ran: a benchmark's
        next point): later update_stats calls add only what happened since."""
        for key in _STAT_COUNTERS:
            self._last_totals[key] = float(stats.get(key, 0) or 0)

    def update_stats(self, stats: dict[str, Any], extra_waiting: int = 0) -> None:
        self.num_running.set(stats.get("num_running", 0))
        self.num_waiting.set(stats.get("num_waiting", 0) + extra_waiting)
        self.kv_usage.set(stats.get("device_kv_usage", 0.0))
        self.host_kv_usage.set(stats.get("host_kv_usage", 0.0))
        self.waiting_for_slots.set(stats.get("num_waiting_for_slots", 0))
        self.working_set.set(stats.get("estimated_working_set", 0))
        for key, attr in _STAT_COUNTERS.items():
            total = float(stats.get(key, 0) or 0)
            delta = total - self._last_totals.get(key, 0.0)
            if delta > 0:
                getattr(self, attr).inc(delta)
            self._last_totals[key] = max(total, self._last_totals.get(key, 0.0))

    # ---------------------------------------------------------------- per request

    def observe_output(self, out: Any, track: RequestTrack) -> None:
        """Count the tokens new in `out` (a cumulative RequestOutput) and time them."""
        now = time.time()
        generated = sum(len(o.token_ids) for o in out.outputs)
        new = generated - track.num_generated
        if new > 0:
            if not track.prompt_counted:
                track.prompt_counted = True
                self.prompt_tokens.inc(len(out.prompt_token_ids))
            self.generation_tokens.inc(new)
            track.num_generated = generated
            times = sorted(set(getattr(out, "new_token_times", None) or [])) or [now]
            for t in times:
                if track.first_token_time is None:
                    m = getattr(out, "metrics", None)
                    first = (m.first_token_time if m and m.first_token_time else t)
                    track.first_token_time = first
                    self.ttft.observe(max(0.0, first - track.arrival_time))
                elif track.last_token_time is not None and t > track.last_token_time:
                    self.itl.observe(t - track.last_token_time)
                track.last_token_time = t if track.last_token_time is None else max(t, track.last_token_time)
        if out.finished:
            self._observe_finished(out, track, now)

    def _observe_finished(self, out: Any, track: RequestTrack, now: float) -> None:
        if not track.prompt_counted:
            track.prompt_counted = True
            self.prompt_tokens.inc(len(out.prompt_token_ids))
        for o in out.outputs:
            self.success(o.finish_reason or "stop").inc()
        m = getattr(out, "metrics", None)
        arrival = (m.arrival_time if m and m.arrival_time else track.arrival_time)
        finished = (m.finished_time if m and m.finished_time else now)
        scheduled = m.first_scheduled_time if m else None
        first_tok = (m.first_token_time if m and m.first_token_time else track.first_token_time)
        last_tok = (m.last_token_time if m and m.last_token_time else track.last_token_time)
        self.e2e.observe(max(0.0, finished - arrival))
        if scheduled:
            self.queue_time.observe(max(0.0, scheduled - arrival))
            self.inference_time.observe(max(0.0, finished - scheduled))
            if first_tok:
                self.prefill_time.observe(max(0.0, first_tok - scheduled))
        if first_tok:
            decode = max(0.0, (last_tok or finished) - first_tok)
            self.decode_time.observe(decode)
            per_seq = max((len(o.token_ids) for o in out.outputs), default=0)
            if per_seq > 1:
                self.tpot.observe(decode / (per_seq - 1))
        self.req_prompt_tokens.observe(len(out.prompt_token_ids))
        self.req_generation_tokens.observe(sum(len(o.token_ids) for o in out.outputs))
        self.params_n.observe(track.n)
        if track.max_tokens is not None:
            self.params_max_tokens.observe(track.max_tokens)

    def observe_abort(self, track: RequestTrack) -> None:
        self.success("abort").inc(track.n)
        self.e2e.observe(max(0.0, time.time() - track.arrival_time))
