"""Timing for benchmarks/transfer.py (class Clock: CUDA events per repetition, or wall time
with device syncs) and the bulk pinned H2D / D2H bandwidth every page transfer is compared
with."""
from __future__ import annotations

import time

import numpy as np
import torch


class Clock:
    """Times fn() per repetition: CUDA events on a GPU (unless wall=True), else perf_counter
    with device syncs. Returns seconds per rep."""

    def __init__(self, cuda: bool, wall: bool) -> None:
        self.events = cuda and not wall
        self.cuda = cuda

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def run(self, fn, reps: int, warmup: int) -> list[float]:
        for _ in range(warmup):
            fn()
        self.sync()
        out = []
        for _ in range(reps):
            if self.events:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                out.append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                self.sync()
                out.append(time.perf_counter() - t0)
        return out


def bulk_bandwidth(dev, nbytes: int, clock: Clock, reps: int) -> dict:
    pin = dev.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    host.fill_(1)
    devbuf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    h2d = clock.run(lambda: devbuf.copy_(host, non_blocking=True), reps, 2)
    d2h = clock.run(lambda: host.copy_(devbuf, non_blocking=True), reps, 2)
    return {"bytes": nbytes, "h2d_gbps": nbytes / np.median(h2d) / 1e9,
            "d2h_gbps": nbytes / np.median(d2h) / 1e9,
            "h2d_ms": [x * 1e3 for x in h2d], "d2h_ms": [x * 1e3 for x in d2h]}
