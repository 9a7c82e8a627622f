"""FlashD2H's head-major scatter: whole pages move as one row each, the rest (unaligned starts,
partial last pages, decode tokens, masked rows) by row scatter. Bit-exact against a reference
for odd token counts, page sizes 16 / 32, fp32 / bf16, chunked saves, parts cut by threads,
per-head offsets and not densely packed host layers; stats count rows and page regions exactly
(page_runs)."""
import numpy as np
import pytest
import torch

from sparseserve.transfer import FlashD2HSaver
from sparseserve.transfer import page_scatter as pscat
from sparseserve.transfer.common import page_runs

from . import DEV, PIN, batch_layout, filled, random_bits, same_bits

H, D = 4, 32
SENTINEL = 0x5A5A


def _layout(T, ps, P, rng, pad):
    """A hybrid batch of T new tokens (+ pad masked rows): a prefill chunk starting mid-page,
    a second chunk starting on a page, and decode tokens; some heads of some rows masked."""
    if T == 1:
        lens, new = [int(rng.integers(0, 3 * ps))], [1]
    else:
        a = max(1, (2 * T) // 3)
        b = max(0, T - a - 3)
        c = T - a - b
        lens = [int(rng.integers(1, ps)), 2 * ps, *[int(rng.integers(0, 4 * ps)) for _ in range(c)]]
        new = [a, b, *[1] * c]
    pages, offs, _ = batch_layout(lens, new, H, ps, P, rng, pad=pad)
    drop = rng.random(pages.shape) < 0.01                         # a few masked (head, token)
    pages[drop] = -1
    return pages, offs


def _reference(hk, hv, k, v, pages, offs):
    ob = np.broadcast_to(offs.reshape(len(pages), -1), pages.shape)
    rk, rv = hk.clone(), hv.clone()
    for t in range(pages.shape[0]):
        for h in range(H):
            if pages[t, h] >= 0:
                rk[pages[t, h], ob[t, h]] = k[t, h]
                rv[pages[t, h], ob[t, h]] = v[t, h]
    return rk, rv


def _stats_want(pages, offs):
    o = offs.reshape(len(pages), -1)
    return int((pages >= 0).sum()), len(page_runs(pages, o)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ps", [16, 32])
@pytest.mark.parametrize("T", [1, 17, 54, 97])
@pytest.mark.parametrize("mode", ["one-part", "threads", "chunked", "per-head-offsets",
                                  "not-dense"])
def test_head_major_scatter_exact(mode, T, ps, dtype):
    rng = np.random.default_rng(T * 131 + ps)
    gen = torch.Generator().manual_seed(T + ps)
    P = 200
    pages, offs = _layout(T, ps, P, rng, pad=2 if T > 1 else 0)
    n = len(pages)
    if mode == "per-head-offsets":                 # same rows, offsets given per head
        offs = np.broadcast_to(offs[:, None], pages.shape).copy()
    if mode == "not-dense":                        # layer 1 of a [P, 2, ps, D] host tier
        bigk = filled((P, 2, ps, D), dtype, SENTINEL, pin=PIN)
        bigv = filled((P, 2, ps, D), dtype, SENTINEL, pin=PIN)
        hk, hv = bigk[:, 1], bigv[:, 1]
    else:
        hk, hv = filled((P, ps, D), dtype, SENTINEL, pin=PIN), filled((P, ps, D), dtype, SENTINEL, pin=PIN)
    k = random_bits((n, H, D), dtype, gen, DEV)
    v = random_bits((n, H, D), dtype, gen, DEV)
    want_k, want_v = _reference(hk, hv, k.cpu(), v.cpu(), pages, offs)
    tok = H * D * k.element_size()
    kw = dict(num_threads=1, staging_bytes=1 << 20, min_rows_per_part=1 << 20)
    if mode == "threads":                          # parts cut inside heads and pages
        kw.update(num_threads=5, min_rows_per_part=7)
    if mode == "chunked":                          # ~ps + 5 tokens per chunk, 3 threads
        kw.update(num_threads=3, min_rows_per_part=9,
                  staging_bytes=2 * 2 * (-(-(ps + 5) * tok // 256) * 256) + 256)
    with FlashD2HSaver([hk], [hv], **kw) as saver:
        saver.wait(saver.save(0, k, v, pages, offs))
        st = saver.stats()
    if mode == "not-dense":
        assert same_bits(bigk[:, 0], filled((P, ps, D), dtype, SENTINEL))
    assert same_bits(hk, want_k) and same_bits(hv, want_v)
    rows, regions = _stats_want(pages, offs)
    assert (st.rows, st.pages) == (rows, regions)
    assert st.bytes == rows * 2 * D * k.element_size()


def test_whole_pages_take_the_page_path(monkeypatch):
    """A page-aligned prefill moves whole pages only (no row scatter), also for groups too short
    to copy directly (gathered); a decode step moves rows only."""
    ps, P, dtype = 16, 64, torch.bfloat16
    calls = {"full": 0}
    orig = pscat._copy_full_pages

    def spy(*a, **kw):
        calls["full"] += len(a[4])
        return orig(*a, **kw)

    monkeypatch.setattr(pscat, "_copy_full_pages", spy)
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    hk, hv = filled((P, ps, D), dtype, SENTINEL), filled((P, ps, D), dtype, SENTINEL)
    # request 0: 5 whole pages (direct group); request 1: 2 whole pages (gathered) + 3 tokens
    pages, offs, _ = batch_layout([0, 0], [5 * ps, 2 * ps + 3], H, ps, P, rng)
    k = random_bits((len(pages), H, D), dtype, gen)
    v = random_bits((len(pages), H, D), dtype, gen)
    want_k, want_v = _reference(hk, hv, k, v, pages, offs)
    hkv = (pscat._HostViews(hk), pscat._HostViews(hv))
    kh = k.transpose(0, 1).contiguous().view(torch.int16).numpy().reshape(-1, D)
    vh = v.transpose(0, 1).contiguous().view(torch.int16).numpy().reshape(-1, D)
    n = len(pages)
    rows, regions = pscat._scatter(*hkv, ps, kh, vh, pages, offs[:, None], 0, n, 0, n * H)
    assert calls["full"] == 7 * H
    assert (rows, regions) == (n * H, 8 * H)
    assert same_bits(hk, want_k) and same_bits(hv, want_v)
    # decode: one token per request, no whole page
    calls["full"] = 0
    pages2 = pages[[5 * ps - 1, n - 1]].copy()
    pages2[1, 2] = -1
    offs2 = np.array([ps - 1, 2])
    k2 = random_bits((2, H, D), dtype, gen)
    v2 = random_bits((2, H, D), dtype, gen)
    want_k, want_v = _reference(hk, hv, k2, v2, pages2, offs2)
    kh = k2.transpose(0, 1).contiguous().view(torch.int16).numpy().reshape(-1, D)
    vh = v2.transpose(0, 1).contiguous().view(torch.int16).numpy().reshape(-1, D)
    assert pscat._scatter(*hkv, ps, kh, vh, pages2, offs2[:, None], 0, 2, 0, 2 * H) == (2 * H - 1,) * 2
    assert calls["full"] == 0
    assert same_bits(hk, want_k) and same_bits(hv, want_v)


def test_full_pages_brute_force():
    rng = np.random.default_rng(1)
    for _ in range(400):
        ps = int(rng.integers(1, 5))
        m, Hh = int(rng.integers(1, 14)), int(rng.integers(1, 4))
        pg = rng.integers(-1, 3, (m, Hh))
        if rng.random() < 0.5:                     # mostly whole pages
            pg = np.repeat(rng.integers(-1, 3, (m // ps + 1, Hh)), ps, axis=0)[:m]
        col = rng.random() < 0.6
        of = rng.integers(0, ps, (m, 1 if col else Hh))
        if rng.random() < 0.6:
            of[:] = ((np.arange(m) + int(rng.integers(0, ps))) % ps)[:, None]
        ob = np.broadcast_to(of, pg.shape)
        t, h = pscat._full_pages(pg, of, ps)
        want = [(i, j) for j in range(Hh) for i in range(m - ps + 1)
                if pg[i, j] >= 0 and all(pg[i + k, j] == pg[i, j] and ob[i + k, j] == k
                                         for k in range(ps))]
        assert list(zip(t.tolist(), h.tolist())) == want, (ps, pg, of)


def test_rects_partition_rows():
    for n in range(1, 7):
        for N in range(1, 4 * n + 1, n):
            H_ = -(-N // n)
            for r0 in range(0, H_ * n):
                for r1 in range(r0 + 1, H_ * n + 1):
                    got = []
                    for t0, t1, h0, h1, s in pscat._rects(n, r0, r1):
                        assert h1 - h0 == 1 or (t0, t1) == (0, n)
                        assert s == h0 * n + t0
                        got += [h * n + t for h in range(h0, h1) for t in range(t0, t1)]
                    assert got == list(range(r0, r1))
