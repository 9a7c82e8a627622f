"""The benchmark loop: send requests on an arrival schedule, collect, aggregate.

`run_benchmark(requests, backend, ...)` is the whole benchmark for any backend (HTTP or
in-process) and returns vLLM-shaped result keys (serve_metrics.aggregate) plus the run's
settings and `server_metrics` (the /metrics deltas, serve_prometheus.deltas). A driver that
already has an engine calls

    from sparseserve.bench.serve_inprocess import InProcessBackend
    result = run_benchmark(requests, InProcessBackend(engine), request_rate=4.0)

Arrivals: with `request_rate` = inf every request is sent at once; otherwise the gaps
between sends are gamma-distributed with shape `burstiness` and mean 1 / request_rate
(burstiness 1 = a Poisson process; < 1 burstier, > 1 more regular), as in vLLM, drawn from
`seed`. `max_concurrency` bounds the requests in flight; a request's clock (TTFT, E2EL)
starts when it is actually sent, the benchmark's clock when the first one could be.
"""
from __future__ import annotations

import asyncio
import math
import time
from datetime import datetime
from typing import Any, Optional, Sequence

import numpy as np
from tqdm.asyncio import tqdm

from sparseserve.bench import serve_prometheus
from sparseserve.bench.serve_metrics import aggregate
from sparseserve.bench.serve_types import Backend, BenchRequest, RequestResult


def arrival_offsets(num: int, request_rate: float, burstiness: float = 1.0,
                    seed: int = 0) -> np.ndarray:
    """Send times (seconds after the start) of `num` requests; the first is at 0."""
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {request_rate}.")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}.")
    if math.isinf(request_rate) or num <= 1:
        return np.zeros(num)
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


async def _run_requests(requests: Sequence[BenchRequest], backend: Backend, offsets: np.ndarray,
                        max_concurrency: Optional[int], disable_tqdm: bool) -> list[RequestResult]:
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), disable=disable_tqdm, desc="requests")
    t0 = time.perf_counter()

    async def one(req: BenchRequest, at: float) -> RequestResult:
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if limit is None:
            res = await backend.send(req)
        else:
            async with limit:
                res = await backend.send(req)
        bar.update(1)
        return res

    try:
        return list(await asyncio.gather(*(one(r, float(at)) for r, at in zip(requests, offsets))))
    finally:
        bar.close()


async def arun_benchmark(requests: Sequence[BenchRequest], backend: Backend, *,
                         request_rate: float = math.inf, burstiness: float = 1.0,
                         max_concurrency: Optional[int] = None, seed: int = 0,
                         percentile_metrics: Sequence[str] = ("ttft", "tpot", "itl"),
                         percentiles: Sequence[float] = (99.0,),
                         goodput: Optional[dict[str, float]] = None,
                         disable_tqdm: bool = True) -> dict[str, Any]:
    """`run_benchmark` for callers already inside an event loop."""
    if not requests:
        raise ValueError("no requests to send")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {max_concurrency}.")
    offsets = arrival_offsets(len(requests), request_rate, burstiness, seed)
    await backend.start()
    try:
        before = await backend.read_metrics()
        start = time.perf_counter()
        results = await _run_requests(requests, backend, offsets, max_concurrency, disable_tqdm)
        duration = time.perf_counter() - start
        after = await backend.read_metrics()
    finally:
        await backend.close()
    out: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": backend.name,
        "model_id": getattr(backend, "model", None),
        "num_prompts": len(requests),
        # JSON has no infinity: "inf" as vLLM's --request-rate spells it
        "request_rate": "inf" if math.isinf(request_rate) else request_rate,
        "burstiness": burstiness,
        "max_concurrency": max_concurrency,
        "seed": seed,
        "goodput_slos_ms": dict(goodput or {}),
        "percentile_metrics": list(percentile_metrics),
        "metric_percentiles": list(percentiles),
    }
    out.update(aggregate(results, duration, percentile_metrics, percentiles, goodput))
    out["server_metrics"] = serve_prometheus.deltas(before, after)
    return out


def run_benchmark(requests: Sequence[BenchRequest], backend: Backend, **kwargs: Any) -> dict[str, Any]:
    """Run the benchmark to the end in a fresh event loop and return its result dict.

    Keyword arguments: those of `arun_benchmark`. The backend is started and closed here.
    """
    return asyncio.run(arun_benchmark(requests, backend, **kwargs))
