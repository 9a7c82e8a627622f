"""Attention of a prompt chunk that continues a prefix: the paged prefill kernel
(kernels/paged_prefill.py, K/V read in place from the pages) against the torch path it
replaced (gather the sequence's pages, repeat K/V per GQA group, SDPA with a lower-right causal
mask — forward_context.py before the kernel), one layer, both timed in the same process.

Per (heads, prefix): GPU ms of each path (CUDA events, median of `--reps` after warm-up; at
prefix 0 also the whole-prompt cuDNN path the eager engine uses, prefill_attention.py),
TFLOP/s (causal attention FLOPs 4 x Hq x D x sum of keys per query), the worst difference
between the two outputs, and the kernel's launch configurations (`--configs`) side by side.

    python benchmarks/prefill_paged_attention.py --out $OUT/paged_prefill.json \\
        --prefixes 2048,8192,32768,131072 --chunk 2048 --heads 32/8,32/32
    python benchmarks/prefill_paged_attention.py --out /tmp/pp.json --smoke   # CPU, interpreted
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                os.path.dirname(os.path.abspath(__file__))]

import common as C  # noqa: E402


def torch_path(q, k_cache, v_cache, pages, start, scale):
    """The replaced path: q [n, Hq, D] at positions [start, start + n) over the pages [Hkv, nb]."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    n, hq, _ = q.shape
    hkv, nb = pages.shape
    ps = k_cache.shape[1]
    total = start + n
    ks = k_cache[pages].reshape(hkv, nb * ps, -1)[:, :total]
    vs = v_cache[pages].reshape(hkv, nb * ps, -1)[:, :total]
    g = hq // hkv
    if g > 1:
        ks, vs = ks.repeat_interleave(g, 0), vs.repeat_interleave(g, 0)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], ks[None], vs[None],
                                         attn_mask=causal_lower_right(n, total), scale=scale)
    return out[0].transpose(0, 1)


def gpu_ms(fn, reps: int) -> float:
    import torch

    if not torch.cuda.is_available():
        fn()
        return float("nan")
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def run_case(hq: int, hkv: int, prefix: int, chunk: int, a, device, dtype) -> dict:
    import torch

    from sparseserve.kernels.paged_prefill import (METADATA, block_tokens,
                                                   paged_prefill_attention, plan_metadata)

    d, ps = a.head_dim, a.page_size
    total = prefix + chunk
    nb = -(-total // ps)
    gen = torch.Generator().manual_seed(0)
    pages = torch.randperm(nb * hkv + 7, generator=gen)[:nb * hkv].view(hkv, nb).to(torch.int32)
    k_cache = torch.randn(nb * hkv + 7, ps, d, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(chunk, hq, d, dtype=dtype, device=device)
    pages = pages.to(device)
    scale = d ** -0.5
    flops = 4 * hq * d * (chunk * prefix + chunk * (chunk + 1) / 2)
    ref = torch_path(q, k_cache, v_cache, pages.long(), prefix, scale)
    old = gpu_ms(lambda: torch_path(q, k_cache, v_cache, pages.long(), prefix, scale), a.reps)
    rec = {"hq": hq, "hkv": hkv, "prefix": prefix, "chunk": chunk, "torch_ms": old,
           "torch_tflops": flops / old / 1e9, "configs": []}
    if prefix == 0 and torch.cuda.is_available():  # a whole prompt: the engine's cuDNN plans
        from sparseserve.worker.prefill_attention import PaddedCausalAttention
        cudnn = PaddedCausalAttention.for_cuda(hq, hkv, d, scale, dtype, torch.device(device),
                                               chunk)
        if cudnn is not None:
            kc = k_cache[pages.long()].reshape(hkv, -1, d)[:, :chunk].transpose(0, 1).contiguous()
            vc = v_cache[pages.long()].reshape(hkv, -1, d)[:, :chunk].transpose(0, 1).contiguous()
            rec["cudnn_ms"] = gpu_ms(lambda: cudnn(q, kc, vc), a.reps)
    for cfg in a.configs.split(","):
        rows, warps, stages = (int(x) for x in cfg.split("/"))
        gp = 1 << max(0, (hq // hkv - 1).bit_length())
        bm = 16 if a.smoke else max(16, rows // gp)
        meta = plan_metadata([chunk], [prefix], bm)
        dev_meta = [torch.from_numpy(meta[k]).to(device) for k in METADATA]
        fn = lambda: paged_prefill_attention(q, k_cache, v_cache, pages[None], *dev_meta,  # noqa: E731
                                             scale, bm, num_warps=warps, num_stages=stages)
        try:
            got = fn()
            ms = gpu_ms(fn, a.reps)
            err = (got.float() - ref.float()).abs().max().item()
            rec["configs"].append({"rows": rows, "block_m": bm, "num_warps": warps,
                                   "num_stages": stages, "ms": ms, "tflops": flops / ms / 1e9,
                                   "max_abs_diff": err})
        except Exception as exc:  # noqa: BLE001 - a config that does not compile is a result
            rec["configs"].append({"rows": rows, "num_warps": warps, "num_stages": stages,
                                   "error": str(exc).splitlines()[0][:200]})
    ok = [c for c in rec["configs"] if "ms" in c]
    rec["default_block_m"] = block_tokens(hq, hkv)
    rec["best"] = min(ok, key=lambda c: c["ms"]) if ok else None
    del k_cache, v_cache, q, ref
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--prefixes", default="0,2048,8192,32768,131072",
                   help="0: a whole prompt (also timed on the engine's padded cuDNN plans)")
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--heads", default="32/8,32/32", help="Hq/Hkv pairs (Llama-3-8B, LWM-7B)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--configs", default="64/4/2,64/4/3,64/8/2,128/8/2,32/4/2",
                   help="rows per program / num_warps / num_stages (rows = tokens x group)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpreted)")
    a = p.parse_args(argv)
    if a.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
    import torch
    if a.smoke:
        a.prefixes, a.chunk, a.heads, a.head_dim, a.page_size = "37", 21, "4/2", 16, 16
        a.configs, a.reps = "32/4/2", 1
    device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    res = {"meta": C.meta(argv), "args": vars(a), "cases": []}
    for heads in a.heads.split(","):
        hq, hkv = (int(x) for x in heads.split("/"))
        for prefix in (int(x) for x in a.prefixes.split(",")):
            res["cases"].append(run_case(hq, hkv, prefix, a.chunk, a, device, dtype))
            C.write_json(a.out, res)
            C.free_device_memory()
    print(C.table(["Hq/Hkv", "prefix", "chunk", "torch ms", "cuDNN ms", "kernel ms (best)",
                   "config", "speed-up", "TFLOP/s", "max |diff|"],
                  [[f"{r['hq']}/{r['hkv']}", r["prefix"], r["chunk"], C.fmt(r["torch_ms"], 3),
                    C.fmt(r.get("cudnn_ms"), 3),
                    C.fmt(r["best"]["ms"], 3) if r["best"] else "-",
                    "{rows}/{num_warps}/{num_stages}".format(**r["best"]) if r["best"] else "-",
                    C.fmt(r["torch_ms"] / r["best"]["ms"], 2) if r["best"] else "-",
                    C.fmt(r["best"]["tflops"]) if r["best"] else "-",
                    f"{r['best']['max_abs_diff']:.2e}" if r["best"] else "-"]
                   for r in res["cases"]]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
