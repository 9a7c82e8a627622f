"""The buffers of one page size for benchmarks/transfer.py (host pages, device slots, a
step's new KV), the page layouts of loads and saves, the exactness checks, and the save
callables (GPU-direct kernel, a saver's save + wait, the CPU scatter rate)."""
from __future__ import annotations

import numpy as np
import torch

from sparseserve.config import HOST_CHUNK_PAGES
from sparseserve.transfer import bits_view, load_pages, memcpy_load_pages

DTYPE = torch.bfloat16
HKV = 8


class PageSizeRun:
    """Buffers for one page size at the largest page count; slices for smaller counts."""

    def __init__(self, args, dev, page_kb: float, max_pages: int, rng) -> None:
        self.dev, self.args, self.rng = dev, args, rng
        D = args.head_dim
        self.page_bytes = int(round(page_kb * 1024))
        self.ps = self.page_bytes // (D * 2)
        assert self.ps >= 1 and self.ps * D * 2 == self.page_bytes, "page size not a multiple of a row"
        self.page_kb, self.D, self.P = page_kb, D, max_pages
        pin = dev.type == "cuda"
        shape = (max_pages, self.ps, D)
        self.host_k = torch.empty(shape, dtype=DTYPE, pin_memory=pin)
        self.host_v = torch.empty(shape, dtype=DTYPE, pin_memory=pin)
        self.dev_k = torch.randn(shape, dtype=DTYPE, device=dev)
        self.dev_v = torch.randn(shape, dtype=DTYPE, device=dev)
        self.host_k.copy_(self.dev_k)
        self.host_v.copy_(self.dev_v)
        self.dev_k.zero_()
        self.dev_v.zero_()
        # the step's new KV for saves: [T, HKV, D] with T = max_pages / HKV * ps
        self.t_max = max(1, max_pages // HKV) * self.ps
        self.k_new = torch.randn(self.t_max, HKV, D, dtype=DTYPE, device=dev)
        self.v_new = torch.randn(self.t_max, HKV, D, dtype=DTYPE, device=dev)

    def load_ids(self, n):
        src = self.rng.permutation(self.P)[:n]
        dst = self.rng.permutation(self.P)[:n]
        return src, dst

    def save_layout(self, n, chunked: bool = False):
        """n pages = n // HKV token runs of ps tokens x HKV heads; -> (T, pages [T,H], offs [T]).
        Pages are random, or with `chunked` laid out as the engine allocates host pages:
        each head's blocks in chunks of HOST_CHUNK_PAGES consecutive page ids."""
        runs = max(1, n // HKV)
        T = runs * self.ps
        if chunked:
            C = HOST_CHUNK_PAGES
            while C > 1 and self.P // C < HKV * -(-runs // C):
                C //= 2  # tiny smoke buffers
            nc = -(-runs // C)
            ch = self.rng.permutation(self.P // C)[:HKV * nc].reshape(HKV, nc)
            j = np.arange(runs)
            perm = (ch[:, j // C] * C + j % C).T                      # [runs, HKV]
        else:
            perm = self.rng.permutation(self.P)[: runs * HKV].reshape(runs, HKV)
        pages = np.repeat(perm, self.ps, axis=0)                      # [T, HKV]
        offs = np.tile(np.arange(self.ps), runs)
        return T, pages.astype(np.int64), offs.astype(np.int64)


def check_load(r: PageSizeRun, method: str, n: int) -> bool:
    src, dst = r.load_ids(n)
    r.dev_k.zero_()
    r.dev_v.zero_()
    if method == "flash":
        load_pages(r.host_k, r.host_v, r.dev_k, r.dev_v, torch.tensor(src, device=r.dev),
                   torch.tensor(dst, device=r.dev), "flash")
    else:
        memcpy_load_pages(r.host_k, r.host_v, r.dev_k, r.dev_v, src.tolist(), dst.tolist())
    if r.dev.type == "cuda":
        torch.cuda.synchronize()
    s, d = torch.from_numpy(src), torch.from_numpy(dst)
    return all(torch.equal(bits_view(dt[d.to(r.dev)].cpu()), bits_view(ht[s]))
               for ht, dt in ((r.host_k, r.dev_k), (r.host_v, r.dev_v)))


def check_save(r: PageSizeRun, save_fn, n: int, chunked: bool = False) -> bool:
    T, pages, offs = r.save_layout(n, chunked)
    save_fn(T, pages, offs)
    if r.dev.type == "cuda":
        torch.cuda.synchronize()
    p, o = torch.from_numpy(pages), torch.from_numpy(np.broadcast_to(offs[:, None], pages.shape).copy())
    return all(torch.equal(bits_view(ht[p, o]), bits_view(new[:T].cpu()))
               for ht, new in ((r.host_k, r.k_new), (r.host_v, r.v_new)))


def gpu_direct_fn(r: PageSizeRun):
    """The GPU-direct kernel on device ids (Triton on CUDA, torch indexing on CPU)."""
    if r.dev.type == "cuda":
        from sparseserve.transfer.gpu_direct import gpu_direct_save as kernel
    else:
        from sparseserve.transfer.gpu_direct import _torch_save as kernel

    def prep(T, pages, offs):
        p = torch.from_numpy(pages).to(r.dev)
        o = torch.from_numpy(offs).to(r.dev)[:, None].expand(T, HKV)
        return lambda: kernel(r.host_k, r.host_v, r.k_new[:T], r.v_new[:T], p, o)

    return prep


def scatter_extra(sv):
    """-> a callable giving the CPU scatter rate of the saves made since this call."""
    before = sv.stats()

    def stats():
        st = sv.stats()
        busy = st.busy_s - before.busy_s
        moved = st.bytes - before.bytes
        return {"scatter_busy_s": busy,
                "scatter_gbps_per_thread": moved / busy / 1e9 if busy else None,
                "ring_stalls": sv.ring_stalls}
    return stats


def saver_call(sv, r: PageSizeRun, T, pages, offs):
    """One save of T tokens through a saver API, waited for."""
    return lambda: sv.wait(sv.save(0, r.k_new[:T], r.v_new[:T], pages, offs))
