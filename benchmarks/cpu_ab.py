"""Summary of an in-process A/B of a fused CPU kernel against the torch path (rounds in
alternating order; benchmarks/cpu_decode_fused.py, cpu_norm_fused.py)."""
from __future__ import annotations

import statistics


def fused_vs_torch(samples: list[dict], keys: tuple[str, ...], same_tokens: bool) -> dict:
    """samples: {"path": "fused" | "torch", key: value, ...} per round and path -> per key the
    median of each path and the fused / torch ratio of every round, plus the samples."""
    res = {"samples": samples, "same_tokens": same_tokens}
    for k in keys:
        by = {p: [s[k] for s in samples if s["path"] == p] for p in ("fused", "torch")}
        res[k] = {p: statistics.median(v) for p, v in by.items()}
        res[k]["fused_over_torch_per_round"] = [a / b for a, b in zip(by["fused"], by["torch"])]
    return res
