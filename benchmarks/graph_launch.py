"""Does the host's CUDA-graph launch delay the GPU? A graph of N tiny kernels (N like a decode
step's: ~550 for dense LWM-7B, ~770 with the two-tier cache), replayed from an idle stream:

* launch_ms  the host time of ``CUDAGraph.replay()`` (median),
* idle_to_done_ms  from an event recorded just before the replay (the GPU runs it at once:
  the stream is idle) to one recorded after it: launch latency + execution,
* gpu_ms  the graph's execution alone (replays queued back to back, per replay),
* exposed_ms = idle_to_done - gpu: the part of the launch the GPU waited for.

If exposed_ms grows with N like launch_ms, a step's launch is not hidden behind its own
execution, and every node of a decode graph costs its host submit time too.

  python benchmarks/graph_launch.py --out graph_launch.json
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch


def build(n: int, numel: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    x = torch.zeros(numel, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            x.add_(1.0)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for _ in range(n):
                x.add_(1.0)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    return g, x


def measure(n: int, numel: int, reps: int) -> dict:
    g, _ = build(n, numel)
    launch, idle_done = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        t = time.perf_counter()
        g.replay()
        launch.append(1e3 * (time.perf_counter() - t))
        e1.record()
        e1.synchronize()
        idle_done.append(e0.elapsed_time(e1))
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        g.replay()  # fill the queue: the GPU never waits for the host below
    e0.record()
    for _ in range(reps):
        g.replay()
    e1.record()
    e1.synchronize()
    gpu = e0.elapsed_time(e1) / reps
    out = {"nodes": n, "numel": numel, "launch_ms": float(np.median(launch)),
           "idle_to_done_ms": float(np.median(idle_done)), "gpu_ms": gpu}
    out["exposed_ms"] = out["idle_to_done_ms"] - gpu
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--nodes", default="100,300,550,770,1100")
    p.add_argument("--numel", type=int, default=1 << 16, help="elements each kernel adds to")
    p.add_argument("--reps", type=int, default=30)
    a = p.parse_args()
    rows = [measure(int(n), a.numel, a.reps) for n in a.nodes.split(",")]
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "rows": rows}, open(a.out, "w"), indent=1)
    print(f"{'nodes':>6} {'launch ms':>10} {'idle->done ms':>14} {'gpu ms':>8} {'exposed ms':>11}")
    for r in rows:
        print(f"{r['nodes']:6d} {r['launch_ms']:10.3f} {r['idle_to_done_ms']:14.3f} "
              f"{r['gpu_ms']:8.3f} {r['exposed_ms']:11.3f}")


if __name__ == "__main__":
    main()
