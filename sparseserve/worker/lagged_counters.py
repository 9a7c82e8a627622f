"""Device counters read without waiting for the device (issue 12: no host waits per step).

The server reads the two-tier cache's counters after every step. Reading them with `.tolist()`
waits for everything the step queued; `LaggedCounters.read(parts, device, fresh=False)` instead
starts an asynchronous copy into pinned memory and returns what the last finished copy read:
the values lag by a step or so and equal the fresh ones once the device is idle. A fresh read
(`fresh=True`, or the first read, or any read of CPU tensors) waits, and drops any copy in
flight — older than what it read — so the values a caller sees never go back.

`parts` is a callable that builds the counter tensors (reductions over the cache's tables:
kernels and ~0.1-0.3 ms of host time): a lagged read calls it only when it starts a copy, and
with `min_interval_s` it starts one at most that often — between steps that host time was most
of the two-tier cache's extra gap (serving.md, fifteenth session); metrics do not need values
fresher than a scrape.
"""
from __future__ import annotations

import time
from typing import Callable

import torch


class LaggedCounters:
    def __init__(self, min_interval_s: float = 0.0) -> None:
        self.min_interval_s = min_interval_s
        self._pinned: torch.Tensor | None = None
        self._event = None
        self._seen: list[int] | None = None
        self._started = -float("inf")  # perf_counter of the last copy started

    def read(self, parts: Callable[[], list[torch.Tensor]], device: torch.device,
             fresh: bool = True) -> list[int]:
        """parts() -> 1-D integer tensors on `device`; -> their concatenated values (see the
        module doc for `fresh`)."""
        if fresh or device.type != "cuda" or self._seen is None:
            values = torch.cat(parts()).tolist()  # waits for the device: any copy in flight
            self._seen, self._event = values, None  # landed before, and is older: dropped
            self._started = time.perf_counter()
            return values
        if self._event is not None:
            if not self._event.query():
                return self._seen
            self._seen, self._event = self._pinned.tolist(), None
        now = time.perf_counter()
        if now - self._started >= self.min_interval_s:
            cur = torch.cat(parts())
            if self._pinned is None:
                self._pinned = torch.empty(cur.shape, dtype=cur.dtype, pin_memory=True)
            self._pinned.copy_(cur, non_blocking=True)  # never overwritten while unread
            self._event = torch.cuda.Event()
            self._event.record()
            self._started = now
        return self._seen
