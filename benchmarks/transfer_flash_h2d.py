"""FlashH2D extras of benchmarks/transfer.py, measured once per run: the load captured in a
CUDA graph and replayed (exactness, eager vs replay bandwidth), and a sweep of its launch
parameters and of the cost of its counter."""
from __future__ import annotations

import common as C
import numpy as np
import torch

from sparseserve.transfer import bits_view, load_pages
from transfer_clock import Clock
from transfer_pages import PageSizeRun


def graph_check(r: PageSizeRun, n: int, clock: Clock, reps: int) -> dict:
    """Capture FlashH2D in a CUDA graph, replay, check exactness, time eager vs replay."""
    src, dst = r.load_ids(n)
    s = torch.tensor(src, dtype=torch.int32, device=r.dev)
    d = torch.tensor(dst, dtype=torch.int32, device=r.dev)

    def eager():
        load_pages(r.host_k, r.host_v, r.dev_k, r.dev_v, s, d, "flash")

    g = C.capture_graph(eager)
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
