"""Scatter of staged (head-major) K/V rows into host pages, for FlashD2H's worker threads:
whole pages move as single rows of a [P, page_size * D] view, the rest row by row."""
from __future__ import annotations

import numpy as np
import torch

from .common import bits_view, count_page_runs

class _HostViews:
    """numpy (integer bit) views of one layer's K or V host tier [P, page_size, D]:
    ``cube`` [P, ps, D]; ``rows`` [P * ps, D] when the layer is densely packed, else None;
    ``pages`` [P, ps * D] (a page as one row) when every page is contiguous, else None."""
    __slots__ = ("cube", "rows", "pages")

    def __init__(self, t: torch.Tensor) -> None:
        a = bits_view(t).numpy()
        P, ps, D = a.shape
        self.cube = a
        self.rows = a.reshape(P * ps, D) if t.is_contiguous() else None
        self.pages = None
        if t.stride(2) == 1 and t.stride(1) == D:
            self.pages = np.lib.stride_tricks.as_strided(a, (P, ps * D),
                                                         (a.strides[0], a.strides[2]))


_EMPTY = np.zeros(0, np.int64)
MIN_DIRECT_GROUP = 4        # whole pages in a row copied straight from staging (no gather)
_windows = np.lib.stride_tricks.sliding_window_view


def _rects(n: int, r0: int, r1: int):
    """The head-major rows [r0, r1) of a chunk of n tokens (row r = head r // n, token r % n)
    as at most 3 rectangles (t0, t1, h0, h1, first row): one head's token range, or whole
    heads; the rows of each are contiguous in staging."""
    out = []
    h, t = divmod(r0, n)
    hl, tl = divmod(r1 - 1, n)
    tl += 1
    if h == hl:
        return [(t, tl, h, h + 1, r0)]
    if t:
        out.append((t, n, h, h + 1, r0))
        h += 1
    if tl < n:
        if hl > h:
            out.append((0, n, h, hl, h * n))
        out.append((0, tl, hl, hl + 1, hl * n))
    else:
        out.append((0, n, h, hl + 1, h * n))
    return out


def _full_pages(pg, of, ps: int):
    """Whole pages of a token-major block: (t, h) such that rows t .. t + ps - 1 of head h are
    offsets 0 .. ps - 1 of one live page. pg [m, Hs]; of [m, 1] or [m, Hs].
    -> (t, h) int arrays, head-major order; never overlapping."""
    m, Hs = pg.shape
    if m < ps:
        return _EMPTY, _EMPTY
    if of.shape[1] == 1:
        # offsets shared by the heads: candidates from the offset column alone, then the page
        # must stay the same over the window
        o = of[:, 0]
        c = np.flatnonzero(o[:m - ps + 1] == 0)
        if ps > 1 and c.size:
            c = c[_windows(np.diff(o) == 1, ps - 1)[c].all(axis=1)]
        if c.size == 0:
            return _EMPTY, _EMPTY
        ok = pg[c] >= 0
        if ps > 1:
            ok &= _windows(pg[1:] == pg[:-1], ps - 1, axis=0)[c].all(axis=2)
    else:
        c = np.flatnonzero((of[:m - ps + 1] == 0).any(axis=1))
        if c.size == 0:
            return _EMPTY, _EMPTY
        ok = (pg[c] >= 0) & (of[c] == 0)
        if ps > 1:
            key = pg * ps + of
            ok &= _windows(key[1:] - key[:-1] == 1, ps - 1, axis=0)[c].all(axis=2)
    h, i = np.nonzero(ok.T)
    return c[i], h


def _copy_full_pages(dst_k, dst_v, src_k, src_v, dst_pages, starts, ps: int) -> None:
    """dst[dst_pages[i]] = staged rows starts[i] .. starts[i] + ps - 1 (one page each).

    Whole pages following each other in staging (starts ps apart: a prefill chunk of one head)
    are one fancy assignment from a plain view of staging: ps * D element rows (16 KB for
    64-token bf16 pages of D=128), a single copy; when their host pages are consecutive too
    (pages come in chunks of consecutive ids: KVCacheManager) a slice copy, one memcpy. Short groups are gathered through a window
    view in one call (a second copy)."""
    D = src_k.shape[1]
    rowlen = ps * D
    brk = np.flatnonzero(np.diff(starts) != ps) + 1
    bounds = [0, *brk.tolist(), starts.size]
    rest = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b - a >= MIN_DIRECT_GROUP:
            s0 = int(starts[a])
            idx = dst_pages[a:b]
            p0 = int(idx[0])
            if int(idx[-1]) - p0 == b - a - 1 and np.all(np.diff(idx) == 1):
                idx = slice(p0, p0 + b - a)  # consecutive pages (a chunk): one memcpy
            dst_k[idx] = src_k[s0:s0 + (b - a) * ps].reshape(b - a, rowlen)
            dst_v[idx] = src_v[s0:s0 + (b - a) * ps].reshape(b - a, rowlen)
        else:
            rest.append(np.arange(a, b))
    if rest:
        sel = np.concatenate(rest) if len(rest) > 1 else rest[0]
        st, idx = starts[sel], dst_pages[sel]
        for dst, src in ((dst_k, src_k), (dst_v, src_v)):
            win = np.lib.stride_tricks.as_strided(src, (src.shape[0] - ps + 1, rowlen),
                                                  src.strides, writeable=False)
            dst[idx] = win[st]


def _scatter_rect(host_k, host_v, ps, src_k, src_v, pages, offsets, ta, tb, h0, h1):
    """One rectangle of _scatter: tokens [ta, tb) x heads [h0, h1) of the save, staged
    head-major in src_k/src_v [(h1 - h0) * (tb - ta), D]. -> (rows, regions)."""
    pg = pages[ta:tb, h0:h1]
    of = offsets[ta:tb] if offsets.shape[1] == 1 else offsets[ta:tb, h0:h1]
    m, Hs = pg.shape
    live = pg >= 0
    nlive = int(np.count_nonzero(live))
    if nlive == 0:
        return 0, 0
    F = 0
    if host_k.pages is not None and host_v.pages is not None:
        tc, hc = _full_pages(pg, of, ps)
        F = int(tc.size)
    rows_ok = host_k.rows is not None and host_v.rows is not None
    if not F:
        # no whole page (decode tokens, short or unaligned runs): plain row scatter, rows in
        # staging order (no gather of the source unless rows are masked)
        ofm = np.broadcast_to(of, pg.shape)
        q = None if nlive == pg.size else np.flatnonzero(live.T)
        if q is not None:
            src_k, src_v = src_k[q], src_v[q]
        if rows_ok:
            key = np.ascontiguousarray((pg * ps + of).T).reshape(-1)
            key = key if q is None else key[q]
            host_k.rows[key] = src_k
            host_v.rows[key] = src_v
        else:
            pq = np.ascontiguousarray(pg.T).reshape(-1)
            oq = np.ascontiguousarray(ofm.T).reshape(-1)
            if q is not None:
                pq, oq = pq[q], oq[q]
            host_k.cube[pq, oq] = src_k
            host_v.cube[pq, oq] = src_v
        offs_cols = offsets if offsets.shape[1] == 1 else offsets[:, h0:h1]
        return nlive, count_page_runs(pages[:, h0:h1], offs_cols, ta, tb)
    _copy_full_pages(host_k.pages, host_v.pages, src_k, src_v, pg[tc, hc], hc * m + tc, ps)
    if F * ps == nlive:
        return nlive, F
    # the rest (a prefill's partial first / last page, masked rows): few rows, gathered
    rest = np.ascontiguousarray(live.T)                        # [Hs, m], head-major
    rest[hc[:, None], tc[:, None] + np.arange(ps)] = False
    q = np.flatnonzero(rest)
    hq, tq = np.divmod(q, m)
    src_k, src_v = src_k[q], src_v[q]
    pq = pg[tq, hq]
    oq = of[tq, hq if of.shape[1] > 1 else 0]
    if rows_ok:
        key = pq * ps + oq
        host_k.rows[key] = src_k
        host_v.rows[key] = src_v
    else:
        host_k.cube[pq, oq] = src_k
        host_v.cube[pq, oq] = src_v
    # page regions among these rows (whole pages are regions of their own): a row starts one
    # unless the previous token of its head is the previous offset of its page
    t, h = tq + ta, hq + h0
    prev = t > 0
    tp, hp = t[prev] - 1, h[prev]
    cont = (pages[tp, hp] == pq[prev]) & (offsets[tp, hp if offsets.shape[1] > 1 else 0]
                                          + 1 == oq[prev])
    return nlive, F + q.size - int(np.count_nonzero(cont))


def _scatter(host_k: _HostViews, host_v: _HostViews, page_size: int, src_k, src_v, pages,
             offsets, c0: int, n: int, r0: int, r1: int) -> tuple[int, int]:
    """host[page, offset] = staged row, for the head-major rows [r0, r1) of the chunk of
    tokens [c0, c0 + n) (row r: head r // n, token c0 + r % n), rows with page >= 0.

    src_k/src_v: [r1 - r0, D] staged rows (head-major: consecutive tokens of one head follow
    each other); pages: [T, H] int64 of the whole save; offsets: [T, 1] or [T, H] int64.
    Whole pages (offsets 0 .. ps-1 of one page in consecutive rows) move as one ps * D row
    each; the other rows (decode tokens, a prefill's first / last partial page) by row
    scatter. -> (rows written, page regions starting here: exact when summed over a partition
    of the rows of a save, like ``count_page_runs``)."""
    rows = regions = 0
    for t0, t1, h0, h1, s in _rects(n, r0, r1):
        cnt = (t1 - t0) * (h1 - h0)
        a, b = _scatter_rect(host_k, host_v, page_size, src_k[s - r0:s - r0 + cnt],
                             src_v[s - r0:s - r0 + cnt], pages, offsets, c0 + t0, c0 + t1, h0, h1)
        rows, regions = rows + a, regions + b
    return rows, regions


def _snap_cut(offsets, c0: int, n: int, r: int, ps: int) -> int:
    """Move the head-major row cut r of a chunk forward to the next page start (offset 0) of
    its head, at most one page on, so that parts do not split whole pages."""
    h, t = divmod(r, n)
    if t == 0:
        return r
    col = offsets[c0 + t:c0 + min(n, t + ps), h if offsets.shape[1] > 1 else 0]
    z = np.flatnonzero(col == 0)
    return r + int(z[0]) if z.size else r
