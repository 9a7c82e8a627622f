"""Host staging of a graph step's plan: pinned buffers, each rewritten only once the
host-to-device copy that read it has completed, so building a step's plan never waits for the
GPU (issue 12, item 3). Used by the mixed-step graphs (one copy a step) and the two-tier
prefill graphs (one a run, several runs a step). Not ``transfer/staging_ring.StagingRing``
(a byte ring for the flash saves)."""
from __future__ import annotations

import logging

logger = logging.getLogger("sparseserve")

__all__ = ["PlanStaging", "STAGING_BUFFERS"]

# staging buffers to start with: a step's runs (one per slot-free prompt and layer interval)
# plus the previous step's under async scheduling; the ring grows past it rather than wait
STAGING_BUFFERS = 4

_TAKEN = object()  # a staging buffer handed out whose copy is not issued yet


class PlanStaging:
    """Host staging buffers of the runs' plans, handed out in turn (the oldest first). A
    buffer is handed out again only once the host-to-device copy that read it has completed
    (its event's query(): no wait); when every buffer is still being read, a new one joins the
    ring instead of waiting, so any number of runs per step never blocks the host (issue 12,
    item 3). Steady state: as many buffers as copies in flight.

    make() -> one set of buffers; events: objects with query() (torch.cuda.Event), or None for
    a copy already complete (CPU)."""

    def __init__(self, make, size: int = STAGING_BUFFERS) -> None:
        if size < 1:
            raise ValueError("a staging ring needs at least one buffer")
        self._make = make
        self.buffers = [make() for _ in range(size)]
        self._events: list = [None] * size
        self._next = 0  # the buffer handed out least recently

    def take(self) -> tuple[int, tuple]:
        """-> (index, buffers) of a buffer no copy reads any more (never waits)."""
        n = len(self.buffers)
        for j in range(n):
            i = (self._next + j) % n
            e = self._events[i]
            if e is None or (e is not _TAKEN and e.query()):
                self._events[i] = _TAKEN
                self._next = (i + 1) % n
                return i, self.buffers[i]
        # all in flight: a new buffer in the oldest one's turn (that one stays next)
        i = self._next
        self.buffers.insert(i, self._make())
        self._events.insert(i, _TAKEN)
        self._next = (i + 1) % (n + 1)
        logger.debug("plan staging: %d buffers in flight, one more", n)
        return i, self.buffers[i]

    def issued(self, i: int, event) -> None:
        """The copy reading buffer i is issued; it is free once `event` completes (None: it
        has)."""
        assert self._events[i] is _TAKEN, f"staging buffer {i} was not taken"
        self._events[i] = event
