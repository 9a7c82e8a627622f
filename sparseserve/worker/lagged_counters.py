"""Device counters read without waiting for the device (issue 12: no host waits per step).

The server reads the two-tier cache's counters after every step. Reading them with `.tolist()`
waits for everything the step queued; `LaggedCounters.read(parts, fresh=False)` instead starts
an asynchronous copy into pinned memory and returns what the last finished copy read: the
values lag by a step or so and equal the fresh ones once the device is idle. A fresh read
(`fresh=True`, or the first read, or any read of CPU tensors) waits, and drops any copy in
flight — older than what it read — so the values a caller sees never go back.
"""
from __future__ import annotations

import torch


class LaggedCounters:
    def __init__(self) -> None:
        self._pinned: torch.Tensor | None = None
        self._event = None
        self._seen: list[int] | None = None

    def read(self, parts: list[torch.Tensor], fresh: bool = True) -> list[int]:
        """parts: 1-D integer tensors on one device -> their concatenated values (see the
        module doc for `fresh`)."""
        dev = parts[0].device
        if fresh or dev.type != "cuda" or self._seen is None:
            values = torch.cat(parts).tolist()  # waits for the device: any copy in flight
            self._seen, self._event = values, None  # landed before, and is older: dropped
            return values
        if self._event is None or self._event.query():
            if self._event is not None:
                self._seen = self._pinned.tolist()
            cur = torch.cat(parts)
            if self._pinned is None:
                self._pinned = torch.empty(cur.shape, dtype=cur.dtype, pin_memory=True)
            self._pinned.copy_(cur, non_blocking=True)  # never overwritten while unread
            self._event = torch.cuda.Event()
            self._event.record()
        return self._seen
