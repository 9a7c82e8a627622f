"""Copy-engine saving: the step's new K/V rows go to DRAM by DMA, not by SMs.

GPU-direct saves (gpu_direct.py) are a kernel whose programs hold SMs while their writes
drain over PCIe: beside a GEMM they took as long as the two back to back (benchmarks/
save_overlap.py, H200: 10.1 ms GEMM + 10.5 ms save -> 20.5 ms together), and in a 2048-token
LWM-7B prefill step they were 20 of its 75 ms of kernel time (docs/results/serving.md,
fourteenth session). The copy engines move bytes without SMs, so here a layer's save is

1. one gather per K and V on a side stream (ordered after the compute stream's work so far)
   into a staging buffer laid out in host-address order (`save_plan.dest_runs`; ~20 us for
   a 32 MB layer at HBM speed), then
2. one DMA copy per block of runs of consecutive host rows (``save_plan.dest_blocks``). Host
   pages are handed out in chunks of consecutive ids per (request, KV head) and a request's
   heads take adjacent chunks, so a prefill chunk's layer is a few runs of megabytes plus,
   where the step starts or ends inside a chunk, one equally long run per head, equally
   spaced: one strided copy (``memcpy2d``; they were ~33 copies per K and V per layer on
   LWM-7B, whose host-side calls ate what the SMs saved — serving.md, fourteenth session).

A step whose rows scatter into more than ``max_runs`` blocks (a fragmented host pool) is saved
GPU-direct instead: that many small copies would cost more host time than they save.
On CPU tensors the same code runs synchronously (tests). Same interface and tickets as the
other savers.
"""
from __future__ import annotations

import contextlib

import torch

from .common import EventTicketSaver, TransferStats, check_save_args
from .memcpy2d import copy_rows_2d, cuda_2d_available
from .save_plan import dest_blocks

__all__ = ["CopyEngineSaver"]

# blocks one layer's save may take as copies (K and V each); more go GPU-direct. A copy call
# costs ~5 us of host time; 64 of them per K and V is ~0.6 ms per layer, about what the
# gather-free GPU-direct launch saves in kernel time on a 2048-token MHA layer.
MAX_RUNS = 64


class CopyEngineSaver(EventTicketSaver):
    """Saves through the copy engine (see module doc). ``side_stream``: on CUDA, gather and
    copy on a side stream ordered after the compute stream (the default)."""

    def __init__(self, host_k_layers, host_v_layers, validate: bool = True,
                 side_stream: bool = True, max_runs: int = MAX_RUNS) -> None:
        super().__init__()
        self._hold_host_layers(host_k_layers, host_v_layers, validate)
        self.side_stream = side_stream
        self.max_runs = max_runs
        self.fallback_saves = 0  # layers saved GPU-direct because their runs were too many

    def save(self, layer: int, k_new, v_new, host_pages, offsets=None) -> int:
        """k_new/v_new [T, Hkv, D] (last dim dense); host_pages [T, Hkv] (< 0: not saved) and
        offsets [T] or [T, Hkv], or a SavePlan and no offsets. -> ticket."""
        self._check_open()
        a = check_save_args(self.host_k, layer, k_new, v_new, host_pages, offsets,
                            self.validate, contiguous=False)
        plan = a.extra["plan"]
        hk, hv = self.host_k[layer], self.host_v[layer]
        ps = hk.shape[1]
        dev = a.k.device
        # without the CUDA runtime to call: one copy per run (blocks of height 1)
        t_rows, h_rows, blocks = dest_blocks(plan, ps,
                                             dev.type != "cuda" or cuda_2d_available())
        # blocks address host rows as page * page_size + offset: a dense layer's rows only
        direct = len(blocks) > self.max_runs or not (_rows_dense(hk) and _rows_dense(hv))
        self.fallback_saves += int(direct)
        side = self._ordered_side_stream(dev, self.side_stream)
        staged = []
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            if direct:
                _save_direct(hk, hv, a.k, a.v, plan, dev, capped=side is not None)
            else:
                _save_copies(hk, hv, a.k, a.v, _row_index(plan, a.k, a.v, t_rows, h_rows, dev),
                             blocks, staged)
            event = None
            if dev.type == "cuda":
                event = torch.cuda.Event()
                event.record()
        if side is not None:
            for t in (a.k, a.v):  # made on the compute stream, read on the side one
                t.record_stream(side)
        stats = TransferStats(1, plan.regions, plan.rows,
                              2 * plan.rows * hk.shape[2] * hk.element_size())
        return self._issue(event, tuple(staged) if event is not None else None, stats)


def _row_index(plan, k, v, t_rows, h_rows, device):
    """How _save_copies gathers the staging rows new[t_rows[i], h_rows[i]] of k/v [T, Hkv, D]:
    ("flat", idx [R]) when both are views whose rows lie D apart in their storage (a
    [T, Hkv, D] tensor or column slices of the qkv output): row i is row idx[i] of a [N, D]
    view, one index_select — a 1-D row gather, where two-tensor advanced indexing computed
    an offset per element (3-7 ms per 64k token-layer step on the H200, fifteenth session);
    else ("pairs", t, h). Device copies made once per plan (every layer has these strides)."""
    D = k.shape[2]
    st, sh = k.stride(0), k.stride(1)
    flat = (k.stride(2) == 1 and st % D == 0 and sh % D == 0 and v.stride() == k.stride())
    if flat:
        return ("flat",) + plan.on_device(("rows_flat", st // D, sh // D),
                                          lambda: (t_rows * (st // D) + h_rows * (sh // D),),
                                          device)
    return ("pairs",) + plan.on_device("rows", (t_rows, h_rows), device)


def _gather_rows(new: torch.Tensor, index: tuple) -> torch.Tensor:
    """new [T, Hkv, D] -> [R, D] staging rows (see _row_index)."""
    if index[0] == "pairs":
        return new[index[1], index[2]]
    T, H, D = new.shape
    n = (T - 1) * (new.stride(0) // D) + (H - 1) * (new.stride(1) // D) + 1
    return new.as_strided((n, D), (D, 1)).index_select(0, index[1])


def _save_copies(hk, hv, k, v, index: tuple, blocks, staged: list) -> None:
    """Gather each of k/v [T, Hkv, D] into host-address order (staging [rows, D], kept alive
    in `staged` until the ticket completes), one copy per block of runs (dest_blocks:
    first host row, pitch, first staging row, run length, runs)."""
    for new, host in ((k, hk), (v, hv)):
        rows = host.view(-1, host.shape[2])      # [pages * page_size, D]: one row per token
        stage = _gather_rows(new, index)
        staged.append(stage)
        for dst, pitch, src, n, height in blocks.tolist():
            if height == 1:
                rows[dst:dst + n].copy_(stage[src:src + n], non_blocking=True)
            else:
                copy_rows_2d(rows, dst, pitch, stage, src, n, height)


def _rows_dense(host: torch.Tensor) -> bool:
    """host [P, page_size, D]: pages back to back, so a token's row is page * page_size +
    offset of a [P * page_size, D] view."""
    return host.stride(2) == 1 and host.stride(1) == host.shape[2] and \
        host.stride(0) == host.shape[1] * host.shape[2]


def _save_direct(hk, hv, k, v, plan, device, capped: bool) -> None:
    """A fragmented layer GPU-direct (a Triton kernel by UVA; torch indexing on CPU)."""
    from .gpu_direct import SIDE_STREAM_MAX_PROGRAMS, save_rows
    pages, offs = plan.device_ids(device)
    save_rows(hk, hv, k, v, pages, offs,
              max_programs=SIDE_STREAM_MAX_PROGRAMS if capped else None)
