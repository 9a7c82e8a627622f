"""Would reading K/V as strided views of the cache (no gather) speed up the CPU decode attention?

Per layer, batch 16 x 3 KV heads x 3 query heads, D 64, page_size 16, one thread, fp32, 8
layers of caches cycled (cold-ish): the shipped path (``paged_decode_cpu.decode_planned``: K
gathered by index_select, bmm, V by embedding_bag) against

* ``views_K``: each (request, KV head)'s leading run of consecutive pages read as a strided
  view; runs of equal length and equal spacing batched into one bmm over an ``as_strided``
  view (here all 48 form one group); the other (decode-time, scattered) pages gathered as now;
* ``ideal``: every (request, head) one contiguous run, K and V both by bmm on views, no mask:
  the ceiling of any torch-op design that skips the gather.

The page layout is what a head-major allocator would give: each prompt's 32 pages per head
consecutive, then one scattered page per (request, head) every 16 decode tokens. Timings are
interleaved call by call (order alternating, different layers' caches), reported as medians of
the per-call ratios to the shipped path.

    python benchmarks/cpu_decode_views.py --out docs/results/data/cpu_decode_views.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sparseserve.kernels.paged_decode_cpu import decode_planned, plan_decode  # noqa: E402

B, HKV, G, D, PS, LAYERS = 16, 3, 3, 64, 16, 8


def layout(L: int, prompt: int = 500, seed: int = 0):
    """page table int32 [B, Hkv, W]: prompt pages consecutive per (b, h), decode pages random."""
    rng = np.random.default_rng(seed)
    npre, n = -(-prompt // PS), -(-L // PS)
    P = B * HKV * n + 64
    tbl = np.zeros((B, HKV, n), np.int32)
    tbl[:, :, :npre] = (np.arange(B * HKV)[:, None] * npre + np.arange(npre)).reshape(B, HKV, npre)
    free = rng.permutation(np.arange(B * HKV * npre, P))
    tbl[:, :, npre:] = free[: B * HKV * (n - npre)].reshape(n - npre, B, HKV).transpose(1, 2, 0)
    last = torch.full((B,), L - (n - 1) * PS, dtype=torch.int32)
    return torch.from_numpy(tbl), torch.full((B, HKV), n, dtype=torch.int32), last, P, npre


def views_k(q, kc, vc, plan, npre, scale):
    """K of the prompt pages through one as_strided bmm, the rest as decode_planned does."""
    N = plan.drop_s.shape[-1]
    Nr = npre * PS
    qg = q.view(B, HKV, G, D)
    s = torch.empty(B, HKV, G, N)
    kf = kc.view(-1, D)
    kv = kf.as_strided((B * HKV, Nr, D), (Nr * D, D, 1), kf.storage_offset())
    torch.matmul(qg.view(B * HKV, G, D), kv.transpose(1, 2), out=s.view(B * HKV, G, N)[..., :Nr])
    ids = plan.page_ids.view(B, HKV, -1)[:, :, npre:].reshape(-1)
    if ids.numel():
        kt = kc.index_select(0, ids).view(B, HKV, N - Nr, D)
        s[..., Nr:] = torch.matmul(qg, kt.transpose(-1, -2))
    s.mul_(scale).masked_fill_(plan.drop_s, float("-inf"))
    p = torch.softmax(s, dim=-1).reshape(-1).index_select(0, plan.weight_pos)
    return torch.nn.functional.embedding_bag(plan.bag_rows, vc.view(-1, D), plan.bag_offsets,
                                             mode="sum", per_sample_weights=p).view(B, -1, D)


def ideal(q, kc, vc, n, scale):
    kf, vf = kc.view(-1, D), vc.view(-1, D)
    kv = kf.as_strided((B * HKV, n, D), (n * D, D, 1), 0)
    vv = vf.as_strided((B * HKV, n, D), (n * D, D, 1), 0)
    s = torch.bmm(q.view(B * HKV, G, D), kv.transpose(1, 2)).mul_(scale)
    return torch.bmm(torch.softmax(s, -1), vv).view(B, -1, D)


def run(L: int, reps: int) -> dict:
    table, npg, last, P, npre = layout(L)
    kcs = [torch.randn(P, PS, D) for _ in range(LAYERS)]
    vcs = [torch.randn(P, PS, D) for _ in range(LAYERS)]
    qs = [torch.randn(B, HKV * G, D) for _ in range(LAYERS)]
    plan = plan_decode(table, npg, last, PS, G)
    for i in range(2):  # same results as the shipped path
        ref = decode_planned(qs[i], kcs[i], vcs[i], plan, 0.125)
        assert torch.allclose(ref, views_k(qs[i], kcs[i], vcs[i], plan, npre, 0.125), atol=1e-5)
    fs = {"shipped": lambda i: decode_planned(qs[i], kcs[i], vcs[i], plan, 0.125),
          "views_K": lambda i: views_k(qs[i], kcs[i], vcs[i], plan, npre, 0.125),
          "ideal": lambda i: ideal(qs[i], kcs[i], vcs[i], (L // PS) * PS, 0.125)}
    names = list(fs)
    ts = {k: [] for k in names}
    for rep in range(reps):
        for j, k in enumerate(names if rep % 2 == 0 else names[::-1]):
            i = (rep * 3 + j) % LAYERS
            t = time.perf_counter()
            fs[k](i)
            ts[k].append(time.perf_counter() - t)
    return {k: {"median_ms": statistics.median(ts[k]) * 1e3,
                "ratio_to_shipped": statistics.median(b / a for a, b in zip(ts["shipped"], ts[k]))}
            for k in names}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[513, 576, 640])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    res = {"threads": 1, "batch": B, "kv_heads": HKV, "groups": G, "head_dim": D,
           "page_size": PS, "reps": args.reps, "by_length": {}}
    for L in args.lengths:
        res["by_length"][L] = r = run(L, args.reps)
        print(L, "  ".join(f"{k} {v['median_ms']:.3f} ms ({v['ratio_to_shipped']:.3f}x)"
                           for k, v in r.items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
