"""GPU-direct saving: a Triton kernel writes the step's new KV rows straight into pinned host
pages by UVA (the host tensor is passed to the kernel; its pointer is valid on the GPU). Grid
``(cdiv(T, BLOCK_T), Hkv)``: a program moves BLOCK_T token rows of one KV head, K and V, each
row to ``host[page, offset]``. ``gpu_direct_save`` runs on the current stream (it occupies SMs
and PCIe while compute waits on the stream: the cost the papers measure for a synchronous
save). ``GpuDirectSaver(side_stream=True)`` (the default on CUDA) launches it on a side stream
that first waits for the compute stream's event, so the save runs beside the next layers'
compute and no CPU thread touches the bytes (FlashD2H's scatter threads do: 10-14 GB/s with 8
threads on the H200 host, against 46-51 GB/s here, docs/results/transfer.md). Beside is not
free: the saving programs hold SMs while their writes drain over PCIe, and a GEMM running at the
same time took about as long as the two back to back at every grid cap measured
(benchmarks/save_overlap.py, H200); the cap below still brought the engine's hybrid step from
~1.1x to 1.01x dense's. On CPU tensors the kernel
runs in Triton's interpreter (``backend="triton"``) or as torch indexing (``"torch"``, the
default for CPU tensors).
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ..kernels import patch_triton_interpreter
from .common import EventTicketSaver, TransferStats, bits_view, check_save_args

patch_triton_interpreter()

__all__ = ["gpu_direct_save", "save_rows", "GpuDirectSaver"]

# programs a side-stream save launches (None: one per 16-token block and head). Uncapped, a
# long layer's ~65k programs fill every SM until they drain over PCIe; 64 measured best of
# none/64/256 in a hybrid LWM-7B step (benchmarks/profile_hybrid.py, docs/results/system.md,
# eleventh session)
SIDE_STREAM_MAX_PROGRAMS: int | None = 64


# sizes that change from step to step are not specialised on (== 1, % 16): a new size
# class would compile a variant mid-serving, which the start-up warm-up cannot foresee
@triton.jit(do_not_specialize=["T"])
def _gpu_direct_kernel(
    k_ptr, v_ptr, hk_ptr, hv_ptr, pages_ptr, offs_ptr, T, P,
    s_kt, s_kh, s_vt, s_vh, s_hkp, s_hkt, s_hvp, s_hvt, s_pt, s_ph, s_ot, s_oh,
    D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # program (i, h) moves token blocks i, i + G, i + 2G, ... of KV head h (G = grid width):
    # one block per program when the grid covers T, a loop when the grid is capped
    h = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    for blk in range(tl.program_id(0), tl.cdiv(T, BLOCK_T), tl.num_programs(0)):
        t = (blk * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # T < 2**31: no overflow
        t_ok = t < T
        page = tl.load(pages_ptr + t * s_pt + h * s_ph, mask=t_ok, other=-1).to(tl.int64)
        off = tl.load(offs_ptr + t * s_ot + h * s_oh, mask=t_ok, other=0).to(tl.int64)
        live = t_ok & (page >= 0)
        tl.device_assert(~live | (page < P), "gpu_direct: page out of range")
        page = tl.maximum(page, 0)
        m = live[:, None] & (d < D)[None, :]
        k = tl.load(k_ptr + t[:, None] * s_kt + h * s_kh + d[None, :], mask=m)
        tl.store(hk_ptr + page[:, None] * s_hkp + off[:, None] * s_hkt + d[None, :], k, mask=m)
        v = tl.load(v_ptr + t[:, None] * s_vt + h * s_vh + d[None, :], mask=m)
        tl.store(hv_ptr + page[:, None] * s_hvp + off[:, None] * s_hvt + d[None, :], v, mask=m)


def gpu_direct_save(host_k, host_v, k_new, v_new, pages, offsets, *, block_t: int = 16,
                    num_warps: int = 4, max_programs: int | None = None) -> None:
    """host[pages[t, h], offsets[t, h]] = new[t, h] for K and V, rows with page < 0 skipped.

    host_k/host_v [P, page_size, D] (pinned on a GPU), k_new/v_new [T, Hkv, D] (last dim
    contiguous), pages/offsets [T, Hkv] int32/int64 tensors on k_new's device (broadcast views
    are fine). No range checks, no host sync; current stream.
    max_programs: cap on the programs launched (about; at least one per KV head), each then
    looping over token blocks. None: one program per (token block, head). A save of a long
    prompt's layer is ~65k programs, which fill every SM until they drain over PCIe; a capped
    grid leaves the other SMs to the compute that the side-stream save overlaps
    (benchmarks/save_overlap.py measures both)."""
    T, H, D = k_new.shape
    if T == 0:
        return
    hk, hv, k, v = (bits_view(x) for x in (host_k, host_v, k_new, v_new))
    assert k.stride(2) == 1 and v.stride(2) == 1 and hk.stride(2) == 1 and hv.stride(2) == 1
    blocks = triton.cdiv(T, block_t)
    if max_programs is not None:
        blocks = min(blocks, max(1, max_programs // H))
    grid = (blocks, H)
    args = (k, v, hk, hv, pages, offsets, T, hk.shape[0],
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            hk.stride(0), hk.stride(1), hv.stride(0), hv.stride(1),
            pages.stride(0), pages.stride(1), offsets.stride(0), offsets.stride(1))
    kw = dict(D=D, BLOCK_T=block_t, BLOCK_D=max(16, triton.next_power_of_2(D)),
              num_warps=num_warps)
    dev = k_new.device
    if dev.type == "cuda" and dev.index is not None and dev.index != torch.cuda.current_device():
        with torch.cuda.device(dev):
            _gpu_direct_kernel[grid](*args, **kw)
    else:
        _gpu_direct_kernel[grid](*args, **kw)


def save_rows(host_k, host_v, k_new, v_new, pages, offsets, *,
              max_programs: int | None = None) -> None:
    """``gpu_direct_save``'s contract on any device: the Triton kernel on CUDA tensors, torch
    indexing (``_torch_save``) otherwise."""
    if k_new.is_cuda:
        gpu_direct_save(host_k, host_v, k_new, v_new, pages, offsets, max_programs=max_programs)
    else:
        _torch_save(host_k, host_v, k_new, v_new, pages, offsets)


def _torch_save(host_k, host_v, k_new, v_new, pages, offsets) -> None:
    """Torch indexing with the same contract (CPU engine path; syncs on CUDA)."""
    pages, offsets = pages.to(host_k.device), offsets.to(host_k.device).expand(pages.shape)
    live = pages >= 0
    p, o = pages[live], offsets[live]
    host_k[p, o] = k_new.to(host_k.device)[live]
    host_v[p, o] = v_new.to(host_v.device)[live]


class GpuDirectSaver(EventTicketSaver):
    """Saves with one GPU-direct kernel per save (see module doc); same interface as
    ``FlashD2HSaver``. ``backend``: None/"auto" (Triton on CUDA, torch on CPU), "triton",
    "torch". The page ids / offsets travel to the device with the save (a small copy)."""

    def __init__(self, host_k_layers, host_v_layers, backend: str | None = None,
                 validate: bool = True, side_stream: bool = True) -> None:
        """side_stream: on CUDA, write from a side stream ordered after the compute stream's
        work so far (the save overlaps compute; its ticket's event is recorded there)."""
        super().__init__()
        self.side_stream = side_stream
        if backend not in (None, "auto", "triton", "torch"):
            raise ValueError(f"unknown backend {backend!r}")
        self._hold_host_layers(host_k_layers, host_v_layers, validate)
        self.backend = backend

    def save(self, layer: int, k_new, v_new, host_pages, offsets=None) -> int:
        """k_new/v_new [T, Hkv, D] (last dim dense; any other strides); host_pages [T, Hkv]
        (< 0: not saved) and offsets [T] or [T, Hkv], or a SavePlan (save_plan.py) and no
        offsets. -> ticket."""
        self._check_open()
        a = check_save_args(self.host_k, layer, k_new, v_new, host_pages, offsets,
                            self.validate, contiguous=False)
        plan = a.extra["plan"]
        hk, hv = self.host_k[layer], self.host_v[layer]
        dev = a.k.device
        side = self._ordered_side_stream(dev, self.side_stream)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            pages, offs = plan.device_ids(dev)  # copied once per step, on the first layer
            backend = self.backend or "auto"
            if backend == "auto":  # Triton on CUDA tensors, torch otherwise (kernels/: the
                # launch counters force its GPU choice on CPU tensors there)
                from .. import kernels
                backend = kernels.resolve_backend(None, a.k)
            if backend == "triton":
                cap = SIDE_STREAM_MAX_PROGRAMS if side is not None else None
                gpu_direct_save(hk, hv, a.k, a.v, pages, offs, max_programs=cap)
            else:
                _torch_save(hk, hv, a.k, a.v, pages, offs)
            event = None
            if dev.type == "cuda":
                event = torch.cuda.Event()
                event.record()  # on the side stream when there is one
        if side is not None:
            # made on the compute stream, read on the side one: not reused before it is done
            a.k.record_stream(side)
            a.v.record_stream(side)
        stats = TransferStats(1, plan.regions, plan.rows,
                              2 * plan.rows * hk.shape[2] * hk.element_size())
        return self._issue(event, (a.k, a.v, pages, offs) if event is not None else None, stats)

