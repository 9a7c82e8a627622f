"""FlashH2D: one Triton kernel gathers many KV pages straight from pinned host memory (UVA).

Grid ``(min(N, max_programs), 2)``: program ``(i, 0)`` copies the K pages of entries ``i, i +
G, i + 2G, ...`` (G = the grid's width) from the host tier into their slots of the device tier,
program ``(i, 1)`` the V pages. Each page is ``page_size * head_dim`` contiguous elements,
streamed in vectorised blocks (an integer view of the data, so copies are bit-exact for any
dtype). Entries with ``src_pages[i] < 0`` are skipped (masked); with ``num_live`` (a device
count of a compacted list) the loop stops there. Fixed grid, no host synchronisation:
capturable in a CUDA graph once compiled (call it once before capture).

Why the cap: a decode step's list has an entry per selected page (B x Hkv x pages per row,
32k at batch 16 on Llama-3-8B) while a few percent of them miss, and the list is compacted on
the device, so its live length is unknown when the graph is launched. One program per entry
spent ~8 us per layer launching 4,096 programs that found nothing to do (H200, LWM-7B decode
at batch 1, ``docs/results/system.md``), growing with the batch. 512 entries in flight (1,024
programs of 8-16 KB page copies each) keep several MB in flight, far more than PCIe's
bandwidth-delay product.

On a GPU the host tensors are passed to the kernel as they are: the pointer of page-locked
memory (``pin_memory=True``) is valid on the device under unified virtual addressing, so the
loads cross PCIe directly. On CPU tensors the same kernel runs in Triton's interpreter (tests);
``torch_load_pages`` is the vectorised torch path with the same contract (CPU engine path).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels import patch_triton_interpreter
from .common import bits_view, check_page_tensors

patch_triton_interpreter()

__all__ = ["flash_load_pages", "torch_load_pages"]

DEFAULT_BLOCK_BYTES = 16384
DEFAULT_MAX_PROGRAMS = 512  # entries in flight (module doc: why a cap)


@triton.jit
def _copy_page(src, dst, live, PAGE_ELEMS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    for start in range(0, PAGE_ELEMS, BLOCK):
        o = start + offs
        m = (o < PAGE_ELEMS) & live          # block mask; uniform per program when live is
        x = tl.load(src + o, mask=m)
        tl.store(dst + o, x, mask=m)


# sizes that change from step to step are not specialised on (== 1, % 16): a new size
# class would compile a variant mid-serving, which the start-up warm-up cannot foresee
@triton.jit(do_not_specialize=["N", "NUM_SRC", "NUM_DST"])
def _flash_h2d_kernel(
    hk_ptr, hv_ptr, dk_ptr, dv_ptr, src_ptr, dst_ptr, cnt_ptr, live_ptr, N, NUM_SRC, NUM_DST,
    stride_hk, stride_hv, stride_dk, stride_dv,
    PAGE_ELEMS: tl.constexpr, BLOCK: tl.constexpr,
    PAGE_BYTES: tl.constexpr, HAS_COUNTER: tl.constexpr, HAS_NUM_LIVE: tl.constexpr,
):
    kv = tl.program_id(1)
    n = N
    if HAS_NUM_LIVE:  # compacted lists: only the first num_live entries can be live
        n = tl.minimum(tl.load(live_ptr).to(tl.int32), N)
    for i in range(tl.program_id(0), n, tl.num_programs(0)):
        src = tl.load(src_ptr + i).to(tl.int64)
        dst = tl.load(dst_ptr + i).to(tl.int64)
        live = src >= 0
        tl.device_assert(~live | ((src < NUM_SRC) & (dst >= 0) & (dst < NUM_DST)),
                         "flash_h2d: page or slot out of range")
        # masked (not branched) so a skipped entry costs one predicated-off pass, nothing else
        src = tl.maximum(src, 0)
        dst = tl.maximum(dst, 0)
        if kv == 0:
            _copy_page(hk_ptr + src * stride_hk, dk_ptr + dst * stride_dk, live,
                       PAGE_ELEMS, BLOCK)
            if HAS_COUNTER:
                # [pages, bytes]; K and V of a page count as one page
                tl.atomic_add(cnt_ptr, live.to(tl.int64))
                tl.atomic_add(cnt_ptr + 1, live.to(tl.int64) * (2 * PAGE_BYTES))
        else:
            _copy_page(hv_ptr + src * stride_hv, dv_ptr + dst * stride_dv, live,
                       PAGE_ELEMS, BLOCK)


def flash_load_pages(host_k, host_v, dev_k, dev_v, src_pages, dst_slots, counter=None,
                     num_live=None, *, block_bytes: int = DEFAULT_BLOCK_BYTES,
                     num_warps: int | None = None,
                     max_programs: int = DEFAULT_MAX_PROGRAMS) -> None:
    """Load host pages into device slots with one Triton kernel (see module doc).

    Args:
        host_k, host_v: [P, page_size, D]  host tier of one layer (pinned CPU memory on a GPU)
        dev_k, dev_v:   [S, page_size, D]  device tier (slots) of the same layer
        src_pages:      [N] int32/int64    host page ids on dev_k's device; < 0 = skip
        dst_slots:      [N] int32/int64    device slots, same device; unique among live entries
        counter:        [2] int64 or None  on dev_k's device: += [pages loaded, bytes loaded]
        num_live:       [1] int or None    on dev_k's device: only entries < num_live[0] are
                                           considered (compacted lists whose length is known
                                           on the device only); programs past it return
        block_bytes:    bytes a program moves per loop iteration (tuning knob)
        num_warps:      warps per program (default: 4 up to 8 KB blocks, else 8)
        max_programs:   entries in flight (the grid's width; each program loops over every
                        max_programs-th entry)
    Ids are not range-checked (no host sync): the caller guarantees 0 <= src < P, dst < S
    (debug builds, TRITON_DEBUG=1, assert it on the device).
    Runs on the current stream.
    """
    page_size, head_dim = check_page_tensors(host_k, host_v, dev_k, dev_v)
    (N,) = src_pages.shape
    if dst_slots.shape != (N,):
        raise ValueError(f"dst_slots {tuple(dst_slots.shape)} does not match src_pages ({N},)")
    if N == 0:
        return
    dev = dev_k.device
    src_pages = src_pages.to(dev, non_blocking=True).contiguous()
    dst_slots = dst_slots.to(dev, non_blocking=True).contiguous()
    hk, hv, dk, dv = (bits_view(t) for t in (host_k, host_v, dev_k, dev_v))
    esz = host_k.element_size()
    page_elems = page_size * head_dim
    block = min(triton.next_power_of_2(page_elems), max(16, triton.next_power_of_2(block_bytes // esz)))
    if num_warps is None:
        num_warps = 4 if block * esz <= 8192 else 8
    has_counter = counter is not None
    if has_counter:
        assert counter.dtype == torch.int64 and counter.numel() >= 2 and counter.device == dev
    cnt = counter if has_counter else src_pages
    has_live = num_live is not None
    if max_programs < 1:
        raise ValueError(f"max_programs must be >= 1, got {max_programs}")
    launch = _flash_h2d_kernel[(min(N, max_programs), 2)]
    args = (hk, hv, dk, dv, src_pages, dst_slots, cnt, num_live if has_live else src_pages, N,
            hk.shape[0], dk.shape[0],
            hk.stride(0), hv.stride(0), dk.stride(0), dv.stride(0))
    kw = dict(PAGE_ELEMS=page_elems, BLOCK=block, PAGE_BYTES=page_elems * esz,
              HAS_COUNTER=has_counter, HAS_NUM_LIVE=has_live, num_warps=num_warps)
    if dev.type == "cuda" and dev.index is not None and dev.index != torch.cuda.current_device():
        with torch.cuda.device(dev):
            launch(*args, **kw)
    else:
        launch(*args, **kw)


def torch_load_pages(host_k, host_v, dev_k, dev_v, src_pages, dst_slots, counter=None,
                     num_live=None) -> None:
    """Same contract as ``flash_load_pages`` with torch indexing (compacts the live entries:
    on CUDA this syncs, so it is meant for CPU tiers). Ids are range-checked by torch."""
    check_page_tensors(host_k, host_v, dev_k, dev_v)
    if dst_slots.shape != src_pages.shape or src_pages.dim() != 1:
        raise ValueError("src_pages and dst_slots must be 1-D of the same length")
    live = src_pages >= 0
    if num_live is not None:
        live &= torch.arange(live.shape[0], device=live.device) < num_live.to(live.device)
    src = src_pages[live].to(host_k.device, torch.int64)
    dst = dst_slots[live].to(dev_k.device, torch.int64)
    for h, d in ((host_k, dev_k), (host_v, dev_v)):
        d.index_copy_(0, dst, h.index_select(0, src).to(d.device))
    if counter is not None:
        n = int(src.numel())
        counter[0] += n
        counter[1] += 2 * n * host_k[0].numel() * host_k.element_size()
