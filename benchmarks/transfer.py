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

This file holds the arguments and the loop over page sizes; the rest lives beside it:
transfer_clock.py (timing, bulk bandwidth), transfer_pages.py (buffers, layouts, checks),
transfer_sweep.py (one page size), transfer_flash_h2d.py (graph and launch-parameter extras)
and transfer_report.py (plot and table).
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
from transfer_clock import Clock, bulk_bandwidth  # noqa: E402
from transfer_report import plot, print_table  # noqa: E402
from transfer_sweep import Sweep  # noqa: E402


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

    sweep = Sweep(args, dev, clock, deadline, res, rng)
    for kb in args.page_kb:
        if deadline.expired():
            res["skipped"].append(f"page size {kb:g} KB: time budget")
            continue
        savers = {}
        try:
            savers = sweep.one_page_size(kb) or {}
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
        C.empty_host_cache()  # pinned host pages of this size: free before the next one
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


if __name__ == "__main__":
    main()
