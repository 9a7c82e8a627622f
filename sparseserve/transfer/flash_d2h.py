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

import torch

from .common import TransferStats, check_save_args
from .page_scatter import _HostViews, _scatter, _snap_cut
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
        self.ring_stall_s = 0.0                       # seconds the caller waited for it
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
    def save(self, layer: int, k_new, v_new, host_pages, offsets=None) -> int:
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
                t0 = time.perf_counter()
                while region is None:
                    self._cond.wait(0.5)
                    region = self._ring.try_alloc(nbytes)
                self.ring_stall_s += time.perf_counter() - t0
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
