"""The naive baseline the papers compare against: one copy call per page.

* ``memcpy_load_pages``: one ``copy_`` per K page and per V page (a ``cudaMemcpyAsync`` each on
  a GPU). The page ids must be known on the host, so device index tensors are copied to the
  host first: **this syncs** (not capturable in a CUDA graph).
* ``PerPageCopySaver``: the step's new KV ``[T, Hkv, D]`` is first made head-major on the
  device (one kernel, so every page region is contiguous), then one copy per page region and
  per K / V goes to the host page, on the current stream (it does not overlap with compute).
"""
from __future__ import annotations

import torch

from .common import (EventTicketSaver, TransferStats, check_page_tensors, check_save_args,
                     page_runs)

__all__ = ["memcpy_load_pages", "PerPageCopySaver"]


def _host_list(x) -> list[int]:
    if torch.is_tensor(x):
        return x.tolist()           # a device tensor: device -> host copy, syncs
    return [int(v) for v in x]


def memcpy_load_pages(host_k, host_v, dev_k, dev_v, src_pages, dst_slots) -> int:
    """One copy call per page and per K / V; entries with src < 0 are skipped.
    src_pages / dst_slots: tensors (any device; a device tensor syncs) or sequences of ints.
    -> number of pages loaded."""
    check_page_tensors(host_k, host_v, dev_k, dev_v)
    src, dst = _host_list(src_pages), _host_list(dst_slots)
    if len(src) != len(dst):
        raise ValueError("src_pages and dst_slots must have the same length")
    n = 0
    for s, d in zip(src, dst):
        if s < 0:
            continue
        dev_k[d].copy_(host_k[s], non_blocking=True)
        dev_v[d].copy_(host_v[s], non_blocking=True)
        n += 1
    return n


class PerPageCopySaver(EventTicketSaver):
    """Saves with one device-to-host copy per page region (per token run and KV head).

    Same interface as ``FlashD2HSaver``: ``save(layer, k_new, v_new, host_pages, offsets)
    -> ticket``, ``wait``, ``wait_all``, ``completed_seq``, ``stats``, ``close``. Copies are
    queued on the current stream; a ticket completes when they have run (event query).
    """

    def __init__(self, host_k_layers, host_v_layers, validate: bool = True) -> None:
        super().__init__()
        self._hold_host_layers(host_k_layers, host_v_layers, validate)

    def save(self, layer: int, k_new, v_new, host_pages, offsets=None) -> int:
        """k_new/v_new [T, Hkv, D]; host_pages [T, Hkv] host page ids (< 0: not saved);
        offsets [T] (or [T, Hkv]) token offsets within the page. -> ticket."""
        self._check_open()
        a = check_save_args(self.host_k, layer, k_new, v_new, host_pages, offsets, self.validate)
        hk, hv = self.host_k[layer], self.host_v[layer]
        heads, t0s, lens, pages, offs0 = page_runs(a.pages, a.offsets)
        # head-major on the device: every page region becomes one contiguous [len, D] slab
        kh = a.k.transpose(0, 1).contiguous()
        vh = a.v.transpose(0, 1).contiguous()
        for h, t0, n, p, o in zip(heads.tolist(), t0s.tolist(), lens.tolist(),
                                  pages.tolist(), offs0.tolist()):
            hk[p, o:o + n].copy_(kh[h, t0:t0 + n], non_blocking=True)
            hv[p, o:o + n].copy_(vh[h, t0:t0 + n], non_blocking=True)
        rows = int(lens.sum())
        stats = TransferStats(1, len(heads), rows, 2 * rows * hk.shape[2] * hk.element_size())
        event = None
        if kh.is_cuda:
            event = torch.cuda.Event()
            event.record()
        return self._issue(event, (kh, vh) if event is not None else None, stats)
