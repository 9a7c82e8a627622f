"""KV page transfer bandwidth, like SparseServe's Figure 4.

    python benchmarks/transfer.py --out DIR [--smoke] [--page-kb 4,8,16,32,64]
        [--pages 64,256,1024,4096,16384] [--per-page-max 4096] [--d2h-threads 4,8]

Effective GB/s (K + V bytes moved / time) against page size and page count:
  load (host pinned DRAM -> device slots): per-page copy (one cudaMemcpyAsync per K / V page,
      ids as host lists) vs FlashH2D (one Triton kernel reading pinned memory by UVA);
  save (a step's new KV [T, Hkv=8, D] -> host pages): per-page copy (PerPageCopySaver) vs
      GPU-direct (the Triton kernel alone, ids already on the device) vs FlashD2H (one D2H copy
      into a pinned staging ring + CPU scatter threads; timed from save() to wait()), for
      each --d2h-threads count;
next to bulk pinned H2D / D2H bandwidth (one big copy) measured in the same run.
Page bytes = page_size tokens x head_dim (128) x 2 bytes (bf16), per K or per V page; one
"page" moves a K and a V page. Host pages and slots are random permutations (scattered).
Timing: CUDA events around each repetition (host-side waits included, so FlashD2H's CPU
scatter counts), warm-ups, median of --reps. Per-page copies above --per-page-max pages are
skipped (and listed as skipped) to bound the run time; a wall-clock budget skips what is left.
Every method is checked bit-exact once per page size, and FlashH2D is captured in a CUDA
graph and replayed (exactness + time).

Writes DIR/transfer.json (all rows, bulk bandwidths, checks, device, date; rewritten after
each page size) and DIR/transfer.png (load and save panels), and prints a table last.
`--smoke`: tiny sizes, wall-clock timing (no CUDA events), CPU paths on a CPU-only machine.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

import common as C  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from sparseserve.config import HOST_CHUNK_PAGES  # noqa: E402
from sparseserve.transfer import (FlashD2HSaver, PerPageCopySaver, bits_view,  # noqa: E402
                                  load_pages, memcpy_load_pages)

DTYPE = torch.bfloat16
HKV = 8


# ---- timing -----------------------------------------------------------------------------------
class Clock:
    """Times fn() per repetition: CUDA events on a GPU (unless wall=True), else perf_counter
    with device syncs. Returns seconds per rep."""

    def __init__(self, cuda: bool, wall: bool) -> None:
        self.events = cuda and not wall
        self.cuda = cuda

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def run(self, fn, reps: int, warmup: int) -> list[float]:
        for _ in range(warmup):
            fn()
        self.sync()
        out = []
        for _ in range(reps):
            if self.events:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                out.append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                self.sync()
                out.append(time.perf_counter() - t0)
        return out


def bulk_bandwidth(dev, nbytes: int, clock: Clock, reps: int) -> dict:
    pin = dev.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    host.fill_(1)
    devbuf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    h2d = clock.run(lambda: devbuf.copy_(host, non_blocking=True), reps, 2)
    d2h = clock.run(lambda: host.copy_(devbuf, non_blocking=True), reps, 2)
    return {"bytes": nbytes, "h2d_gbps": nbytes / np.median(h2d) / 1e9,
            "d2h_gbps": nbytes / np.median(d2h) / 1e9,
            "h2d_ms": [x * 1e3 for x in h2d], "d2h_ms": [x * 1e3 for x in d2h]}


# ---- one page size ------------------------------------------------------------------------------
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


def graph_check(r: PageSizeRun, n: int, clock: Clock, reps: int) -> dict:
    """Capture FlashH2D in a CUDA graph, replay, check exactness, time eager vs replay."""
    src, dst = r.load_ids(n)
    s = torch.tensor(src, dtype=torch.int32, device=r.dev)
    d = torch.tensor(dst, dtype=torch.int32, device=r.dev)

    def eager():
        load_pages(r.host_k, r.host_v, r.dev_k, r.dev_v, s, d, "flash")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager()
        eager()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        eager()
    r.dev_k.zero_()
    r.dev_v.zero_()
    g.replay()
    torch.cuda.synchronize()
    si, di = torch.from_numpy(src), torch.from_numpy(dst).to(r.dev)
    ok = all(torch.equal(bits_view(dt[di].cpu()), bits_view(ht[si]))
             for ht, dt in ((r.host_k, r.dev_k), (r.host_v, r.dev_v)))
    t_eager = clock.run(eager, reps, 1)
    t_graph = clock.run(g.replay, reps, 1)
    nbytes = 2 * n * r.page_bytes
    return {"page_kb": r.page_kb, "pages": n, "exact": ok,
            "eager_gbps": nbytes / np.median(t_eager) / 1e9,
            "graph_gbps": nbytes / np.median(t_graph) / 1e9}


def h2d_tuning(r: PageSizeRun, n: int, clock: Clock, reps: int) -> list[dict]:
    """FlashH2D launch parameters and the counter's cost, at one configuration."""
    from sparseserve.transfer.flash_h2d import flash_load_pages
    src, dst = r.load_ids(n)
    s = torch.tensor(src, device=r.dev)
    d = torch.tensor(dst, device=r.dev)
    counter = torch.zeros(2, dtype=torch.int64, device=r.dev)
    out = []
    for bb, nw, cnt in [(16384, None, False), (16384, None, True), (4096, 4, False),
                        (8192, 4, False), (8192, 8, False), (16384, 4, False), (32768, 8, False),
                        (65536, 8, False)]:
        fn = lambda: flash_load_pages(r.host_k, r.host_v, r.dev_k, r.dev_v, s, d,  # noqa: E731
                                      counter if cnt else None, block_bytes=bb, num_warps=nw)
        try:
            t = clock.run(fn, reps, 2)
            out.append({"page_kb": r.page_kb, "pages": n, "block_bytes": bb, "num_warps": nw,
                        "counter": cnt, "gbps": 2 * n * r.page_bytes / np.median(t) / 1e9})
        except Exception as exc:  # noqa: BLE001
            out.append({"block_bytes": bb, "num_warps": nw, "counter": cnt, **C.error_record(exc)})
    return out


# ---- driver -------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--page-kb", default="4,8,16,32,64")
    ap.add_argument("--pages", default="64,256,1024,4096,16384")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--per-page-max", type=int, default=4096,
                    help="skip per-page copies above this many pages")
    ap.add_argument("--d2h-threads", default="4,8")
    ap.add_argument("--staging-mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--bulk-mib", type=int, default=1024)
    ap.add_argument("--budget-s", type=float, default=200.0,
                    help="wall-clock budget: per-page copies stop first, then everything")
    a = ap.parse_args(argv)
    if a.smoke:
        a.page_kb, a.pages, a.head_dim = "0.125,0.25", "8,32", 16
        a.d2h_threads, a.staging_mib, a.reps, a.warmup, a.bulk_mib = "2", 1, 2, 1, 4
        a.per_page_max = min(a.per_page_max, 32)
    a.page_kb = [float(x) for x in a.page_kb.split(",")]
    a.pages = sorted(int(x) for x in a.pages.split(","))
    a.d2h_threads = [int(x) for x in a.d2h_threads.split(",")]
    return a


def main(argv=None) -> dict:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    clock = Clock(cuda, wall=args.smoke)
    deadline = C.Deadline(args.budget_s)
    rng = np.random.default_rng(0)
    os.makedirs(args.out, exist_ok=True)
    res = {"meta": C.meta(argv), "device": torch.cuda.get_device_name() if cuda else C.cpu_model(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           "config": {k: v for k, v in vars(args).items()}, "timing": "cuda-events" if clock.events else "wall",
           "bulk": None, "rows": [], "checks": [], "graph": [], "h2d_tuning": [], "skipped": [],
           "notes": [f"per-page copies skipped above {args.per_page_max} pages (--per-page-max)",
                     "gpu-direct rows time the kernel alone (page ids already on the device)",
                     "flash-d2h rows time save() .. wait(): one D2H copy + CPU scatter"]}
    path = os.path.join(args.out, "transfer.json")
    print(f"device: {res['device']}  timing: {res['timing']}", flush=True)

    try:
        res["bulk"] = bulk_bandwidth(dev, args.bulk_mib << 20, clock, args.reps)
        print(f"bulk pinned H2D {res['bulk']['h2d_gbps']:.1f} GB/s, "
              f"D2H {res['bulk']['d2h_gbps']:.1f} GB/s", flush=True)
    except Exception as exc:  # noqa: BLE001
        res["bulk"] = C.error_record(exc)
        print("bulk bandwidth failed:", exc, flush=True)

    def record(direction, method, r, n, fn_or_none, nbytes, reason=None, extra=None):
        row = {"direction": direction, "method": method, "page_kb": r.page_kb,
               "page_bytes": r.page_bytes, "page_size": r.ps, "head_dim": r.D, "pages": n,
               "bytes": nbytes}
        if fn_or_none is None:
            row.update(status="skipped", reason=reason)
            res["skipped"].append(f"{direction} {method} {r.page_kb:g} KB x {n}: {reason}")
        else:
            try:
                t = clock.run(fn_or_none, args.reps, args.warmup)
                med = float(np.median(t))
                row.update(status="ok", ms=med * 1e3, times_ms=[x * 1e3 for x in t],
                           gbps=nbytes / med / 1e9)
                if extra:
                    row.update(extra())
            except Exception as exc:  # noqa: BLE001
                row.update(status="error", **C.error_record(exc))
                print(f"  {direction} {method} {r.page_kb:g}KB x{n}: ERROR {exc}", flush=True)
                if C.is_oom(exc):
                    C.free_device_memory()
        res["rows"].append(row)
        if row.get("status") == "ok":
            print(f"  {direction:4s} {method:16s} {r.page_kb:6g} KB x {n:6d}: "
                  f"{row['gbps']:7.2f} GB/s ({row['ms']:.3f} ms)", flush=True)

    def check(direction, method, r, n, fn):
        try:
            ok = bool(fn())
            res["checks"].append({"direction": direction, "method": method, "page_kb": r.page_kb,
                                  "pages": n, "exact": ok})
            if not ok:
                print(f"  CHECK FAILED: {direction} {method} {r.page_kb:g} KB x {n}", flush=True)
        except Exception as exc:  # noqa: BLE001
            res["checks"].append({"direction": direction, "method": method, "page_kb": r.page_kb,
                                  "pages": n, "exact": False, **C.error_record(exc)})
            print(f"  CHECK ERROR: {direction} {method}: {exc}", flush=True)

    def per_page_reason(n):
        if n > args.per_page_max:
            return f"per-page copies capped at {args.per_page_max} pages (--per-page-max)"
        if deadline.expired(reserve_s=0.35 * args.budget_s):
            return "time budget"
        return None

    max_pages = max(args.pages)

    def one_page_size(kb):
        """Every measurement of one page size; -> its savers (closed by the caller)."""
        print(f"page {kb:g} KB", flush=True)
        try:
            r = PageSizeRun(args, dev, kb, max_pages, rng)
        except Exception as exc:  # noqa: BLE001
            res["skipped"].append(f"page size {kb:g} KB: setup failed: {exc}")
            print("  setup failed:", exc, flush=True)
            C.free_device_memory()
            return
        n_chk = min(256, max_pages)
        staging = args.staging_mib << 20
        savers = {}
        try:
            for t in args.d2h_threads:
                savers[f"flash-d2h-t{t}"] = FlashD2HSaver([r.host_k], [r.host_v], num_threads=t,
                                                          staging_bytes=staging)
            savers["per-page-copy"] = PerPageCopySaver([r.host_k], [r.host_v])
        except Exception as exc:  # noqa: BLE001
            res["skipped"].append(f"savers for {kb:g} KB: {exc}")
        # ---- load
        check("load", "flash-h2d", r, n_chk, lambda: check_load(r, "flash", n_chk))
        check("load", "per-page-copy", r, n_chk, lambda: check_load(r, "memcpy", n_chk))
        for n in args.pages:
            src, dst = r.load_ids(n)
            s_t, d_t = torch.tensor(src, device=dev), torch.tensor(dst, device=dev)
            nbytes = 2 * n * r.page_bytes
            record("load", "flash-h2d", r, n, lambda: load_pages(
                r.host_k, r.host_v, r.dev_k, r.dev_v, s_t, d_t, "flash"), nbytes)
            # same pages in host order (consecutive ids): is page scatter the cost?
            s_seq = torch.arange(n, device=dev)
            record("load", "flash-h2d-seq", r, n, lambda: load_pages(
                r.host_k, r.host_v, r.dev_k, r.dev_v, s_seq, d_t, "flash"), nbytes)
            # one contiguous copy of the same bytes: the bulk bandwidth at this size
            if cuda:
                flat_h, flat_d = r.host_k.view(-1)[:nbytes // 4], r.dev_k.view(-1)[:nbytes // 4]
                record("load", "bulk-same-bytes", r, n, lambda: (
                    flat_d.copy_(flat_h, non_blocking=True),
                    r.dev_v.view(-1)[:nbytes // 4].copy_(r.host_v.view(-1)[:nbytes // 4],
                                                         non_blocking=True)), nbytes)
            why = per_page_reason(n)
            sl, dl = src.tolist(), dst.tolist()
            record("load", "per-page-copy", r, n, None if why else lambda: memcpy_load_pages(
                r.host_k, r.host_v, r.dev_k, r.dev_v, sl, dl), nbytes, reason=why)
        if cuda and not args.smoke and not res["graph"] and kb >= 16:
            try:
                res["graph"].append(graph_check(r, min(1024, max_pages), clock, args.reps))
                print(f"  cuda graph: {res['graph'][-1]}", flush=True)
            except Exception as exc:  # noqa: BLE001
                res["graph"].append({"page_kb": kb, **C.error_record(exc)})
                print("  cuda graph check failed:", exc, flush=True)
            res["h2d_tuning"] = h2d_tuning(r, min(4096, max_pages), clock, args.reps)
        # ---- save
        gd = gpu_direct_fn(r)
        check("save", "gpu-direct", r, n_chk, lambda: check_save(r, lambda T, p, o: gd(T, p, o)(), n_chk))
        for name, sv in savers.items():
            check("save", name, r, n_chk, lambda sv=sv: check_save(
                r, lambda T, p, o: saver_call(sv, r, T, p, o)(), n_chk))
            check("save", name + "-chunked", r, n_chk, lambda sv=sv: check_save(
                r, lambda T, p, o: saver_call(sv, r, T, p, o)(), n_chk, chunked=True))
        for n in args.pages:
            T, pages, offs = r.save_layout(n)
            nbytes = 2 * pages.size * r.D * 2                # rows x D x bf16, K and V
            record("save", "gpu-direct", r, n, gd(T, pages, offs), nbytes)
            # FlashD2H also with the engine's page layout (chunks of consecutive host pages)
            Tc, pages_c, offs_c = r.save_layout(n, chunked=True)
            for name, sv in savers.items():
                why = per_page_reason(n) if name == "per-page-copy" else None
                layouts = [(name, T, pages, offs)]
                if name.startswith("flash-d2h"):
                    layouts.append((name + "-chunked", Tc, pages_c, offs_c))
                for label, t_, p_, o_ in layouts:
                    record("save", label, r, n, None if why else saver_call(sv, r, t_, p_, o_),
                           nbytes, reason=why, extra=scatter_extra(sv) if label != name
                           or name.startswith("flash-d2h") else None)
        return savers

    for kb in args.page_kb:
        if deadline.expired():
            res["skipped"].append(f"page size {kb:g} KB: time budget")
            continue
        savers = {}
        try:
            savers = one_page_size(kb) or {}
        except Exception as exc:  # noqa: BLE001
            res["skipped"].append(f"page size {kb:g} KB: {type(exc).__name__}: {exc}")
            print(f"  page size {kb:g} KB failed: {exc}", flush=True)
        for sv in savers.values():
            try:
                sv.close()
            except Exception as exc:  # noqa: BLE001
                res["skipped"].append(f"closing a saver: {exc}")
        del savers
        C.free_device_memory()
        if hasattr(torch._C, "_host_emptyCache"):
            try:
                torch._C._host_emptyCache()
            except Exception:  # noqa: BLE001
                pass
        res["elapsed_s"] = deadline.elapsed()
        C.write_json(path, res)

    res["elapsed_s"] = deadline.elapsed()
    C.write_json(path, res)
    try:
        plot(res, os.path.join(args.out, "transfer.png"))
    except Exception as exc:  # noqa: BLE001
        print("plot failed:", exc, flush=True)
    print_table(res, args)
    print(f"wrote {path} ({res['elapsed_s']:.0f} s)")
    return res


# ---- output -------------------------------------------------------------------------------------
COLORS = {"flash-h2d": "tab:red", "per-page-copy": "tab:blue", "gpu-direct": "tab:green"}
STYLES = ["-", "--", "-.", ":", (0, (3, 1, 1, 1, 1, 1))]


def plot(res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    rows = [r for r in res["rows"] if r.get("status") == "ok"]
    kbs = sorted({r["page_kb"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    d2h_colors = ["tab:orange", "tab:purple", "tab:brown", "tab:pink"]
    for ax, direction, bulk_key in ((axes[0], "load", "h2d_gbps"), (axes[1], "save", "d2h_gbps")):
        methods = sorted({r["method"] for r in rows if r["direction"] == direction})
        colors = {}
        for m in methods:
            colors[m] = COLORS.get(m) or d2h_colors[len([c for c in colors if c not in COLORS]) % 4]
        for m in methods:
            for i, kb in enumerate(kbs):
                pts = sorted((r["pages"], r["gbps"]) for r in rows
                             if r["direction"] == direction and r["method"] == m and r["page_kb"] == kb)
                if pts:
                    ax.plot(*zip(*pts), color=colors[m], linestyle=STYLES[i % len(STYLES)],
                            marker="o", markersize=3)
        bulk = (res.get("bulk") or {}).get(bulk_key)
        if bulk:
            ax.axhline(bulk, color="black", linewidth=1, alpha=0.6)
            ax.text(ax.get_xlim()[0] if rows else 1, bulk, f" bulk {bulk:.1f} GB/s",
                    va="bottom", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("pages (K + V each)")
        ax.set_title(f"{direction} ({'host -> device' if direction == 'load' else 'device -> host'})")
        ax.grid(True, which="both", alpha=0.3)
        handles = [Line2D([], [], color=colors[m], label=m) for m in methods]
        handles += [Line2D([], [], color="gray", linestyle=STYLES[i % len(STYLES)],
                           label=f"{kb:g} KB pages") for i, kb in enumerate(kbs)]
        ax.legend(handles=handles, fontsize=8, loc="best")
    axes[0].set_ylabel("effective GB/s")
    fig.suptitle(f"KV page transfers on {res['device']} ({res['date']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(res, args):
    bulk = res.get("bulk") or {}
    if "h2d_gbps" in bulk:
        print(f"\nbulk pinned: H2D {bulk['h2d_gbps']:.1f} GB/s, D2H {bulk['d2h_gbps']:.1f} GB/s")
    for s in res["skipped"][:3]:
        print("skipped:", s)
    if len(res["skipped"]) > 3:
        print(f"skipped: ... {len(res['skipped']) - 3} more (see JSON)")
    bad = [c for c in res["checks"] if not c.get("exact")]
    print(f"exactness checks: {len(res['checks']) - len(bad)}/{len(res['checks'])} ok"
          + (f"; FAILED: {[(c['direction'], c['method'], c['page_kb']) for c in bad]}" if bad else ""))
    for g in res["graph"]:
        print(f"cuda graph FlashH2D: {g}")
    headers = ["GB/s", *[str(n) for n in args.pages]]
    lines = []
    keys = []
    for r in res["rows"]:
        k = (r["direction"], r["method"], r["page_kb"])
        if k not in keys:
            keys.append(k)
    for k in keys:
        cells = []
        for n in args.pages:
            r = next((x for x in res["rows"] if (x["direction"], x["method"], x["page_kb"]) == k
                      and x["pages"] == n), None)
            cells.append("-" if r is None else f"{r['gbps']:.3g}" if r.get("status") == "ok"
                         else r.get("status", "?"))
        lines.append([f"{k[0]} {k[1]} {k[2]:g}KB", *cells])
    print(C.table(headers, lines))


if __name__ == "__main__":
    main()
