"""Where a pure-decode step's device time goes, per preset: wall ms per step (timed, the device
synchronised per step), then torch.profiler over a few more steps — device ms per step, kernel
launches per step and the top kernels. Dummy Llama-3-8B weights, a fixed device KV budget
(as in benchmarks/system.py), `batch` requests decoding at `context` tokens.

A diagnostic for the end-to-end results (docs/results/system.md): the offloaded sparse step
against the resident sparse one and dense at the same batch.

    python benchmarks/profile_decode.py --out $OUT/profile_decode.json \
        --configs dense,sparse,sparseserve --batch 14 --context 10000
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                os.path.dirname(os.path.abspath(__file__))]

GiB = 1 << 30
CONFIGS = {"dense": dict(preset="dense"), "sparse": dict(preset="sparse"),
           "sparse-offload": dict(preset="sparse-offload"),
           "sparseserve": dict(preset="sparseserve")}


def profile(name: str, a) -> dict:
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from sparseserve import LLM, SamplingParams

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    kw = dict(load_format="dummy", dtype="bfloat16" if cuda else "float32",
              max_model_len=a.context + 64, max_num_seqs=max(a.batch, 16),
              max_num_batched_tokens=a.chunk, kv_cache_memory_bytes=int(a.kv_gib * GiB),
              **CONFIGS[name])
    if name != "dense":
        kw["token_budget"] = a.token_budget
    if "offload" in name or name == "sparseserve":
        kw["kv_offloading_size"] = a.host_gib
    llm = LLM(a.model, **kw)
    eng = llm.engine
    rng = np.random.default_rng(0)
    prompt = a.context - a.warmup - a.timed - a.steps - 16
    vocab = eng.config.model.vocab_size
    for i in range(a.batch):
        eng.add_request(str(i), {"prompt_token_ids": rng.integers(10, vocab, prompt).tolist()},
                        SamplingParams(max_tokens=a.context, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens
              for r in eng.scheduler.requests.values()):
        eng.step()
    for _ in range(a.warmup):
        eng.step()
    walls = []
    for _ in range(a.timed):
        sync()
        t = time.perf_counter()
        eng.step()
        sync()
        walls.append(time.perf_counter() - t)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=acts) as prof:
        for _ in range(a.steps):
            eng.step()
        sync()
    kernels = []
    for e in prof.key_averages():
        dev_t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        # kernels only: the aten:: rows would count the same device time twice
        if dev_t and not e.key.startswith(("aten::", "cuda", "Memcpy", "Memset")):
            kernels.append({"name": e.key[:90], "calls_per_step": e.count / a.steps,
                            "us_per_step": dev_t / a.steps})
    kernels.sort(key=lambda r: -r["us_per_step"])
    stats = eng.get_stats()
    running = stats["num_running"]
    roof = decode_roofline(eng.executor.runner, running, a.context, a.hbm_gbps)
    eng.shutdown()  # the two-tier cache's transfer threads (and any TP ranks) stop
    del llm, eng
    if cuda:
        torch.cuda.empty_cache()
    walls.sort()
    wall_ms = 1e3 * walls[len(walls) // 2]
    return {"batch": running, "context": a.context,
            **roof, "x_roofline": wall_ms / roof["roofline_ms"],
            "wall_ms_median": wall_ms,
            "wall_ms_mean": 1e3 * sum(walls) / len(walls),
            "device_ms_per_step": sum(k["us_per_step"] for k in kernels) / 1e3,
            "kernels_per_step": sum(k["calls_per_step"] for k in kernels),
            "top_kernels": kernels[:a.top]}


def decode_roofline(runner, batch: int, context: int, hbm_gbps: float) -> dict:
    """The dense decode step's memory floor: every weight a decode step reads (all but the
    input embedding table, unless it doubles as the LM head) plus the KV of `batch` requests at
    `context` tokens, over the measured HBM bandwidth (issue 12's roofline: the H200's device
    copy, 3.4 TB/s, docs/results/transfer.md)."""
    model = runner.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:  # decode reads `batch` rows of the embedding table, not all
        emb = model.model.embed_tokens.weight
        weights -= emb.numel() * emb.element_size()
    mc = runner.cfg.model
    kv_per_token = (2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim
                    * runner.kv.k[0].element_size())
    kv = batch * context * kv_per_token
    return {"weight_bytes": weights, "kv_bytes": kv,
            "roofline_ms": (weights + kv) / (hbm_gbps * 1e9) * 1e3}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON result path")
    p.add_argument("--configs", default="dense,sparse,sparseserve")
    p.add_argument("--batch", type=int, default=14)
    p.add_argument("--context", type=int, default=10000)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--token-budget", type=int, default=2048)
    p.add_argument("--kv-gib", type=float, default=20)
    p.add_argument("--host-gib", type=float, default=24)
    p.add_argument("--warmup", type=int, default=16)
    p.add_argument("--timed", type=int, default=20)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--model", default="llama-3-8b",
                   help="a dummy-weight shape (llama-3-8b, lwm-7b, ...)")
    p.add_argument("--hbm-gbps", type=float, default=3400.0,
                   help="HBM bandwidth of the roofline (the H200's measured device copy)")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    a = p.parse_args(argv)
    if a.smoke:
        import tempfile

        import common as C
        a.model, _, _ = C.resolve_model(argparse.Namespace(model=None, smoke=True),
                                        tempfile.mkdtemp(), 8192)
        a.batch, a.context, a.chunk, a.token_budget = 3, 300, 128, 128
        a.kv_gib, a.host_gib, a.warmup, a.timed, a.steps = 0.01, 0.02, 2, 3, 2
    res = {"command": "python " + " ".join(sys.argv), "args": vars(a)}
    for name in a.configs.split(","):
        res[name] = profile(name, a)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    for name in a.configs.split(","):
        r = res[name]
        print(f"\n== {name}: batch {r['batch']} @ {r['context']}: wall {r['wall_ms_median']:.2f} ms"
              f" (median), device {r['device_ms_per_step']:.2f} ms, "
              f"{r['kernels_per_step']:.0f} kernels/step, roofline {r['roofline_ms']:.2f} ms "
              f"({r['x_roofline']:.2f}x)")
        for k in r["top_kernels"][:14]:
            print(f"  {k['us_per_step']:8.1f} us x{k['calls_per_step']:<6.0f} {k['name']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
