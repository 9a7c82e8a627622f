"""Transfers between the host tier (pinned DRAM) and the device tier (HBM slots) of the KV cache.

Leaves: they take tensors, ids and ints, never engine objects. Layout per layer, K and V each:
host ``[num_pages, page_size, head_dim]``, device ``[num_slots, page_size, head_dim]`` (one page
= page_size tokens of one KV head). On CPU-only machines both tiers are CPU tensors and every
method runs (Triton kernels in the interpreter, or the torch paths).

Loading (H2D), ``load_pages(host_k, host_v, dev_k, dev_v, src_pages, dst_slots, method)``:
* ``"flash"`` (FlashH2D): one Triton kernel per call reads the pages from pinned host memory by
  UVA, one program per page and K / V. ``src_pages`` / ``dst_slots`` are device tensors; entries
  with src < 0 are skipped. No host sync, CUDA-graph capturable (after a first, compiling
  call). On CPU tiers ``backend="auto"`` uses torch indexing, ``"triton"`` the interpreter.
* ``"memcpy"``: one copy call per page and K / V (baseline). Needs the ids on the host:
  device id tensors are copied to the host, which syncs.

Saving (D2H), ``make_saver(method, host_k_layers, host_v_layers)`` -> saver with
``save(layer, k_new, v_new, host_pages, offsets) -> ticket``, ``wait(ticket)``, ``wait_all()``,
``completed_seq()``, ``stats()``, ``close()``:
* ``"flash"`` (FlashD2H): one D2H copy into a pinned staging ring on a side stream, CPU threads
  scatter into pages, overlapped with compute.
* ``"memcpy"``: one copy call per page region (baseline).
* ``"gpu-direct"``: a Triton kernel writes rows straight into pinned host pages.
* ``"copy-engine"``: a gather into host-address order, then one DMA copy per run of
  consecutive host rows on a side stream: no SMs held while PCIe drains (copy_engine.py).
A step's ids can be given once as a ``SavePlan`` (``make_save_plan``; save_plan.py) and passed
to every layer's ``save(layer, k, v, plan)``.

Counters: ``TransferStats`` (calls, pages, rows, bytes, busy_s) from ``PageLoader.stats()`` and
``saver.stats()``.
"""
from __future__ import annotations

import torch

from .. import kernels  # its backend rule (no Triton import)
from .common import TransferStats, bits_view
from .save_plan import SavePlan, make_save_plan
from .flash_d2h import FlashD2HSaver
from .per_page_copy import PerPageCopySaver, memcpy_load_pages

__all__ = ["H2D_METHODS", "D2H_METHODS", "TransferStats", "load_pages", "PageLoader",
           "make_saver", "FlashD2HSaver", "PerPageCopySaver", "GpuDirectSaver",
           "alloc_host_pages", "bits_view", "SavePlan", "make_save_plan"]

H2D_METHODS = ("flash", "memcpy")
D2H_METHODS = ("flash", "memcpy", "gpu-direct", "copy-engine")
_BACKENDS = (None, "auto", "triton", "torch")


def load_pages(host_k, host_v, dev_k, dev_v, src_pages, dst_slots, method: str = "flash", *,
               backend: str | None = None, counter: torch.Tensor | None = None,
               num_live: torch.Tensor | None = None) -> int | None:
    """Copy host pages ``src_pages[i]`` into device slots ``dst_slots[i]`` (K and V of one
    layer); entries with ``src_pages[i] < 0`` are skipped and their slots left untouched.

    host_k/host_v [P, page_size, D]; dev_k/dev_v [S, page_size, D] (same dtype, pages
    contiguous); src_pages/dst_slots [N] int32/int64 (on dev_k's device for "flash").
    ``counter``: optional int64 [2] tensor on dev_k's device, += [pages, bytes] ("flash" only;
    no sync). ``num_live``: optional [1] int tensor on dev_k's device: only entries
    ``< num_live[0]`` are considered (compacted lists). Returns the pages loaded for "memcpy" (host-side count), None for "flash".
    """
    if method == "flash":
        if backend not in _BACKENDS:
            raise ValueError(f"unknown backend {backend!r}")
        if kernels.resolve_backend(backend, dev_k) == "triton":  # Triton on CUDA tensors
            from .flash_h2d import flash_load_pages
            flash_load_pages(host_k, host_v, dev_k, dev_v, src_pages, dst_slots, counter,
                             num_live)
        else:
            from .flash_h2d import torch_load_pages
            torch_load_pages(host_k, host_v, dev_k, dev_v, src_pages, dst_slots, counter,
                             num_live)
        return None
    if method == "memcpy":
        if num_live is not None:  # this baseline syncs anyway
            n_live = int(num_live.reshape(-1)[0])
            src_pages, dst_slots = src_pages[:n_live], dst_slots[:n_live]
        n = memcpy_load_pages(host_k, host_v, dev_k, dev_v, src_pages, dst_slots)
        if counter is not None:
            counter[0] += n
            counter[1] += 2 * n * host_k[0].numel() * host_k.element_size()
        return n
    raise ValueError(f"unknown h2d method {method!r}; expected one of {H2D_METHODS}")


class PageLoader:
    """``load_pages`` with counters. ``load(...)`` has load_pages' arguments minus the method;
    ``stats()`` reads the device-side counter of the flash kernel (a sync: call it when
    metrics are collected, not inside the forward pass)."""

    def __init__(self, method: str = "flash", backend: str | None = None) -> None:
        if method not in H2D_METHODS:
            raise ValueError(f"unknown h2d method {method!r}; expected one of {H2D_METHODS}")
        self.method = method
        self.backend = backend
        self.calls = 0
        self._counters: dict[torch.device, torch.Tensor] = {}

    def counter(self, device: torch.device) -> torch.Tensor:
        """The [pages, bytes] int64 counter of loads into `device` (created on first use);
        read it together with other device counters to save syncs."""
        c = self._counters.get(device)
        if c is None:
            c = self._counters[device] = torch.zeros(2, dtype=torch.int64, device=device)
        return c

    def load(self, host_k, host_v, dev_k, dev_v, src_pages, dst_slots, num_live=None) -> None:
        """Capturable for method "flash" on CUDA once the counter exists (first call)."""
        self.calls += 1
        load_pages(host_k, host_v, dev_k, dev_v, src_pages, dst_slots, self.method,
                   backend=self.backend, counter=self.counter(dev_k.device), num_live=num_live)

    def stats(self) -> TransferStats:
        pages = nbytes = 0
        for c in self._counters.values():
            p, b = c.tolist()
            pages, nbytes = pages + p, nbytes + b
        return TransferStats(calls=self.calls, pages=pages, bytes=nbytes)

    def reset(self) -> None:
        self.calls = 0
        for c in self._counters.values():
            c.zero_()


def make_saver(method: str, host_k_layers, host_v_layers, **kwargs):
    """A saver for ``method`` in D2H_METHODS ("flash": FlashD2HSaver(num_threads=4,
    staging_bytes=256 MiB, ...); "memcpy": PerPageCopySaver; "gpu-direct": GpuDirectSaver;
    "copy-engine": CopyEngineSaver)."""
    if method == "flash":
        return FlashD2HSaver(host_k_layers, host_v_layers, **kwargs)
    if method == "memcpy":
        return PerPageCopySaver(host_k_layers, host_v_layers, **kwargs)
    if method == "gpu-direct":
        from .gpu_direct import GpuDirectSaver
        return GpuDirectSaver(host_k_layers, host_v_layers, **kwargs)
    if method == "copy-engine":
        from .copy_engine import CopyEngineSaver
        return CopyEngineSaver(host_k_layers, host_v_layers, **kwargs)
    raise ValueError(f"unknown d2h method {method!r}; expected one of {D2H_METHODS}")


def alloc_host_pages(num_pages: int, page_size: int, head_dim: int, dtype=torch.bfloat16,
                     pin: bool | None = None) -> torch.Tensor:
    """An uninitialised host tier tensor [num_pages, page_size, head_dim], pinned when CUDA is
    available (``pin=None``)."""
    pin = torch.cuda.is_available() if pin is None else pin
    return torch.empty(num_pages, page_size, head_dim, dtype=dtype, pin_memory=pin)


def __getattr__(name: str):
    if name == "GpuDirectSaver":            # imports triton: only on demand
        from .gpu_direct import GpuDirectSaver
        return GpuDirectSaver
    raise AttributeError(name)
