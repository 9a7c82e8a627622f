"""worker/plan_staging.PlanStaging, the graph steps' plan staging (the mixed-step and two-tier
prefill graphs): a buffer is handed out again only once its copy completed, the ring grows
instead of waiting, oldest free buffer first."""
import pytest
import torch

from sparseserve.worker.plan_staging import PlanStaging


def test_staging_ring_never_waits():
    """More runs than buffers with their copies in flight: each run gets a buffer no copy
    reads (the ring grows); completed copies free their buffers, handed out oldest first."""
    made = []

    def make():
        made.append(torch.zeros(4))
        return (made[-1],)

    class Event:
        def __init__(self):
            self.done = False

        def query(self):
            return self.done

        def synchronize(self):
            raise AssertionError("waited")

    ring = PlanStaging(make, size=2)
    live = {}  # buffer id -> its event, for buffers whose copy is in flight
    events = []
    for run in range(5):
        i, (buf,) = ring.take()
        assert id(buf) not in live or live[id(buf)].done, "a buffer in flight handed out"
        buf.fill_(run)
        e = Event()
        ring.issued(i, e)
        live[id(buf)] = e
        events.append((e, buf))
    assert len(ring.buffers) == 5 and len(made) == 5
    assert [float(b[0]) for _, b in events] == [0, 1, 2, 3, 4], "live data overwritten"
    for e, _ in events[:3]:  # the three oldest copies complete
        e.done = True
    got = [ring.take() for _ in range(3)]
    assert [id(b) for _, (b,) in got] == [id(b) for _, b in events[:3]], "not oldest first"
    assert len(ring.buffers) == 5
    for i, _ in got:
        ring.issued(i, None)  # complete at once (CPU)
    i, (b,) = ring.take()  # two copies still in flight: the oldest free buffer
    assert id(b) == id(events[0][1]) and len(ring.buffers) == 5
    ring.issued(i, None)
    with pytest.raises(AssertionError):  # issued twice: it was not taken again
        ring.issued(i, None)
