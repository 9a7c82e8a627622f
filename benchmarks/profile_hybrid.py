"""Where a hybrid step's time goes (a prefill chunk or layer segment plus decode rows):
torch.profiler over the steps that prefill one long prompt while a batch decodes, per preset
(dummy weights of --model's shape). Reports wall ms per step against device (kernel) ms per step —
host-bound when wall >> device — and the top kernels and top CPU ops. A diagnostic for the
end-to-end results (docs/results/system.md).

    python benchmarks/profile_hybrid.py --out $OUT/hybrid.json --configs dense,sparseserve
    python benchmarks/profile_hybrid.py --out $OUT/hybrid_lwm.json --model lwm-7b \
        --configs dense,sparseserve --batch 4 --context 4000 --prompt 16000 --host-gib 48
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
CONFIGS = {"dense": dict(preset="dense"), "sparseserve": dict(preset="sparseserve"),
           "sparseserve-chunked": dict(preset="sparseserve", layer_segmented_prefill=False)}


def profile(name: str, a) -> dict:
    """name: a CONFIGS key, optionally "@N": side-stream GPU-direct saves capped at N programs
    for this config only (gpu_direct.SIDE_STREAM_MAX_PROGRAMS; "@none": uncapped)."""
    from sparseserve.transfer import gpu_direct

    name, _, cap = name.partition("@")
    default = gpu_direct.SIDE_STREAM_MAX_PROGRAMS
    if cap:
        gpu_direct.SIDE_STREAM_MAX_PROGRAMS = None if cap == "none" else int(cap)
    try:
        return _profile(name, a)
    finally:
        gpu_direct.SIDE_STREAM_MAX_PROGRAMS = default


def _profile(name: str, a) -> dict:
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from sparseserve import LLM, SamplingParams

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    kw = dict(load_format="dummy", dtype="bfloat16" if cuda else "float32",
              max_model_len=a.prompt + 512, max_num_seqs=64,
              max_num_batched_tokens=a.chunk, token_budget=a.token_budget,
              kv_cache_memory_bytes=a.kv_gib * GiB, **CONFIGS[name])
    if name != "dense":
        kw["kv_offloading_size"] = a.host_gib
    else:
        kw.pop("token_budget")
    llm = LLM(a.model, **kw)
    eng = llm.engine
    rng = np.random.default_rng(0)
    ids = lambda n: {"prompt_token_ids": rng.integers(10, eng.config.model.vocab_size, n).tolist()}  # noqa: E731
    for i in range(a.batch):
        eng.add_request(f"d{i}", ids(a.context), SamplingParams(max_tokens=400, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()):
        eng.step()
    for _ in range(5):
        eng.step()
    # one warm-up prompt through the hybrid path, then the profiled one
    for tag in ("warm", "long"):
        eng.add_request(tag, ids(a.prompt), SamplingParams(max_tokens=2, ignore_eos=True))
        walls = []
        prof = None
        ctx = torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) \
            if tag == "long" else None
        if ctx is not None:
            prof = ctx.__enter__()
        while eng.scheduler.requests.get(tag) is not None and \
                eng.scheduler.requests[tag].num_computed_tokens < a.prompt:
            sync()
            t = time.perf_counter()
            eng.step()
            sync()
            walls.append(time.perf_counter() - t)
        if ctx is not None:
            ctx.__exit__(None, None, None)
    n = len(walls)
    kernels, cpu = [], []
    for e in prof.key_averages():
        dev_t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if dev_t:
            kernels.append({"name": e.key[:80], "calls": e.count, "ms_per_step": dev_t / n / 1e3})
        if e.self_cpu_time_total:
            cpu.append({"name": e.key[:80], "calls": e.count,
                        "ms_per_step": e.self_cpu_time_total / n / 1e3})
    kernels.sort(key=lambda r: -r["ms_per_step"])
    cpu.sort(key=lambda r: -r["ms_per_step"])
    eng.shutdown()  # the two-tier cache's transfer threads (and any TP ranks) stop
    del llm, eng
    torch.cuda.empty_cache()
    return {"steps": n, "wall_ms_per_step": 1e3 * sum(walls) / n,
            "device_ms_per_step": sum(k["ms_per_step"] for k in kernels),
            "top_kernels": kernels[:25], "top_cpu_ops": cpu[:25]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--configs", default="dense,sparseserve,sparseserve-chunked")
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--context", type=int, default=6000)
    p.add_argument("--prompt", type=int, default=12000)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--token-budget", type=int, default=2048)
    p.add_argument("--kv-gib", type=float, default=20)
    p.add_argument("--host-gib", type=float, default=24)
    p.add_argument("--model", default="llama-3-8b",
                   help="a dummy-weight shape (llama-3-8b, lwm-7b, ...)")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    a = p.parse_args()
    if a.smoke:
        import tempfile

        import common as C
        a.model, _, _ = C.resolve_model(argparse.Namespace(model=None, smoke=True),
                                        tempfile.mkdtemp(), 8192)
        a.batch, a.context, a.prompt, a.chunk, a.token_budget = 3, 300, 500, 128, 128
        a.kv_gib, a.host_gib = 0.01, 0.02
    res = {}
    for name in a.configs.split(","):
        res[name] = profile(name, a)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    for name, r in res.items():
        print(f"\n== {name}: {r['steps']} steps, wall {r['wall_ms_per_step']:.1f} ms/step, "
              f"device {r['device_ms_per_step']:.1f} ms/step")
        for k in r["top_kernels"][:8]:
            print(f"   gpu {k['ms_per_step']:7.2f} ms  x{k['calls']:<6} {k['name']}")
        for k in r["top_cpu_ops"][:8]:
            print(f"   cpu {k['ms_per_step']:7.2f} ms  x{k['calls']:<6} {k['name']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
