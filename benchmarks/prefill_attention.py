"""Prefill attention backends on the engine's call shape: causal SDPA over a whole prompt (what
layer-segmented prefill runs once per layer), q [1, Hq, n, D] transposed from the engine's
[n, Hq, D] rows, GQA through enable_gqa.

Per backend (cuDNN, flash, memory-efficient) and prompt length: the host time of the first
call at a new length (cuDNN builds an execution plan per shape), the steady host time per call
queued behind GPU work (does the call block the host?), and the GPU time per call. The engine
picks the prefill backends in worker/forward_context.py (PREFILL_SDPA_BACKENDS); this is the
measurement behind that choice.

    python benchmarks/prefill_attention.py --out $OUT/prefill_attention.json
    python benchmarks/prefill_attention.py --out /tmp/pa.json --smoke     # CPU, tiny
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                os.path.dirname(os.path.abspath(__file__))]

import common as C  # noqa: E402


def measure(backend, n: int, hq: int, hkv: int, d: int, dtype, device: str, iters: int) -> dict:
    """One backend at one length: first-call host ms, steady host ms per call, GPU ms per
    call (CUDA events), or {"error": ...} when the backend rejects the shape."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # the engine's layout: rows [n, H, D], attention on the transposed view
    q = torch.randn(n, hq, d, device=device, dtype=dtype).transpose(0, 1).unsqueeze(0)
    k = torch.randn(n, hkv, d, device=device, dtype=dtype).transpose(0, 1).unsqueeze(0)
    v = torch.randn_like(k)
    gqa = {"enable_gqa": True} if hq != hkv else {}
    m = 4096 if cuda else 64
    w = torch.randn(m, m, device=device, dtype=dtype)
    run = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)  # noqa: E731
    with sdpa_kernel([backend]):
        try:
            sync()
            t = time.perf_counter()
            run()
            first_host = time.perf_counter() - t
            sync()
            first_wall = time.perf_counter() - t
        except RuntimeError as e:
            return {"error": str(e).splitlines()[0][:200]}
        host = []
        for _ in range(iters):
            for _ in range(4):
                w @ w  # GPU work queued ahead: a call that blocks the host waits for it
            t = time.perf_counter()
            run()
            host.append(time.perf_counter() - t)
        sync()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                run()
            end.record()
            sync()
            gpu_ms = start.elapsed_time(end) / iters
        else:
            t = time.perf_counter()
            for _ in range(iters):
                run()
            gpu_ms = 1e3 * (time.perf_counter() - t) / iters
    return {"first_call_host_ms": 1e3 * first_host, "first_call_wall_ms": 1e3 * first_wall,
            "steady_host_ms": 1e3 * sum(host) / len(host), "gpu_ms": gpu_ms}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes")
    p.add_argument("--lengths", default="2267,5854,9970,15452,23433",
                   help="prompt lengths (distinct, odd: every one is a new shape)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args(argv)
    import torch
    from torch.nn.attention import SDPBackend

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.smoke:
        lengths, args.heads, args.kv_heads, args.head_dim, args.iters = [17, 97], 4, 2, 16, 2
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    if device == "cpu":
        backends = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}
    result = {"meta": C.meta(argv), "settings": {**vars(args), "device": device,
                                                 "dtype": str(dtype), "lengths": lengths},
              "rows": []}
    for n in lengths:
        for name, be in backends.items():
            r = measure(be, n, args.heads, args.kv_heads, args.head_dim, dtype, device, args.iters)
            result["rows"].append({"backend": name, "n": n, **r})
            C.write_json(args.out, result)
    print(f"wrote {args.out}\n")
    print(f"{'n':>6}  {'backend':<9}  {'first host ms':>13}  {'steady host ms':>14}  {'gpu ms':>7}")
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['n']:>6}  {r['backend']:<9}  {r['error'][:60]}")
            continue
        print(f"{r['n']:>6}  {r['backend']:<9}  {r['first_call_host_ms']:>13.2f}  "
              f"{r['steady_host_ms']:>14.3f}  {r['gpu_ms']:>7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
