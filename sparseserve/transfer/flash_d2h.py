"""FlashD2H: save a step's new KV to host pages with one device-to-host copy plus CPU threads.

The new KV of a step ``[T, Hkv, D]`` is contiguous before it is scattered into pages. ``save``
copies it with ONE ``copy_`` per K / V into a pinned staging ring, on a side CUDA stream that
first waits on an event recorded on the caller's (compute) stream; worker threads wait for that
copy and scatter the staged rows into the host pages (numpy fancy indexing on integer views,
which releases the GIL), overlapped with the compute stream. A save larger than half the ring
is split into chunks (one copy each, cut on page multiples) so copying and scattering pipeline.

Staging is head-major: the side stream first transposes a chunk to ``[Hkv, n, D]`` on the
device (one extra device copy into a stream-ordered temporary, cheap next to PCIe), so a
head's consecutive tokens are adjacent in staging and a whole page (offsets 0 .. ps-1 of one
page in consecutive tokens of one head) is one contiguous ``ps * D`` run. The scatter moves
whole pages as single rows of a ``[P, ps * D]`` view (one fancy assignment per group of pages
that follow each other in staging), and only the rest (decode tokens, a prefill's partial
first / last page, masked rows) by ``D``-element row scatter. Each chunk's head-major rows are
cut into up to ``num_threads`` equal parts, cuts moved to page starts, so threads write
disjoint pages. Within one save, rows naming the same (page, offset) twice leave either.

Ordering and safety:
* Tickets are 1, 2, 3, ...; ``completed_seq()`` is the highest ticket t with every ticket <= t
  scattered (monotone), ``wait(t)`` blocks until then. Read a host page (FlashH2D, memcpy)
  only after the save that wrote it has completed.
* A staging region is reused only after its scatter (and every older one) finished: ``save``
  blocks when the ring is full (back-pressure), it never overwrites.
* ``k_new``/``v_new`` are kept alive for the side stream (``record_stream``); if their memory is
  overwritten in place by later work (a static buffer, a CUDA graph), call
  ``wait_copy_on_stream(ticket)`` before enqueuing that work.
* Two in-flight saves must not write the same (page, offset); a host page may be freed or
  reused only once the saves that wrote it completed.

On CPU tensors the copy into staging is synchronous and the same threads scatter.
"""
from __future__ import annotations

import queue
import threading
import time
import weakref

import numpy as np
import torch

from .common import TransferStats, bits_view, check_save_args, count_page_runs
from .staging_ring import StagingRing

__all__ = ["FlashD2HSaver"]

DEFAULT_STAGING_BYTES = 256 << 20


def _worker(q: "queue.SimpleQueue") -> None:
    while True:
        task = q.get()
        if task is None:
            return
        task()
        del task            # do not keep the saver alive while idle (its finalizer stops us)


def _shutdown(q: "queue.SimpleQueue", threads: list) -> None:
    for _ in threads:
        q.put(None)
    for t in threads:
        if t is not threading.current_thread():
            t.join()


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
    64-token bf16 pages of D=128), a single copy. Short groups are gathered through a window
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


class FlashD2HSaver:
    """See the module doc. ``host_k_layers`` / ``host_v_layers``: per layer host tier
    ``[P, page_size, D]`` (pinned CPU tensors on a GPU machine); they must stay alive as long
    as the saver."""

    def __init__(self, host_k_layers, host_v_layers, num_threads: int = 4,
                 staging_bytes: int = DEFAULT_STAGING_BYTES, *, pin_memory: bool | None = None,
                 min_rows_per_part: int = 4096, validate: bool = True) -> None:
        if len(host_k_layers) != len(host_v_layers):
            raise ValueError("host_k_layers and host_v_layers differ in length")
        if num_threads < 1:
            raise ValueError("num_threads must be >= 1")
        self.host_k, self.host_v = list(host_k_layers), list(host_v_layers)
        for hk, hv in zip(self.host_k, self.host_v):
            if hk.device.type != "cpu" or hv.device.type != "cpu" or hk.shape != hv.shape:
                raise ValueError("host tiers must be CPU tensors, K and V of the same shape")
        self._np_k = [_HostViews(t) for t in self.host_k]
        self._np_v = [_HostViews(t) for t in self.host_v]
        self.num_threads = num_threads
        self.min_rows_per_part = max(1, min_rows_per_part)
        self.validate = validate
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._staging = torch.empty(staging_bytes, dtype=torch.uint8, pin_memory=pin)
        self._staging_np = self._staging.numpy()
        self._ring = StagingRing(staging_bytes)
        self._cond = threading.Condition(threading.Lock())
        self._issued = 0
        self._completed = 0
        self._done: set[int] = set()
        self._parts_left: dict[int, int] = {}         # ticket -> scatter parts outstanding
        self._region_parts: dict[int, list] = {}      # id(region) -> [parts outstanding, region]
        self._errors: dict[int, BaseException] = {}
        self._copy_events: dict[int, object] = {}     # ticket -> last D2H copy event (CUDA)
        self._stats = TransferStats()
        self.ring_stalls = 0                          # saves that waited for ring space
        self._side: dict = {}                         # device -> side stream
        self._closed = False
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=_worker, args=(self._queue,),
                                          name=f"flash-d2h-{i}", daemon=True)
                         for i in range(num_threads)]
        for t in self._threads:
            t.start()
        self._finalizer = weakref.finalize(self, _shutdown, self._queue, self._threads)

    # ---- public API --------------------------------------------------------------------------
    def save(self, layer: int, k_new, v_new, host_pages, offsets) -> int:
        """Queue the save of ``k_new``/``v_new`` [T, Hkv, D] (rows (t, h) go to host page
        ``host_pages[t, h]`` (< 0: not saved) at token offset ``offsets[t]``; offsets may also
        be [T, Hkv]). Returns a ticket at once unless the staging ring is full."""
        if self._closed:
            raise RuntimeError("FlashD2HSaver is closed")
        a = check_save_args(self.host_k, layer, k_new, v_new, host_pages, offsets, self.validate)
        T, H, D = a.k.shape
        esz = a.k.element_size()
        tok_bytes = H * D * esz
        row_bytes = 2 * D * esz
        ps = self.host_k[layer].shape[1]
        chunk = self._chunk_tokens(tok_bytes) if T else 1
        if ps < chunk < T:
            chunk -= chunk % ps                        # chunk cuts on page multiples
        plan = []                                      # (c0, c1, [(r0, r1), ...])
        for c0 in range(0, T, chunk):
            c1 = min(T, c0 + chunk)
            N = (c1 - c0) * H                          # staged rows, head-major
            nparts = min(self.num_threads, max(1, N // self.min_rows_per_part))
            cuts = [0]
            for i in range(1, nparts):
                cuts.append(max(cuts[-1], _snap_cut(a.offsets, c0, c1 - c0, N * i // nparts, ps)))
            cuts.append(N)
            plan.append((c0, c1, [(r0, r1) for r0, r1 in zip(cuts[:-1], cuts[1:]) if r1 > r0]))
        with self._cond:
            self._issued += 1
            ticket = self._issued
            self._parts_left[ticket] = sum(len(p) for _, _, p in plan)
            self._stats.calls += 1
            if not plan:
                self._finish_locked(ticket)
                return ticket
        cuda = a.k.is_cuda
        if cuda:
            dev = a.k.device
            side = self._side.get(dev)
            if side is None:
                side = self._side[dev] = torch.cuda.Stream(device=dev)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(dev))
            side.wait_event(ready)
        ev, queued, region, region_queued, parts = None, 0, None, 0, ()
        try:
            for c0, c1, parts in plan:
                n = c1 - c0
                half = self._ring.round(n * tok_bytes)
                region, region_queued = None, 0
                region = self._alloc(2 * half)
                with self._cond:
                    self._region_parts[id(region)] = [len(parts), region]
                views = []
                for i, src in enumerate((a.k, a.v)):
                    lo = region.start + i * half
                    # head-major staging [H, n, D]: a head's consecutive tokens are adjacent,
                    # so whole pages are contiguous ps * D runs for the scatter
                    dst = self._staging[lo:lo + n * tok_bytes].view(a.k.dtype).view(H, n, D)
                    hm = src[c0:c1].transpose(0, 1)
                    if cuda:
                        with torch.cuda.stream(side):
                            # transpose on the device (side stream; the temporary is
                            # stream-ordered), then one contiguous D2H copy
                            dst.copy_(hm.contiguous(), non_blocking=True)
                    else:
                        dst.copy_(hm)
                    views.append(self._staging_np[lo:lo + n * tok_bytes]
                                 .view(self._np_k[layer].cube.dtype).reshape(n * H, D))
                if cuda:
                    ev = torch.cuda.Event()
                    ev.record(side)
                for r0, r1 in parts:
                    self._queue.put(self._part_task(ticket, region, ev, layer, views, a.pages,
                                                    a.offsets, c0, c1 - c0, r0, r1, row_bytes))
                    queued += 1
                    region_queued += 1
        except BaseException as exc:
            nparts = sum(len(p) for _, _, p in plan)
            self._abandon(ticket, nparts - queued, region, len(parts) - region_queued, exc)
            raise
        if cuda:
            a.k.record_stream(side)
            a.v.record_stream(side)
            with self._cond:
                if ticket in self._parts_left:             # not scattered yet
                    self._copy_events[ticket] = (ev, dev)
        return ticket

    def completed_seq(self) -> int:
        """Highest ticket t such that every ticket <= t has been scattered (monotone)."""
        with self._cond:
            return self._completed

    def is_done(self, ticket: int) -> bool:
        with self._cond:
            return ticket <= self._completed or ticket in self._done

    def wait(self, ticket: int, timeout: float | None = None) -> None:
        """Block until every ticket <= ``ticket`` is scattered; raise a scatter error of
        ``ticket`` if it had one. TimeoutError if ``timeout`` s pass first."""
        if ticket > self._issued:
            raise ValueError(f"ticket {ticket} was never issued (last: {self._issued})")
        with self._cond:
            if not self._cond.wait_for(lambda: self._completed >= ticket, timeout):
                raise TimeoutError(f"save {ticket} not done after {timeout} s")
            err = self._errors.get(ticket)
        if err is not None:
            raise RuntimeError(f"FlashD2H save {ticket} failed") from err

    def wait_all(self, timeout: float | None = None) -> None:
        """Wait for every save issued so far; raise the first scatter error, if any."""
        if self._issued:
            self.wait(self._issued, timeout)
        with self._cond:
            err = next(iter(sorted(self._errors.items())), None)
        if err is not None:
            raise RuntimeError(f"FlashD2H save {err[0]} failed") from err[1]

    def wait_copy_on_stream(self, ticket: int, stream=None) -> None:
        """Make ``stream`` (default: the current stream) wait, on the GPU, until the
        device-to-host copy of ``ticket`` has read k_new/v_new (no host sync). Needed only
        before overwriting k_new/v_new in place; a no-op on CPU and for completed tickets."""
        with self._cond:
            entry = self._copy_events.get(ticket)
        if entry is not None:
            ev, dev = entry
            (stream if stream is not None else torch.cuda.current_stream(dev)).wait_event(ev)

    def stats(self) -> TransferStats:
        with self._cond:
            return TransferStats(**vars(self._stats))

    def close(self) -> None:
        """Wait for outstanding saves, then stop the worker threads. Idempotent; later saves
        raise. Scatter errors are re-raised after the threads have stopped."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait_all()
        finally:
            self._finalizer()

    def __enter__(self) -> "FlashD2HSaver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals ---------------------------------------------------------------------------
    def _chunk_tokens(self, tok_bytes: int) -> int:
        """Tokens per staged chunk: K + V of a chunk fit half the ring (so two chunks can be in
        flight), or the whole ring for huge tokens."""
        cap, align = self._ring.capacity, self._ring.align
        for budget in (cap // 2, cap):
            n = ((budget // 2) // align * align) // tok_bytes
            if n >= 1:
                return n
        raise ValueError(f"staging_bytes={cap} cannot hold one token of K and V "
                         f"({2 * tok_bytes} bytes)")

    def _alloc(self, nbytes: int):
        with self._cond:
            region = self._ring.try_alloc(nbytes)
            if region is None:
                self.ring_stalls += 1
            while region is None:
                self._cond.wait(0.5)
                region = self._ring.try_alloc(nbytes)
            return region

    def _part_task(self, ticket, region, ev, layer, views, pages, offsets, c0, n, r0, r1,
                   row_bytes):
        """Scatter the head-major staged rows [r0, r1) of the chunk of tokens [c0, c0 + n)."""
        ps = self.host_k[layer].shape[1]
        hk, hv = self._np_k[layer], self._np_v[layer]
        src_k = views[0][r0:r1]
        src_v = views[1][r0:r1]

        def run() -> None:
            err, busy, npages, rows = None, 0.0, 0, 0
            try:
                if ev is not None:
                    ev.synchronize()
                t0 = time.perf_counter()
                rows, npages = _scatter(hk, hv, ps, src_k, src_v, pages, offsets, c0, n, r0, r1)
                busy = time.perf_counter() - t0
            except BaseException as exc:  # noqa: BLE001 - reported through wait()
                err = exc
            with self._cond:
                self._release_part_locked(region)
                s = self._stats
                s.pages += npages
                s.rows += rows
                s.bytes += rows * row_bytes
                s.busy_s += busy
                if err is not None:
                    self._errors.setdefault(ticket, err)
                self._parts_left[ticket] -= 1
                if self._parts_left[ticket] == 0:
                    self._finish_locked(ticket)
                self._cond.notify_all()

        return run

    def _release_part_locked(self, region) -> None:
        entry = self._region_parts[id(region)]
        entry[0] -= 1
        if entry[0] == 0:
            region.released = True
            del self._region_parts[id(region)]

    def _abandon(self, ticket: int, unqueued: int, region, region_unqueued: int,
                 exc: BaseException) -> None:
        """save() failed after issuing its ticket: forget the parts never queued (releasing a
        region none of whose parts run), fail the ticket; it completes once queued parts ran."""
        with self._cond:
            if region is not None and id(region) in self._region_parts:
                for _ in range(region_unqueued):
                    self._release_part_locked(region)
            self._errors.setdefault(ticket, exc)
            self._parts_left[ticket] -= unqueued
            if self._parts_left[ticket] == 0:
                self._finish_locked(ticket)
            self._cond.notify_all()

    def _finish_locked(self, ticket: int) -> None:
        del self._parts_left[ticket]
        self._copy_events.pop(ticket, None)
        self._done.add(ticket)
        while self._completed + 1 in self._done:
            self._completed += 1
            self._done.discard(self._completed)
        self._cond.notify_all()
