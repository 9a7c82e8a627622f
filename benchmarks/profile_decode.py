"""Where a decode step's device time goes: torch.profiler over a few pure-decode steps of the
resident sparse engine and of the two-tier engine (dummy Llama-3-8B weights), top kernels
by CUDA time, side by side. A diagnostic for docs/results/transfer.md §3.

    python benchmarks/profile_decode.py --out $OUT/profile --batch 8 --context 8192
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

GiB = 1 << 30


def profile(kind: str, a) -> list[dict]:
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from sparseserve import LLM, SamplingParams

    hkv, layers, d, ps = 8, 32, 128, 32
    page_bytes = 2 * layers * ps * d * 2
    pages = a.batch * hkv * (-(-a.context // ps) // 16 + 1) * 16
    kw = dict(load_format="dummy", dtype="bfloat16", max_model_len=a.context,
              max_num_seqs=a.batch, max_num_batched_tokens=8192, sparse_algorithm="arkvale",
              token_budget=2048, kv_cache_memory_bytes=(pages + 64) * page_bytes)
    if kind == "offload":
        kw.update(kv_offload=True, kv_offloading_size=(pages + 1) * page_bytes / GiB)
    llm = LLM("llama-3-8b", **kw)
    eng = llm.engine
    rng = np.random.default_rng(0)
    prompt = a.context - a.warmup - a.steps - 64
    for i in range(a.batch):
        eng.add_request(str(i), {"prompt_token_ids": rng.integers(10, 30000, prompt).tolist()},
                        SamplingParams(max_tokens=a.warmup + a.steps + 8, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()):
        eng.step()
    for _ in range(a.warmup):
        eng.step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            eng.step()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t:
            rows.append({"name": e.key[:90], "calls": e.count, "us_per_step": t / a.steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    if kind == "offload":
        eng.runner.offload.close()
    del llm, eng
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--warmup", type=int, default=24)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=18)
    a = p.parse_args(argv)
    res = {k: profile(k, a) for k in ("resident", "offload")}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "profile_decode.json"), "w") as f:
        json.dump({"command": "python " + " ".join(sys.argv), **vars(a), **res}, f, indent=1)
    for k, rows in res.items():
        total = sum(r["us_per_step"] for r in rows)
        print(f"\n{k}: {total / 1e3:.2f} ms device time per step (kernels summed)")
        for r in rows[:a.top]:
            print(f"{r['us_per_step']:9.1f} us {r['calls'] // a.steps:5d}/step  {r['name']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
