"""Shared pieces of the transfer leaves: counters, bit views, argument checks, page runs, and
the ticket bookkeeping of savers whose work completes in CUDA stream order.

Nothing here imports triton.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = ["TransferStats", "bits_view", "check_page_tensors", "as_index_array",
           "count_page_runs", "page_runs", "EventTicketSaver"]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class TransferStats:
    """What a loader or saver moved.

    ``pages``: pages moved. A loaded page is one (page, K and V) pair; a saved "page" is one
    page region written by one save (a run of consecutive token offsets of one KV head in one
    host page: a decode step writing one token into a page counts one).
    ``rows``: token rows of one KV head (saves only; loads leave it 0).
    ``bytes``: K plus V bytes. ``calls``: load / save calls. ``busy_s``: CPU seconds the
    worker threads spent scattering (FlashD2H only).
    """
    calls: int = 0
    pages: int = 0
    rows: int = 0
    bytes: int = 0
    busy_s: float = 0.0

    def add(self, other: "TransferStats") -> "TransferStats":
        return TransferStats(self.calls + other.calls, self.pages + other.pages,
                             self.rows + other.rows, self.bytes + other.bytes,
                             self.busy_s + other.busy_s)


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """The same memory as an integer tensor of the same element size (bit-exact copies, no
    float semantics, numpy-compatible for bf16)."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def check_page_tensors(host_k, host_v, dev_k, dev_v) -> tuple[int, int]:
    """Validate the [pages, page_size, head_dim] tensors of one layer; -> (page_size, head_dim).

    Pages must be row-contiguous ([page_size, head_dim] dense); the page stride is free (a
    layer may be a slice of a bigger tensor)."""
    ref = host_k
    for name, t in (("host_k", host_k), ("host_v", host_v), ("dev_k", dev_k), ("dev_v", dev_v)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be [pages, page_size, head_dim], got {tuple(t.shape)}")
        if tuple(t.shape[1:]) != tuple(ref.shape[1:]) or t.dtype != ref.dtype:
            raise ValueError(f"{name} {tuple(t.shape)} {t.dtype} does not match host_k "
                             f"{tuple(ref.shape)} {ref.dtype}")
        if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            raise ValueError(f"{name}: each [page_size, head_dim] page must be contiguous")
    if host_k.shape[0] != host_v.shape[0] or dev_k.shape[0] != dev_v.shape[0]:
        raise ValueError("K and V of a tier must have the same number of pages")
    if host_k.device != host_v.device or dev_k.device != dev_v.device:
        raise ValueError("K and V of a tier must be on the same device")
    return int(ref.shape[1]), int(ref.shape[2])


def as_index_array(x, name: str, shape: tuple[int, int], allow_column: bool = False) -> np.ndarray:
    """A private, writable int64 numpy copy of host page ids / offsets of ``shape`` [T, H],
    given as numpy, list or tensor (a CUDA tensor is copied to the host: a sync). With
    ``allow_column`` a [T] or [T, 1] input stays a [T, 1] column (broadcast over heads)."""
    if torch.is_tensor(x):
        x = x.detach().to("cpu").numpy()
    a = np.asarray(x, dtype=np.int64)
    if a.ndim == 1:
        a = a[:, None]
    if allow_column and a.shape == (shape[0], 1):
        return np.array(a, dtype=np.int64, copy=True)
    try:
        return np.array(np.broadcast_to(a, shape), dtype=np.int64, copy=True)
    except ValueError:
        raise ValueError(f"{name} has shape {a.shape}, expected {shape}") from None


def _run_starts(pages: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """[T, H] bool: row (t, h) starts a page region (first live row of a run of consecutive
    offsets of one head in one page)."""
    start = pages >= 0
    if pages.shape[0] > 1:
        cont = (pages[1:] == pages[:-1]) & (offsets[1:] == offsets[:-1] + 1)
        start[1:] &= ~cont
    return start


def count_page_runs(pages: np.ndarray, offsets: np.ndarray, t0: int = 0, t1: int | None = None) -> int:
    """Page regions starting in tokens [t0, t1) (exact when summed over a partition of the
    tokens). pages [T, H], offsets [T, H] or [T, 1] (int64)."""
    t1 = pages.shape[0] if t1 is None else t1
    lo = max(t0 - 1, 0)
    start = _run_starts(pages[lo:t1], offsets[lo:t1])
    return int(start[t0 - lo:].sum())


def page_runs(pages: np.ndarray, offsets: np.ndarray):
    """Page regions as arrays (head, t0, length, page, offset0), head-major order.
    pages [T, H], offsets [T, H] or [T, 1] (int64); rows with page < 0 belong to no region."""
    T, H = pages.shape
    if T == 0 or H == 0:
        e = np.zeros(0, np.int64)
        return e, e, e, e, e
    offsets = np.broadcast_to(offsets, pages.shape)
    start = _run_starts(pages, offsets).T.reshape(-1)          # [H*T], head-major
    live = (pages >= 0).T.reshape(-1)
    idx = np.flatnonzero(start)
    # a region ends at the next start, the next dead row or the end of its head's column
    stops = np.flatnonzero(start | ~live)
    bounds = np.union1d(stops, np.arange(0, H * T + 1, T))
    ends = bounds[np.searchsorted(bounds, idx, side="right")]
    head, t0 = np.divmod(idx, T)
    return head, t0, ends - idx, pages[t0, head], offsets[t0, head]


class EventTicketSaver:
    """Tickets for savers whose copies are ordered on a CUDA stream (per-page copy, GPU-direct):
    a ticket completes when the event recorded after its copies does. On CPU tensors the work is
    synchronous and tickets complete at once. Thread-safe; tickets are 1, 2, 3, ..."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._issued = 0
        self._completed = 0
        self._pending: deque = deque()        # (ticket, event, keepalive)
        self._stats = TransferStats()
        self._closed = False

    def _hold_host_layers(self, host_k_layers, host_v_layers, validate: bool) -> None:
        """The host tier's per-layer K / V tensors, and whether saves check their ids."""
        if len(host_k_layers) != len(host_v_layers):
            raise ValueError("host_k_layers and host_v_layers differ in length")
        self.host_k = list(host_k_layers)
        self.host_v = list(host_v_layers)
        self.validate = validate

    def _ordered_side_stream(self, device: torch.device, enabled: bool):
        """On CUDA with `enabled`: this saver's side stream for `device`, made to wait for the
        compute stream's work so far (the new rows are written); None otherwise."""
        if device.type != "cuda" or not enabled:
            return None
        streams = self.__dict__.setdefault("_side_streams", {})
        side = streams.get(device)
        if side is None:
            side = streams[device] = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        return side

    def issue(self, device: torch.device, stats: TransferStats) -> int:
        """A ticket for saves written outside `save` (the captured two-tier prefill layers,
        worker/two_tier_graphs.py) by the compute stream's work so far on `device`: on CUDA
        an event on this saver's side stream after that work, ordered like its own saves
        (CPU: complete at once). -> ticket."""
        self._check_open()
        event = None
        side = self._ordered_side_stream(device, True)
        if side is not None:
            event = torch.cuda.Event()
            event.record(side)
        return self._issue(event, None, stats)

    # subclasses call this at the end of save()
    def _issue(self, event, keepalive, stats: TransferStats) -> int:
        with self._lock:
            self._issued += 1
            t = self._issued
            self._stats = self._stats.add(stats)
            if event is None and not self._pending:
                self._completed = t
            else:
                self._pending.append((t, event, keepalive))
            return t

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")

    def completed_seq(self) -> int:
        """Highest ticket t such that every ticket <= t has completed (never blocks)."""
        with self._lock:
            while self._pending and (self._pending[0][1] is None or self._pending[0][1].query()):
                self._completed = self._pending.popleft()[0]
            return self._completed

    def wait(self, ticket: int) -> None:
        """Block until ``ticket`` (and every earlier one) has completed. The copies are ordered
        on one stream, so the newest event at or before ``ticket`` covers the older ones: one
        host wait, not one per save (a step's 32 layer saves cost 32 waits of ~0.1 ms each on
        the H200 before)."""
        if ticket > self._issued:
            raise ValueError(f"ticket {ticket} was never issued (last: {self._issued})")
        with self._lock:
            covering = [(t, ev) for t, ev, _ in self._pending if t <= ticket and ev is not None]
        if covering:
            covering[-1][1].synchronize()
        with self._lock:
            while self._pending and self._pending[0][0] <= ticket:
                self._completed = self._pending.popleft()[0]

    def wait_all(self) -> None:
        if self._issued:
            self.wait(self._issued)

    def device_fence(self) -> None:
        """Make the current CUDA stream wait, on the device (the host does not block), until
        every save issued so far has completed. Saves complete in the order of one stream, so
        the newest pending event covers them all; on CPU they already have."""
        with self._lock:
            ev = self._pending[-1][1] if self._pending else None
        if ev is not None:
            ev.wait()

    def stats(self) -> TransferStats:
        with self._lock:
            return TransferStats(**vars(self._stats))

    def close(self) -> None:
        """Wait for outstanding saves; later saves raise. Idempotent."""
        if not self._closed:
            self.wait_all()
            self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class SaveArgs:
    """Validated arguments of one save: k/v [T, H, D] contiguous, pages [T, H] int64, offsets
    [T, H] or [T, 1] int64 (private copies)."""
    layer: int
    k: torch.Tensor
    v: torch.Tensor
    pages: np.ndarray
    offsets: np.ndarray
    extra: dict = field(default_factory=dict)


def check_save_args(host_k_layers, layer, k_new, v_new, host_pages, offsets,
                    validate: bool = True, contiguous: bool = True) -> SaveArgs:
    """Shared argument handling of every saver's ``save``. ``host_pages`` may be a
    ``SavePlan`` (offsets then None): its ids were validated once for the step.
    ``contiguous``: copy k/v to dense tensors (else only their last dim must be dense)."""
    from .save_plan import SavePlan, make_save_plan
    if not 0 <= layer < len(host_k_layers):
        raise IndexError(f"layer {layer} out of range (0..{len(host_k_layers) - 1})")
    hk = host_k_layers[layer]
    P, ps, D = hk.shape
    if k_new.dim() != 3 or k_new.shape != v_new.shape:
        raise ValueError(f"k_new/v_new must both be [T, Hkv, D], got {tuple(k_new.shape)} "
                         f"and {tuple(v_new.shape)}")
    T, H, Dn = k_new.shape
    if Dn != D or k_new.dtype != hk.dtype or v_new.dtype != hk.dtype:
        raise ValueError(f"k_new {tuple(k_new.shape)} {k_new.dtype} does not match host pages "
                         f"{tuple(hk.shape)} {hk.dtype}")
    if isinstance(host_pages, SavePlan):
        plan = host_pages
        if plan.shape != (T, H):
            raise ValueError(f"the save plan is for {plan.shape} rows, k_new has {(T, H)}")
    else:
        plan = make_save_plan(host_pages, offsets, P, ps, validate, shape=(T, H))
    if contiguous:
        k_new, v_new = k_new.contiguous(), v_new.contiguous()
    elif k_new.stride(2) != 1 or v_new.stride(2) != 1:
        k_new, v_new = k_new.contiguous(), v_new.contiguous()
    return SaveArgs(layer, k_new, v_new, plan.pages, plan.offsets, {"plan": plan})
