"""Where a step's GPU idles: read a torch.profiler Chrome trace (prefill_mfu.py --trace-dir)
and list the gaps of its compute, each with why it idled.

The compute is every GPU kernel, copy and memset on any stream but the side work named by
`--side-kernels` (the GPU-direct saves): a replayed CUDA graph runs its forked bodies on
streams of its own (the two-tier layer graphs: a stream per layer graph, while their saves
show on the capturing stream), so no single stream holds a step's compute. For every gap
longer than `--min-gap-us` in the union of the compute intervals, the kernel that ended it
is matched to its launch (the runtime or driver call
of the same `correlation` id; enqueued when that call returned): if it was enqueued after the
gap began, the GPU waited for the host
("host", and the CPU op the launch was made in is named); if it came before, the kernel waited
for something on the device — another stream's work or an event ("device"). Side streams'
kernel time that ran inside the gaps is reported too (a save running while compute idles).

    python benchmarks/trace_gaps.py traces/sparseserve_gpu-direct_16384_16_step1.json --top 15
"""
from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def load_events(path: str) -> list[dict]:
    with open(path) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def busy_intervals(events: list[dict]) -> dict[object, list[tuple[float, float, dict]]]:
    """-> stream -> [(start us, end us, event)] sorted, for the GPU's complete events."""
    by_stream = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in GPU_CATS:
            stream = e.get("args", {}).get("stream", e.get("tid"))
            by_stream[stream].append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e))
    return {s: sorted(v, key=lambda x: x[0]) for s, v in by_stream.items()}


SIDE_KERNELS = r"_gpu_direct_kernel"  # the GPU-direct saves (transfer/gpu_direct.py)


def gaps(intervals: list[tuple[float, float, dict]], min_gap: float
         ) -> list[tuple[float, float, dict]]:
    """-> [(gap start, gap end, the event that ended it)] between consecutive intervals
    (sorted by start; overlaps merged), longer than min_gap us."""
    out, end = [], None
    for s, e, ev in intervals:
        if end is not None and s - end > min_gap:
            out.append((end, s, ev))
        end = e if end is None else max(end, e)
    return out


def overlap(a0: float, a1: float, intervals) -> float:
    """us of [a0, a1) covered by the intervals (they may overlap each other)."""
    pieces = sorted((max(a0, s), min(a1, e)) for s, e, _ in intervals if s < a1 and e > a0)
    total, cur = 0.0, None
    for s, e in pieces:
        if cur is None or s > cur[1]:
            if cur is not None:
                total += cur[1] - cur[0]
            cur = [s, e]
        else:
            cur[1] = max(cur[1], e)
    return total + (cur[1] - cur[0] if cur is not None else 0.0)


def analyse(events: list[dict], min_gap: float = 20.0, side_kernels: str = SIDE_KERNELS) -> dict:
    """The compute's gaps and their causes (module doc) -> a JSON-able summary."""
    streams = busy_intervals(events)
    if not streams:
        return {"streams": {}, "gaps": [], "span_us": 0.0}
    busy = {s: sum(e - b for b, e, _ in v) for s, v in streams.items()}
    # '' names no side work (an empty pattern would match every kernel)
    is_side = re.compile(side_kernels).search if side_kernels else (lambda name: None)
    compute = sorted((x for v in streams.values() for x in v if not is_side(x[2].get("name", ""))),
                     key=lambda x: x[0])
    # when each kernel was enqueued: the end of its launch call. Triton kernels are launched
    # through the driver API (cuLaunchKernel*: "cuda_driver"), torch's through the runtime;
    # where a runtime call wraps a driver call of the same correlation id, the inner one
    # ends first
    enqueued: dict = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            c, end = e["args"]["correlation"], float(e["ts"]) + float(e.get("dur", 0))
            enqueued[c] = min(end, enqueued.get(c, end))
    cpu_ops = sorted((e for e in events if e.get("cat") == "cpu_op" and e.get("ph") == "X"),
                     key=lambda e: float(e["ts"]))
    first = min(v[0][0] for v in streams.values())
    last = max(max(e for _, e, _ in v) for v in streams.values())
    side = [x for v in streams.values() for x in v if is_side(x[2].get("name", ""))]
    rows = []
    for g0, g1, ev in gaps(compute, min_gap):
        t = enqueued.get(ev.get("args", {}).get("correlation"))
        cause, op = "device", None
        if t is not None and t > g0:
            cause = "host"
            inside = [o for o in cpu_ops if float(o["ts"]) <= t <= float(o["ts"]) + float(o["dur"])]
            op = min(inside, key=lambda o: float(o["dur"]))["name"] if inside else None
        rows.append({"start_us": g0 - first, "gap_us": g1 - g0, "cause": cause,
                     "next_kernel": ev.get("name", "")[:100], "launched_in": op,
                     "side_stream_busy_us": overlap(g0, g1, side)})
    return {"span_us": last - first, "side_kernels": side_kernels,
            "compute_busy_us": overlap(first, last, compute),
            "streams": {str(s): {"kernels": len(v), "busy_us": busy[s]}
                        for s, v in streams.items()},
            "idle_us": sum(r["gap_us"] for r in rows),
            "idle_by_cause_us": {c: sum(r["gap_us"] for r in rows if r["cause"] == c)
                                 for c in ("host", "device")},
            "gaps": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("traces", nargs="+", help="Chrome trace JSON files")
    p.add_argument("--min-gap-us", type=float, default=20.0)
    p.add_argument("--side-kernels", default=SIDE_KERNELS,
                   help="regex of kernel names that are side work, not compute (default: the "
                        "GPU-direct saves; '' none). Copies and other kernels on side streams "
                        "(a flash_d2h save's memcpy, the loader's copies) count as compute, and "
                        "a save run on the compute stream shows as a gap")
    p.add_argument("--top", type=int, default=10, help="longest gaps printed per trace")
    p.add_argument("--out", default=None, help="JSON summary path")
    a = p.parse_args(argv)
    res = {}
    for path in a.traces:
        r = res[path] = analyse(load_events(path), a.min_gap_us, a.side_kernels)
        print(f"{path}: span {r['span_us'] / 1e3:.1f} ms, compute idle "
              f"{r.get('idle_us', 0) / 1e3:.1f} ms in {len(r['gaps'])} gaps "
              f"(host {r.get('idle_by_cause_us', {}).get('host', 0) / 1e3:.1f} ms, device "
              f"{r.get('idle_by_cause_us', {}).get('device', 0) / 1e3:.1f} ms)")
        for g in sorted(r["gaps"], key=lambda g: -g["gap_us"])[:a.top]:
            print(f"  at {g['start_us'] / 1e3:8.2f} ms  {g['gap_us']:8.1f} us  {g['cause']:6s} "
                  f"side {g['side_stream_busy_us']:7.1f} us  next {g['next_kernel'][:50]}"
                  f"{'  (launched in ' + g['launched_in'] + ')' if g['launched_in'] else ''}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
