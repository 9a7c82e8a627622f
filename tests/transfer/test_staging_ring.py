"""FlashD2H's staging ring allocator: FIFO regions, wrap-around, reuse only from the front."""
import random

import pytest

from sparseserve.transfer.staging_ring import StagingRing


def test_fifo_and_wrap():
    ring = StagingRing(1000, align=100)
    a, b, c = ring.try_alloc(250), ring.try_alloc(300), ring.try_alloc(300)
    assert (a.start, a.end, b.start, b.end, c.start, c.end) == (0, 300, 300, 600, 600, 900)
    assert ring.try_alloc(200) is None                 # 100 left at the end, front busy
    b.released = True
    assert ring.try_alloc(200) is None                 # b is not at the front: not reusable
    a.released = True
    d = ring.try_alloc(200)                            # front (a, b) reclaimed: wraps to 0
    assert (d.start, d.end) == (0, 200)
    e = ring.try_alloc(400)                            # wrapped: free [200, 600)
    assert (e.start, e.end) == (200, 600)
    assert ring.try_alloc(1) is None
    assert ring.in_use() == 1000
    for r in (c, d, e):
        r.released = True
    assert ring.try_alloc(1000).start == 0


def test_too_big():
    with pytest.raises(ValueError):
        StagingRing(512).try_alloc(513)


def test_random_never_overlaps_live_regions():
    rnd = random.Random(0)
    ring = StagingRing(4096, align=64)
    live = []
    for _ in range(5000):
        if live and (rnd.random() < 0.5 or len(live) > 20):
            rnd.choice(live).released = True          # threads finish in any order
        r = ring.try_alloc(rnd.randint(1, 1500))
        live = [x for x in live if not x.released or x in ring.live]
        if r is not None:
            assert 0 <= r.start < r.end <= ring.capacity and r.start % 64 == 0
            for x in live:                             # unreclaimed regions (released or not)
                assert r.end <= x.start or x.end <= r.start, (r, x)
            live.append(r)
