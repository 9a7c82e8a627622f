"""Byte allocator of FlashD2H's staging ring (bookkeeping only; no locking, no memory).

Regions are handed out in FIFO order from one circular buffer and are given back only from the
front: a region is reused only after it *and every older region* were released, so a region
whose scatter is still running is never overwritten, whatever order threads finish in.
"""
from __future__ import annotations

from collections import deque

__all__ = ["StagingRing", "Region"]


class Region:
    """[start, end) bytes of the ring; ``released`` once its consumer is done with it."""
    __slots__ = ("start", "end", "released")

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end, self.released = start, end, False

    @property
    def size(self) -> int:
        return self.end - self.start

    def __repr__(self) -> str:
        return f"Region({self.start}, {self.end}, released={self.released})"


class StagingRing:
    def __init__(self, capacity: int, align: int = 256) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self.align = align
        self.live: deque[Region] = deque()       # allocation order

    def round(self, nbytes: int) -> int:
        return -(-nbytes // self.align) * self.align

    def reclaim(self) -> None:
        """Drop released regions from the front."""
        while self.live and self.live[0].released:
            self.live.popleft()

    def in_use(self) -> int:
        """Bytes between the oldest live region and the newest one's end (what is blocked)."""
        if not self.live:
            return 0
        tail, head = self.live[0].start, self.live[-1].end
        return head - tail if head > tail else self.capacity - tail + head

    def try_alloc(self, nbytes: int) -> Region | None:
        """A region of ``nbytes`` (rounded up to ``align``) or None if it does not fit now."""
        size = self.round(max(nbytes, 1))
        if size > self.capacity:
            raise ValueError(f"{nbytes} bytes never fit a ring of {self.capacity}")
        self.reclaim()
        start = None
        if not self.live:
            start = 0
        else:
            tail, head = self.live[0].start, self.live[-1].end
            if self.live[-1].start >= tail:          # not wrapped: used [tail, head)
                if self.capacity - head >= size:
                    start = head
                elif tail >= size:
                    start = 0
            elif tail - head >= size:                # wrapped: free [head, tail)
                start = head
        if start is None:
            return None
        r = Region(start, start + size)
        self.live.append(r)
        return r
