"""Host memory copy bandwidth with N threads: the ceiling of FlashD2H's CPU scatter.

`copy`: each thread copies its own 256 MiB run between two buffers with numpy (which
releases the GIL). `scatter`: each thread moves 16 KB pages from a staging buffer into
random pages of a page tier with one fancy assignment, as FlashD2H's threads do; `pinned`
does the same with page-locked staging and tier (what the engine uses on a GPU machine).
GB/s counts the bytes copied (each is read once and written once). Prints a table, writes
JSON.

    python benchmarks/host_memcpy.py --out $OUT/host_memcpy
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402


def copy_rate(threads: int, mib: int, reps: int) -> float:
    n = mib << 20
    src = [np.ones(n, np.uint8) for _ in range(threads)]
    dst = [np.full(n, 0, np.uint8) for _ in range(threads)]  # touched: no first-touch faults
    return best_rate([(np.copyto, (d, s)) for d, s in zip(dst, src)], threads * n, reps)


def best_rate(jobs, nbytes: int, reps: int) -> float:
    """Best GB/s over reps of running every (fn, args) job in its own thread at once."""
    best = 0.0
    for _ in range(reps):
        ts = [threading.Thread(target=fn, args=args) for fn, args in jobs]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def scatter_rate(threads: int, mib: int, reps: int, pinned: bool) -> float:
    import torch
    page = 16384
    n = (mib << 20) // page
    def buf(rows):
        t = torch.empty((rows, page), dtype=torch.uint8, pin_memory=pinned)
        t.fill_(1)
        return t.numpy()
    stage = [buf(n) for _ in range(threads)]
    tier = buf(2 * n * threads)
    rng = np.random.default_rng(0)
    perm = rng.permutation(2 * n * threads)
    idx = [perm[i * n:(i + 1) * n] for i in range(threads)]  # disjoint pages per thread
    return best_rate([(tier.__setitem__, (i, s)) for i, s in zip(idx, stage)],
                     threads * n * page, reps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--threads", default="1,2,4,8,16")
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args(argv)
    import torch
    pin = torch.cuda.is_available()
    rows = [{"threads": t, "copy_gbps": copy_rate(t, a.mib, a.reps),
             "scatter_gbps": scatter_rate(t, a.mib, a.reps, False),
             "scatter_pinned_gbps": scatter_rate(t, a.mib, a.reps, True) if pin else None}
            for t in (int(x) for x in a.threads.split(","))]
    os.makedirs(a.out, exist_ok=True)
    C.write_json(os.path.join(a.out, "host_memcpy.json"),
                 {"meta": C.meta(argv), "cpu": C.cpu_model(), "cores": os.cpu_count(),
                  "mib_per_thread": a.mib, "rows": rows})
    for r in rows:
        print(f"{r['threads']:3d} threads: copy {r['copy_gbps']:6.1f} GB/s, page scatter "
              f"{r['scatter_gbps']:6.1f}, pinned {r['scatter_pinned_gbps'] or 0:6.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
