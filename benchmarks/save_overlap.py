"""Does a side-stream GPU-direct save slow down the prefill compute it is meant to overlap?

The full system saves each prefilled layer's K/V to DRAM with `gpu_direct_save` on a side
stream. One layer of a 32k-token LWM-7B prompt is 512 MiB of K + V and, with one program per
(16-token block, KV head), ~65k programs: they can occupy every SM until their writes drain
over PCIe (~10 ms at 50 GB/s), so the compute they "overlap" may wait for them instead. This
measures, for grids capped at several `max_programs` (None = one program per block):

  * the save alone: ms and GB/s (pinned host pages, UVA writes);
  * a prefill-like bf16 GEMM loop alone (2048 x 4096 @ 4096 x 11008, repeated);
  * both at once, the save launched first on a side stream: the GEMM loop's ms (slowdown vs
    alone) and the time until both are done (vs the sum and vs the max of the two alone).

  python benchmarks/save_overlap.py --out $OUT/save_overlap.json     # H200: ~1 minute
  python benchmarks/save_overlap.py --out /tmp/s.json --smoke        # CPU: plumbing only

Prints a table last and writes JSON (meta: command, hardware, versions).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as C  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402


def make_save(tokens: int, heads: int, dim: int, page: int, device: str, seed: int):
    """-> (host_k, host_v, k_new, v_new, pages, offsets): one layer's new KV [T, H, D] bf16 and
    its scattered host pages (each (head, 32-token run) on a random page)."""
    gen = torch.Generator().manual_seed(seed)
    pin = device == "cuda"
    n_pages = -(-tokens // page) * heads
    host_k = torch.empty((n_pages, page, dim), dtype=torch.bfloat16, pin_memory=pin)
    host_v = torch.empty_like(host_k, pin_memory=pin)
    k_new = torch.randn((tokens, heads, dim), generator=gen).to(torch.bfloat16).to(device)
    v_new = torch.randn((tokens, heads, dim), generator=gen).to(torch.bfloat16).to(device)
    perm = np.random.default_rng(seed).permutation(n_pages).reshape(heads, -1)  # [H, pages/H]
    t = np.arange(tokens)
    pages = torch.from_numpy(perm[:, t // page].T.copy()).to(device)            # [T, H]
    offsets = torch.from_numpy((t % page)[:, None]).to(device).expand(-1, heads)
    return host_k, host_v, k_new, v_new, pages, offsets


class Timer:
    """Device time of the work queued inside `with` on the current stream (CUDA events), or
    wall time on CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.ms = cuda, None

    def __enter__(self):
        if self.cuda:
            self.a = torch.cuda.Event(enable_timing=True)
            self.b = torch.cuda.Event(enable_timing=True)
            self.a.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.b.record()
        else:
            self.ms = 1e3 * (time.perf_counter() - self.t0)

    def result(self) -> float:
        if self.cuda:
            self.b.synchronize()
            self.ms = self.a.elapsed_time(self.b)
        return self.ms


def measure(cap, save, gemm, cuda: bool, reps: int) -> dict:
    """Medians over reps of: save alone, GEMM loop alone, both (save first on a side stream)."""
    from sparseserve.transfer.gpu_direct import gpu_direct_save

    def do_save():
        gpu_direct_save(*save, max_programs=cap)

    side = torch.cuda.Stream() if cuda else None
    alone_save, alone_gemm, both_gemm, both_total = [], [], [], []
    for _ in range(reps + 1):  # the first round warms up (compilation, allocator)
        C.synchronize()
        with Timer(cuda) as ts:
            do_save()
        s = ts.result()
        C.synchronize()
        with Timer(cuda) as tg:
            gemm()
        g = tg.result()
        C.synchronize()
        start = torch.cuda.Event(enable_timing=True) if cuda else None
        t0 = time.perf_counter()
        if cuda:
            start.record()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                do_save()
                side_done = torch.cuda.Event(enable_timing=True)
                side_done.record()
        else:
            do_save()
        with Timer(cuda) as tb:
            gemm()
        bg = tb.result()
        if cuda:
            side_done.synchronize()
            total = max(start.elapsed_time(tb.b), start.elapsed_time(side_done))
        else:
            total = 1e3 * (time.perf_counter() - t0)
        alone_save.append(s)
        alone_gemm.append(g)
        both_gemm.append(bg)
        both_total.append(total)
    med = lambda xs: float(np.median(xs[1:]))  # noqa: E731
    nbytes = 2 * save[2].numel() * save[2].element_size()
    s, g, bg, tot = med(alone_save), med(alone_gemm), med(both_gemm), med(both_total)
    return {"max_programs": cap, "save_ms": s, "save_gb_s": nbytes / s / 1e6, "gemm_ms": g,
            "gemm_ms_with_save": bg, "gemm_slowdown": bg / g, "both_ms": tot,
            "both_vs_sum": tot / (s + g), "both_vs_max": tot / max(s, g)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=32768, help="prompt tokens of the saved layer")
    p.add_argument("--heads", type=int, default=32, help="KV heads (LWM-7B: 32)")
    p.add_argument("--caps", default="none,16,32,64,128,256,512",
                   help="max_programs values ('none': one program per block)")
    p.add_argument("--gemm-reps", type=int, default=40,
                   help="GEMMs per loop (~0.3 ms each on an H200: the loop about as long as the save)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (plumbing)")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.smoke
    device = "cuda" if cuda else "cpu"
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        a.tokens, a.heads, a.gemm_reps, a.reps = 97, 3, 2, 1
    m, k, n = (2048, 4096, 11008) if cuda else (64, 64, 64)
    x = torch.randn((m, k), device=device, dtype=torch.bfloat16)
    w = torch.randn((k, n), device=device, dtype=torch.bfloat16)

    def gemm():
        for _ in range(a.gemm_reps):
            torch.mm(x, w)

    save = make_save(a.tokens, a.heads, 128, 32, device, 0)
    caps = [None if c.strip().lower() == "none" else int(c) for c in a.caps.split(",")]
    rows = [measure(c, save, gemm, cuda, a.reps) for c in caps]
    result = {"meta": C.meta(argv), "settings": {**vars(a), "device": device,
                                                  "gemm": [m, k, n]}, "rows": rows}
    C.write_json(a.out, result)
    print(C.table(["max_programs", "save ms", "save GB/s", "GEMM ms", "GEMM ms w/ save",
                   "slowdown", "both ms", "both / sum", "both / max"],
                  [[r["max_programs"] or "none", C.fmt(r["save_ms"], 2), C.fmt(r["save_gb_s"], 1),
                    C.fmt(r["gemm_ms"], 2), C.fmt(r["gemm_ms_with_save"], 2),
                    C.fmt(r["gemm_slowdown"], 2), C.fmt(r["both_ms"], 2),
                    C.fmt(r["both_vs_sum"], 2), C.fmt(r["both_vs_max"], 2)] for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
