"""Torch threads of the CPU engine, per step: all cores for steps that carry prefill work, one
fewer for decode-only steps.

Why (docs/results/cpu.md § thread policy, `benchmarks/cpu_threads.py`, SmolLM2 fp32 on the
2-core machine, 3 interleaved rounds): idle, 2 threads prefill 1.7x faster than 1 (507 vs 297
tokens/s) but decode at batch 1 barely faster (66 vs 73 ms per step); with one competing
process — the server's own event loop, a tokenizer, another tenant — 2 threads make decode
2.2-2.8x slower than 1 (273 vs 98 ms at batch 1, 390 vs 178 at batch 8: an op waits for its
descheduled second thread) while prefill is the same (160 vs 155 tokens/s). Decode steps
therefore leave a core free; prefill steps take all.

OMP_NUM_THREADS, when set, is the user's choice: the policy is off and torch keeps it.
"""
from __future__ import annotations

import os

import torch


class CpuThreadPolicy:
    """`for_step(has_prefill)` sets torch's intra-op threads for the next step (a no-op when the
    count does not change)."""

    def __init__(self, cores: int | None = None, env: dict | None = None) -> None:
        env = os.environ if env is None else env
        self.enabled = "OMP_NUM_THREADS" not in env
        cores = cores or os.cpu_count() or 1
        self.prefill_threads = cores
        self.decode_threads = max(1, cores - 1)

    def for_step(self, has_prefill: bool) -> int:
        """-> the thread count the step runs with."""
        if not self.enabled:
            return torch.get_num_threads()
        n = self.prefill_threads if has_prefill else self.decode_threads
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return n
