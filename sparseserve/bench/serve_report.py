"""Printing and saving a `bench serve` result (the dict of serve_runner.run_benchmark)."""
from __future__ import annotations

import json
import os
from typing import Any, Optional

from sparseserve.bench.serve_metrics import METRICS, percentile_key

_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.0f}" if v.is_integer() and abs(v) < 1e15 else f"{v:.{digits}f}"
    return str(v)


def summary(result: dict[str, Any]) -> str:
    """vLLM-style text table of the run, then the server-side counters."""
    rows: list[tuple[str, Any]] = [
        ("Backend", result.get("backend")),
        ("Successful requests", result["completed"]),
        ("Failed requests", result["failed"]),
        ("Benchmark duration (s)", result["duration"]),
        ("Total input tokens", result["total_input_tokens"]),
        ("Total generated tokens", result["total_output_tokens"]),
        ("Request throughput (req/s)", result["request_throughput"]),
    ]
    if result.get("request_goodput") is not None:
        rows.append(("Request goodput (req/s)", result["request_goodput"]))
    rows += [("Output token throughput (tok/s)", result["output_throughput"]),
             ("Total token throughput (tok/s)", result["total_token_throughput"])]
    lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]
    lines += [f"{k:<44}{_fmt(v):>16}" for k, v in rows]
    for m in METRICS:
        if m not in result.get("percentile_metrics", METRICS):
            continue
        lines.append("{s:{c}^60}".format(s=f" {_TITLES[m]} ", c="-"))
        lines.append(f"{'Mean ' + m.upper() + ' (ms)':<44}{_fmt(result[f'mean_{m}_ms']):>16}")
        lines.append(f"{'Median ' + m.upper() + ' (ms)':<44}{_fmt(result[f'median_{m}_ms']):>16}")
        for p in result.get("metric_percentiles", []):
            key = f"{percentile_key(p)}_{m}_ms"
            lines.append(f"{'P' + f'{p:g}' + ' ' + m.upper() + ' (ms)':<44}{_fmt(result.get(key)):>16}")
    server = result.get("server_metrics") or {}
    lines.append("{s:{c}^60}".format(s=" Server counters (deltas of /metrics) ", c="-"))
    for k, v in server.items():
        if k != "missing":
            lines.append(f"{k:<44}{_fmt(v, 4):>16}")
    if server.get("missing"):
        lines.append(f"not exported by the server: {', '.join(server['missing'])}")
    errors = [e for e in result.get("errors", []) if e]
    if errors:
        lines.append(f"{len(errors)} request(s) failed; first error: {errors[0]}")
    if "chunks" in result.get("usage_sources", []):
        lines.append("note: the server sent no usage; output tokens were counted as stream "
                     "chunks (a lower bound)")
    lines.append("=" * 60)
    return "\n".join(lines)


def default_filename(result: dict[str, Any]) -> str:
    rate = result.get("request_rate")
    conc = result.get("max_concurrency")
    model = str(result.get("model_id") or "model").replace("/", "_")
    parts = [result.get("backend", "bench"), f"{rate}qps"]
    if conc is not None:
        parts.append(f"concurrency{conc}")
    return "-".join(parts + [model, result.get("date", "")]) + ".json"


def save_result(result: dict[str, Any], result_dir: Optional[str] = None,
                filename: Optional[str] = None) -> str:
    """Write the result as JSON; returns the path. The file loads back equal to `result`."""
    path = os.path.join(result_dir or ".", filename or default_filename(result))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, allow_nan=False)
    return path
