"""One engine per run of benchmarks/offload.py (class Engine: built, described, closed with
its saver drained and memory returned) and the engine's cache counters the runs difference
(hits, misses, bytes and pages loaded and saved)."""
from __future__ import annotations

import time

import common as C
from engine_bench import engine_graph_sizes
from offload_bench import Bench
from offload_shape import GiB, meminfo

STAT_KEYS = ("cache_hits_total", "cache_misses_total", "bytes_loaded_total", "bytes_saved_total")


class Engine:
    """One LLM for one run; closed (saver drained, memory returned) on exit."""

    def __init__(self, bench: Bench, kwargs: dict) -> None:
        self.bench, self.kwargs, self.llm = bench, kwargs, None

    def __enter__(self) -> "Engine":
        import torch

        from sparseserve import LLM

        mem0 = meminfo().get("MemAvailable")
        t0 = time.perf_counter()
        try:
            self.llm = LLM(self.bench.model, **self.kwargs)
            C.synchronize()
        except BaseException:
            self.llm = None
            C.free_device_memory()
            raise
        load_s = time.perf_counter() - t0
        self.bench.loads.append(load_s)
        eng = self.llm.engine
        graphs = eng.executor.graph_info()
        cc = eng.config.cache
        mem1 = meminfo().get("MemAvailable")
        self.info = {
            "engine_args": dict(self.kwargs), "load_s": load_s,
            "enforce_eager": bool(self.kwargs.get("enforce_eager", False)),
            "cuda_graphs": graphs["batch_sizes"] is not None,
            "cuda_graph_error": graphs["error"],
            "cuda_graph_batch_sizes": engine_graph_sizes(eng),
            "device_pages_or_slots": int(cc.num_pages),
            "host_pages": int(getattr(cc, "num_host_pages", 0) or 0),
            "max_model_len": int(eng.config.scheduler.max_model_len),
            "gpu_allocated_gib": (torch.cuda.memory_allocated() / GiB
                                  if torch.cuda.is_available() else None),
            "host_available_drop_gib": ((mem0 - mem1) / GiB if mem0 and mem1 else None),
        }
        return self

    @property
    def engine(self):
        return self.llm.engine

    @property
    def offload(self):
        """The in-process two-tier cache (a clear error with tensor_parallel_size > 1)."""
        runner = self.llm.engine.executor.local_runner("the offload benchmark's save fence")
        return runner.offload

    def __exit__(self, *exc) -> None:
        try:
            if self.llm is not None:
                self.llm.engine.shutdown()  # closes the two-tier cache (and any TP ranks)
        except Exception:  # noqa: BLE001
            pass
        self.llm = None
        C.free_device_memory()


def cache_stats(engine) -> dict:
    """get_stats counters plus pages loaded (per layer, K+V of one KV head's page each)."""
    s = engine.get_stats()
    out = {k: int(s.get(k, 0) or 0) for k in STAT_KEYS}
    tier = engine.executor.offload_stats()  # summed over the TP ranks
    out["pages_loaded_total"] = 0
    if tier is not None:
        try:
            out["pages_loaded_total"] = int(tier.get("pages_loaded_total"))
        except Exception:  # noqa: BLE001 - derive it from the bytes
            out["pages_loaded_total"] = None
    return out


def stats_delta(a: dict, b: dict, page_bytes: int) -> dict:
    d = {k: b[k] - a[k] for k in STAT_KEYS}
    if a.get("pages_loaded_total") is not None and b.get("pages_loaded_total") is not None:
        d["pages_loaded"] = b["pages_loaded_total"] - a["pages_loaded_total"]
    else:
        d["pages_loaded"] = d["bytes_loaded_total"] // page_bytes
    return d


def hit_rate(d: dict) -> float | None:
    n = d["cache_hits_total"] + d["cache_misses_total"]
    return d["cache_hits_total"] / n if n else None
