"""FlashD2H ordering and lifecycle: completed_seq is monotone, wait() really waits, the staging
ring applies back-pressure instead of overwriting, big saves are chunked, scatter errors surface
through wait(), and worker threads never leak."""
import gc
import threading
import time

import numpy as np
import pytest
import torch

from sparseserve.transfer import FlashD2HSaver
from sparseserve.transfer import flash_d2h as fd

from . import DEV, PIN, filled, random_bits, same_bits, sync

H, D, PS = 2, 16, 8
ROW = H * D * 4                                   # bytes of one token of K (fp32)


def _tiers(P=64, L=1):
    hk = [filled((P, PS, D), torch.float32, 0x11, pin=PIN) for _ in range(L)]
    hv = [filled((P, PS, D), torch.float32, 0x22, pin=PIN) for _ in range(L)]
    return hk, hv


def _saves(n_saves, T, P, seed=0):
    """n_saves saves of T tokens writing disjoint (page, offset) rows; -> list of
    (k, v, pages, offsets)."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    slots = rng.permutation(P * PS)[: n_saves * T * H].reshape(n_saves, T, H)
    out = []
    for s in range(n_saves):
        # one offset per token shared by the heads: pick rows with the head-0 offset
        offs = slots[s, :, 0] % PS
        pages = slots[s] // PS
        pages[:, 1] = (pages[:, 1] + 7 * s + 1) % P
        out.append((random_bits((T, H, D), torch.float32, gen, DEV),
                    random_bits((T, H, D), torch.float32, gen, DEV), pages, offs))
    # keep (page, offset) pairs disjoint across all saves and heads
    seen = set()
    for k, v, pages, offs in out:
        for t in range(T):
            for h in range(H):
                key = (int(pages[t, h]), int(offs[t]))
                if key in seen:
                    pages[t, h] = -1
                seen.add(key)
    return out


def _check(hk, hv, saves):
    for k, v, pages, offs in saves:
        kc, vc = k.cpu(), v.cpu()
        for t in range(len(offs)):
            for h in range(H):
                if pages[t, h] >= 0:
                    assert same_bits(hk[pages[t, h], offs[t]], kc[t, h])
                    assert same_bits(hv[pages[t, h], offs[t]], vc[t, h])


@pytest.fixture
def gate(monkeypatch):
    """Scatters block until gate.set() (the copy into staging is not affected)."""
    ev = threading.Event()
    orig = fd._scatter

    def gated(*a, **k):
        assert ev.wait(30), "test gate never opened"
        return orig(*a, **k)

    monkeypatch.setattr(fd, "_scatter", gated)
    yield ev
    ev.set()


def test_wait_really_waits(gate):
    hk, hv = _tiers()
    saves = _saves(2, 5, 64)
    with FlashD2HSaver(hk, hv, num_threads=2, staging_bytes=1 << 16) as saver:
        t1 = saver.save(0, *saves[0])
        t2 = saver.save(0, *saves[1])
        assert (t1, t2) == (1, 2)
        time.sleep(0.05)
        assert saver.completed_seq() == 0 and not saver.is_done(t1)
        with pytest.raises(TimeoutError):
            saver.wait(t1, timeout=0.1)
        assert same_bits(hk[0], filled(hk[0].shape, torch.float32, 0x11))     # nothing yet
        gate.set()
        saver.wait(t2)
        assert saver.completed_seq() == 2 and saver.is_done(t1)
    _check(hk[0], hv[0], saves)


def test_completed_seq_monotone_with_many_saves():
    hk, hv = _tiers(P=256, L=2)
    saves = _saves(60, 7, 256, seed=1)
    seen, stop = [], threading.Event()

    def sample():
        while not stop.is_set():
            seen.append(saver.completed_seq())

    # a ring of ~3 saves: constant back-pressure, chunks finish out of order across 4 threads
    with FlashD2HSaver(hk, hv, num_threads=4, staging_bytes=3 * 2 * 7 * ROW + 512,
                       min_rows_per_part=2) as saver:
        th = threading.Thread(target=sample)
        th.start()
        tickets = [saver.save(i % 2, *s) for i, s in enumerate(saves)]
        saver.wait_all()
        stop.set()
        th.join()
        seen.append(saver.completed_seq())
    assert tickets == list(range(1, 61))
    assert all(a <= b for a, b in zip(seen, seen[1:])) and seen[-1] == 60
    for layer in range(2):
        _check(hk[layer], hv[layer], saves[layer::2])


def test_ring_back_pressure_blocks_and_never_overwrites(gate):
    hk, hv = _tiers(P=128)
    saves = _saves(6, 4, 128, seed=2)
    cap = 2 * (2 * 4 * ROW)                        # exactly two saves of K + V fit
    saver = FlashD2HSaver(hk, hv, num_threads=2, staging_bytes=cap)
    issued = []

    def producer():
        for s in saves:
            issued.append(saver.save(0, *s))

    th = threading.Thread(target=producer)
    th.start()
    time.sleep(0.3)
    assert len(issued) == 2 and th.is_alive()      # third save waits for ring space
    assert saver.ring_stalls == 1 and saver.completed_seq() == 0
    gate.set()
    th.join(10)
    assert not th.is_alive() and issued == [1, 2, 3, 4, 5, 6]
    saver.close()
    assert saver.completed_seq() == 6
    _check(hk[0], hv[0], saves)                    # staged data was never overwritten early


def test_big_save_is_chunked_and_exact():
    hk, hv = _tiers(P=128)
    saves = _saves(1, 100, 128, seed=3)
    with FlashD2HSaver(hk, hv, num_threads=3, staging_bytes=16 * 2 * ROW,
                       min_rows_per_part=4) as saver:      # ~8 tokens per chunk
        saver.wait(saver.save(0, *saves[0]))
        st = saver.stats()
    _check(hk[0], hv[0], saves)
    assert st.rows == int((saves[0][2] >= 0).sum()) and st.busy_s > 0


def test_staging_too_small():
    hk, hv = _tiers()
    with FlashD2HSaver(hk, hv, num_threads=1, staging_bytes=ROW) as saver:  # < one token K+V
        with pytest.raises(ValueError):
            saver.save(0, *_saves(1, 1, 64)[0])


def test_scatter_error_surfaces(monkeypatch):
    before = set(_d2h_threads())               # other tests' savers may still be collected
    hk, hv = _tiers()
    orig = fd._scatter
    calls = []

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError("boom")
        return orig(*a, **k)

    monkeypatch.setattr(fd, "_scatter", flaky)
    saves = _saves(2, 3, 64, seed=4)
    saver = FlashD2HSaver(hk, hv, num_threads=1, staging_bytes=1 << 14)
    t1 = saver.save(0, *saves[0])
    t2 = saver.save(0, *saves[1])
    with pytest.raises(RuntimeError, match="save 1 failed"):
        saver.wait(t1)
    saver.wait(t2)                                 # later saves still complete
    assert saver.completed_seq() == 2
    with pytest.raises(RuntimeError):
        saver.close()                              # reported again, threads stopped anyway
    assert not set(_d2h_threads()) - before    # this saver's threads are gone
    _check(hk[0], hv[0], saves[1:])


def _d2h_threads():
    """Live FlashD2H worker threads (of any saver in the process)."""
    return [t for t in threading.enumerate() if t.name.startswith("flash-d2h") and t.is_alive()]


def test_close_stops_threads_and_is_idempotent():
    gc.collect()
    before = len(_d2h_threads())
    hk, hv = _tiers()
    saver = FlashD2HSaver(hk, hv, num_threads=5, staging_bytes=1 << 14)
    assert len(_d2h_threads()) == before + 5
    saver.wait(saver.save(0, *_saves(1, 3, 64)[0]))
    saver.close()
    saver.close()
    assert len(_d2h_threads()) == before
    with pytest.raises(RuntimeError):
        saver.save(0, *_saves(1, 3, 64)[0])


def test_no_leak_without_close():
    gc.collect()  # savers other tests dropped without close() stop here, not mid-test
    before = len(_d2h_threads())
    hk, hv = _tiers()
    for _ in range(3):
        saver = FlashD2HSaver(hk, hv, num_threads=3, staging_bytes=1 << 14)
        saver.wait(saver.save(0, *_saves(1, 2, 64)[0]))
        del saver
        gc.collect()
    deadline = time.time() + 5
    while len(_d2h_threads()) > before and time.time() < deadline:
        time.sleep(0.01)
    assert len(_d2h_threads()) == before


@pytest.mark.cpu_only("on CPU the staging copy is synchronous; the CUDA counterpart is "
                       "test_cuda_overwrite_after_wait_copy_on_stream")
def test_copy_done_before_save_returns_on_cpu():
    """On CPU the staging copy is synchronous: k_new may be overwritten right after save()."""
    hk, hv = _tiers()
    k, v, pages, offs = _saves(1, 6, 64, seed=5)[0]
    keep_k, keep_v = k.clone(), v.clone()
    with FlashD2HSaver(hk, hv, num_threads=2, staging_bytes=1 << 14) as saver:
        t = saver.save(0, k, v, pages, offs)
        k.zero_()
        v.zero_()
        saver.wait_copy_on_stream(t)               # no-op on CPU
        saver.wait(t)
    _check(hk[0], hv[0], [(keep_k, keep_v, pages, offs)])


@pytest.mark.gpu_only("CUDA streams: the staging copy is asynchronous only there")
def test_cuda_overwrite_after_wait_copy_on_stream():
    hk, hv = _tiers()
    k, v, pages, offs = _saves(1, 6, 64, seed=6)[0]
    keep_k, keep_v = k.clone(), v.clone()
    with FlashD2HSaver(hk, hv, num_threads=2, staging_bytes=1 << 14) as saver:
        torch.cuda._sleep(10_000_000)                # compute stream busy
        t = saver.save(0, k, v, pages, offs)
        saver.wait_copy_on_stream(t)
        k.zero_()
        v.zero_()
        saver.wait(t)
    sync()
    _check(hk[0], hv[0], [(keep_k, keep_v, pages, offs)])
