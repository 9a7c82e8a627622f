"""The workloads of benchmarks/offline_throughput.py (requests x prompt / output lengths),
the targets, and the sizes of the engine each part builds (KV bytes that never preempt, the
rows and the length the decode-step bench also needs); random prompts."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TARGET_RATIO_A = 2.0  # issue 2: >= 2x transformers' throughput on workload a
TARGET_HOST_FRAC = 0.10  # issue 2: host time < 10% of the decode step at batch 32


@dataclass(frozen=True)
class Workload:
    name: str
    num_requests: int
    prompt_len: int
    output_len: int
    max_num_batched_tokens: int  # sparseserve's per-step token budget (chunked prefill)

    @property
    def max_model_len(self) -> int:
        return self.prompt_len + self.output_len


def workloads(smoke: bool, batched_tokens: int | None) -> dict[str, Workload]:
    if smoke:
        ws = [Workload("a", 4, 64, 8, 128), Workload("b", 2, 256, 4, 128)]
    else:
        ws = [Workload("a", 64, 4096, 256, 16384), Workload("b", 8, 32768, 128, 16384)]
    if batched_tokens:
        ws = [Workload(w.name, w.num_requests, w.prompt_len, w.output_len, batched_tokens)
              for w in ws]
    return {w.name: w for w in ws}


def kv_bytes_per_token(cfg: dict, dtype_bytes: int) -> int:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes


def kv_cache_bytes(cfg: dict, dtype_bytes: int, num_seqs: int, max_len: int,
                   page_size: int = 32) -> int:
    """KV bytes for `num_seqs` sequences of `max_len` tokens, page-rounded, plus 5% + 64 pages
    of slack, so a workload never preempts."""
    tokens = num_seqs * (-(-max_len // page_size) * page_size) + 64 * page_size
    return int(tokens * kv_bytes_per_token(cfg, dtype_bytes) * 1.05)


def make_prompts(rng: np.random.Generator, n: int, length: int, vocab: int) -> np.ndarray:
    return rng.integers(0, vocab, size=(n, length), dtype=np.int64)


def engine_plan(name: str, ws: dict, setup: dict, batched: int | None) -> dict:
    """Engine sizing for a part: workload a's engine also serves the decode-step bench (its
    KV and rows cover both), so `--only steps` measures the same engine as a full run."""
    w = ws["a" if name.startswith("steps") else name]
    d = setup["decode"]
    do_steps = name.startswith("steps") or (name == "a" and "steps" in setup["parts"])
    max_len, seqs = w.max_model_len, w.num_requests
    if do_steps:
        max_len = max(max_len, d["context"] + d["warmup"] + d["steps"] + 16)
        seqs = max(seqs, max(d["batches"]))
    return {"workload": w, "throughput": name in ("a", "b"), "steps": do_steps,
            "max_len": max_len, "seqs": seqs,
            "batched": batched or w.max_num_batched_tokens,
            "kv_bytes": kv_cache_bytes(setup["cfg"], setup["dtype_bytes"], seqs, max_len)}

