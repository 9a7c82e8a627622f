"""Timing for benchmarks/sparse_decode.py (class Bench: device time with a spin kernel
hiding launches, idle-start latency, median over reps, L2 flushed before each), bandwidth
arithmetic, and the device-to-device copy every bandwidth is compared with."""
from __future__ import annotations

import time


class Bench:
    """Timings of a callable: device time and idle-start latency (us), median of reps."""

    def __init__(self, torch, C, s, device):
        self.torch, self.C, self.s = torch, C, s
        self.cuda = device.type == "cuda"
        self.flush = (torch.empty(s["flush_mib"] << 20, dtype=torch.uint8, device=device)
                      if self.cuda and s["flush_mib"] else None)
        self.spin = getattr(torch.cuda, "_sleep", None) if self.cuda else None

    def time(self, fn, latency=True):
        torch, s, C = self.torch, self.s, self.C
        for _ in range(s["warmup"]):
            fn()
        if not self.cuda:  # CPU: wall time; both modes are the same thing
            ts = []
            for _ in range(s["min_reps"]):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            st = C.summarize(ts, 1e6)
            return {"gpu": st, "latency": st if latency else None, "reps": len(ts)}
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        est = time.perf_counter() - t0
        reps = int(min(s["max_reps"], max(s["min_reps"], s["target_s"] / (est + 2e-3))))
        res = {"reps": reps, "latency": None}
        for mode in ("gpu", "latency") if latency else ("gpu",):
            evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                   for _ in range(reps)]
            for a, b in evs:
                torch.cuda.synchronize()
                if mode == "gpu" and self.spin is not None:
                    self.spin(s["spin_cycles"])  # the CPU queues everything below meanwhile
                if self.flush is not None:
                    self.flush.zero_()
                if mode == "latency":
                    torch.cuda.synchronize()
                a.record()
                fn()
                b.record()
            torch.cuda.synchronize()
            res[mode] = C.summarize([a.elapsed_time(b) for a, b in evs], 1e3)
        return res


def tbs(nbytes, us):
    return nbytes / (us * 1e-6) / 1e12 if us and us > 0 else None


def frac(x, ref):
    return x / ref if x is not None and ref else None


def measure_copy(torch, bench, s, device):
    bufs = torch.ones(2, (s["copy_mib"] << 20) // 2, dtype=torch.bfloat16, device=device)
    t = bench.time(lambda: bufs[1].copy_(bufs[0]), latency=False)
    nbytes = 2 * bufs[0].numel() * bufs.element_size()  # read + write
    us = t["gpu"]["median"]
    return {"buffer_bytes": nbytes // 2, "bytes_moved": nbytes, "us": us, "bw_tbs": tbs(nbytes, us),
            "stats": t["gpu"], "note": "torch copy_ D2D; bandwidth counts read + write bytes"}



def kernel_sequence(torch, fn, reps=10):
    """Device kernels one call of ``fn`` launches, in launch order, with their mean device time
    over ``reps`` calls (torch.profiler): ``[{"name", "us"}]``; None off CUDA. Why: a select is
    several launches (channel choice, score phase, top-k phase) that may share a kernel name,
    so per-name totals would hide which phase holds the time; positions do not."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import DeviceType, ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    if not kernels:
        return [{"name": "(no device kernels recorded: CUPTI unavailable?)", "us": None}]
    per = len(kernels) // reps
    names = [k.name for k in kernels]
    if len(kernels) % reps or any(names[i] != names[i % per] for i in range(len(names))):
        return [{"name": f"(calls launched different kernels: {len(kernels)} over {reps} calls)",
                 "us": None, "count": len(kernels)}]
    return [{"name": kernels[i].name[:80],
             "us": sum(kernels[i + j * per].time_range.elapsed_us() for j in range(reps)) / reps}
            for i in range(per)]
