"""Prefill efficiency and hybrid-step host time (issue 12, items 2 and 5): model FLOPs per
second of chunked prefill as a fraction of the H200's measured bf16 matmul rate (MFU), and the
host share of steps that carry a prefill chunk plus decode rows.

A long prompt is prefilled twice in `--chunk`-token chunks (the first pays one-off warm-ups:
only the second's steps are reported) by the `dense` preset (dummy weights),
optionally while `--decode-rows` short requests decode beside it (a hybrid step: the decode rows
replay their CUDA graph, the chunk runs eagerly — or, with `--cudagraph-modes` including
FULL_AND_PIECEWISE, its layers' attention-free pieces replay piecewise graphs). With
`--presets sparseserve` the prompt is prefilled in layer segments over the two-tier cache
(its MFU column counts only steps that complete tokens: read its host share). Every step is timed with the device
synchronised before and after it; its host time is the runner's CPU time until its one sync
(`RunnerOutput.host_time_s`, read through `LLMEngine.last_step_host_time_s`). `--profile N`
adds each step's N host ops with the most self CPU time and the calls that wait for the device.

Model FLOPs of a chunk of T tokens at positions [s, s + T): 2 x (linear weights a token
multiplies, the LM head only for the sampled row) x T, plus attention 4 x layers x Hq x D x
sum over the chunk's tokens of the keys each attends (p + 1, causal) — the PaLM-style count,
no recompute. MFU = FLOPs / step time / `--peak-tflops` (790: bf16 GEMMs measured on the H200).

    python benchmarks/prefill_mfu.py --out $OUT/prefill_mfu.json --contexts 8192,32768 \\
        --decode-rows 0,8,32
    # hybrid-step host share with and without piecewise graphs, chunks and layer segments
    python benchmarks/prefill_mfu.py --out $OUT/hybrid.json --contexts 2048,8192 \
        --decode-rows 8,32 --presets dense,sparseserve \
        --cudagraph-modes FULL_DECODE_ONLY,FULL_AND_PIECEWISE
    python benchmarks/prefill_mfu.py --out /tmp/mfu.json --smoke     # tiny, CPU
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                os.path.dirname(os.path.abspath(__file__))]

import common as C  # noqa: E402

GiB = 1 << 30


def linear_params(mc) -> int:
    """Weights one token multiplies in a decoder pass (q/k/v/o, gate/up/down; no embedding)."""
    h, inter, d = mc.hidden_size, mc.intermediate_size, mc.head_dim
    attn = h * d * (mc.num_attention_heads * 2 + mc.num_key_value_heads * 2)
    return mc.num_hidden_layers * (attn + 3 * h * inter)


def chunk_flops(mc, start: int, tokens: int, sampled_rows: int) -> float:
    """Model FLOPs of prefilling positions [start, start + tokens) (see the module doc)."""
    keys = tokens * start + tokens * (tokens + 1) / 2  # sum of (p + 1) over the chunk
    attn = 4 * mc.num_hidden_layers * mc.num_attention_heads * mc.head_dim * keys
    head = 2 * mc.hidden_size * mc.vocab_size * sampled_rows
    return 2 * linear_params(mc) * tokens + attn + head


def run_context(model: str, context: int, rows: int, a, device: str, dtype: str,
                preset: str = "dense", mode: str = "FULL_DECODE_ONLY",
                d2h_method: str | None = None) -> dict:
    import numpy as np
    import torch

    from sparseserve import LLM, SamplingParams
    from sparseserve.engine.gc_pauses import GC_PAUSES

    GC_PAUSES.install()

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    extra = {}
    if preset != "dense":
        extra = dict(kv_offloading_size=a.host_gib, token_budget=a.token_budget)
        if d2h_method:
            extra["d2h_method"] = d2h_method
    llm = LLM(model, load_format="dummy", dtype=dtype, device=device, preset=preset,
              max_model_len=context + 64, max_num_seqs=max(rows + 1, 2),
              max_num_batched_tokens=a.chunk + rows, kv_cache_memory_bytes=int(a.kv_gib * GiB),
              cudagraph_mode=mode, **extra)
    eng = llm.engine
    if a.gc_freeze:  # as a serving process does after start-up (engine/gc_pauses.py)
        from sparseserve.engine.gc_pauses import freeze_startup_heap
        freeze_startup_heap()
    mc = eng.config.model
    d2h = eng.config.cache.d2h_method if eng.config.cache.kv_offload else None
    rng = np.random.default_rng(a.seed)
    vocab = mc.vocab_size
    sched = eng.scheduler
    for i in range(rows):  # the decode rows: short prompts that decode for the whole run
        eng.add_request(f"d{i}", {"prompt_token_ids": rng.integers(10, vocab, a.decode_prompt).tolist()},
                        SamplingParams(max_tokens=context + 64, ignore_eos=True))
    while rows and any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.requests.values()):
        eng.step()
    for _ in range(3 if rows else 0):  # decode graphs warm
        eng.step()
    steps, profiles = [], []
    for repeat in range(2):  # the first prompt pays the one-off warm-ups; the second is measured
        rid = f"long{repeat}"
        eng.add_request(rid, {"prompt_token_ids": rng.integers(10, vocab, context).tolist()},
                        SamplingParams(max_tokens=1, ignore_eos=True))
        long_req = sched.requests[rid]
        while long_req.num_computed_tokens < context:
            start = long_req.num_computed_tokens
            sync()
            gc0, gcn0 = GC_PAUSES.total_s, sum(GC_PAUSES.collections)
            t0 = time.perf_counter()
            eng.step()
            sync()
            wall = time.perf_counter() - t0
            done = long_req.num_computed_tokens if rid in sched.requests else context
            tokens = done - start
            flops = chunk_flops(mc, start, tokens, 1 if done >= context else 0)
            steps.append({"prompt": repeat, "start": start, "tokens": tokens,
                          "wall_ms": 1e3 * wall, "host_ms": 1e3 * eng.last_step_host_time_s,
                          # Python's collector inside the step (engine/gc_pauses.py)
                          "gc_ms": 1e3 * (GC_PAUSES.total_s - gc0),
                          "gc_collections": sum(GC_PAUSES.collections) - gcn0,
                          "decode_rows": rows, "tflops": flops / wall / 1e12,
                          "mfu": flops / wall / (a.peak_tflops * 1e12)})
            if rid not in sched.requests:
                break
        if repeat == 0 and a.profile:  # one more prompt between the two, every step profiled
            trace = None
            if a.trace_dir:
                os.makedirs(a.trace_dir, exist_ok=True)
                trace = os.path.join(a.trace_dir,
                                     f"{preset}_{d2h or 'resident'}_{mode}_{context}_{rows}")
            profiles = profile_prompt(eng, rng.integers(10, vocab, context).tolist(), a.profile,
                                      trace)
            # and one under cProfile: the Python functions the host time is spent in (the
            # torch profiler sees ops, not the Python around them)
            python = host_profile_prompt(eng, rng.integers(10, vocab, context).tolist(),
                                         a.profile)
            profiles = [dict(p, python=py) for p, py in zip(profiles, python)]
    eng.shutdown()
    del llm, eng, sched
    # the next engine must not start beside this one's HBM (the H200 run warned: 110.65 GiB
    # held against a 57.29 GiB plan with only torch.cuda.empty_cache() here)
    C.free_device_memory()
    body = [s for s in steps if s["prompt"] == 1]
    wall = sum(s["wall_ms"] for s in body)
    return {"preset": preset, "d2h_method": d2h, "cudagraph_mode": mode, "context": context,
            "decode_rows": rows,
            "chunk": a.chunk, "steps": steps,
            "mean_mfu": sum(s["mfu"] * s["wall_ms"] for s in body) / wall,
            "mean_tflops": sum(s["tflops"] * s["wall_ms"] for s in body) / wall,
            "mean_step_ms": wall / len(body),
            "host_share": sum(s["host_ms"] for s in body) / wall, "profiles": profiles}


def profile_prompt(eng, prompt: list[int], top: int, trace: str | None = None) -> list[dict]:
    """Prefill `prompt` with every step under torch.profiler: per step, the host ops with the
    most self CPU time (what the host share is made of), the calls that wait for the device,
    the kernels with the most device time (`device_ms`: their sum over every stream, so a side
    stream's saves count though they may overlap compute) and the copies by input shape.
    `trace`: a path prefix; each step's Chrome trace is written to `{trace}_step{i}.json`
    (benchmarks/trace_gaps.py reads where the compute idles)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from sparseserve import SamplingParams

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    eng.add_request("profiled", {"prompt_token_ids": prompt},
                    SamplingParams(max_tokens=1, ignore_eos=True))
    out = []
    while "profiled" in eng.scheduler.requests:
        with profile(activities=acts, record_shapes=True) as prof:
            eng.step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        if trace:
            prof.export_chrome_trace(f"{trace}_step{len(out)}.json")
        ev = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        copies = sorted((e for e in prof.key_averages(group_by_input_shape=True)
                         if e.key == "aten::copy_"), key=lambda e: -e.self_device_time_total)
        waits = {e.key: {"count": e.count, "cpu_ms": e.self_cpu_time_total / 1e3}
                 for e in ev if "Synchronize" in e.key or e.key in ("aten::item",
                 "aten::_local_scalar_dense", "cudaMemcpy", "cudaMemcpyAsync")}
        # kernels only: an op's row repeats its kernels' time (aten::mm and its GEMMs)
        dev = sorted((e for e in ev if e.device_type == DeviceType.CUDA),
                     key=lambda e: -e.self_device_time_total)
        out.append({"device_ms": sum(e.self_device_time_total for e in dev) / 1e3,
                    "top_device": [{"op": e.key, "count": e.count,
                                    "self_device_ms": e.self_device_time_total / 1e3}
                                   for e in dev[:top]],
                    "top_copies": [{"shapes": str(e.input_shapes), "count": e.count,
                                    "device_ms": e.self_device_time_total / 1e3}
                                   for e in copies[:top]],
                    "launches": sum(e.count for e in ev if e.key in (
                        "cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                        "cudaLaunchKernelExC")),
                    "graph_launches": sum(e.count for e in ev if e.key == "cudaGraphLaunch"),
                    "waits": waits,
                    "top_self_cpu": [{"op": e.key, "count": e.count,
                                      "self_cpu_ms": e.self_cpu_time_total / 1e3}
                                     for e in ev[:top]]})
    return out


def host_profile_prompt(eng, prompt: list[int], top: int) -> list[dict]:
    """Prefill `prompt` with every step under cProfile -> per step the `top` Python functions
    by own time and by cumulative time (``file:line(name)``, ms, calls), and the step's total
    function calls: where the host share goes below the torch ops (a step of the two-tier
    cache's prefill made ~2.5x dense's Python calls on the CPU, engine.md twenty-first
    session)."""
    import cProfile
    import pstats

    import torch

    from sparseserve import SamplingParams

    eng.add_request("host-profiled", {"prompt_token_ids": prompt},
                    SamplingParams(max_tokens=1, ignore_eos=True))
    out = []
    while "host-profiled" in eng.scheduler.requests:
        prof = cProfile.Profile()
        prof.enable()
        eng.step()
        prof.disable()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        st = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
        rows = [{"fn": f"{os.path.relpath(f) if f.startswith('/') else f}:{ln}({name})",
                 "calls": nc, "own_ms": 1e3 * tt, "cum_ms": 1e3 * ct}
                for (f, ln, name), (cc, nc, tt, ct, _) in st.items()]
        out.append({"calls": sum(r["calls"] for r in rows),
                    "by_own": sorted(rows, key=lambda r: -r["own_ms"])[:top],
                    "by_cum": [r for r in sorted(rows, key=lambda r: -r["cum_ms"])
                               if "sparseserve" in r["fn"]][:top]})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON result path")
    p.add_argument("--model", default=None, help="built-in dummy config (default llama-3-8b)")
    p.add_argument("--contexts", default="8192,32768", help="prompt lengths, comma list")
    p.add_argument("--decode-rows", default="0,8", help="requests decoding beside the chunks")
    p.add_argument("--decode-prompt", type=int, default=512, help="their prompt tokens")
    p.add_argument("--chunk", type=int, default=2048, help="prefill tokens per step")
    p.add_argument("--kv-gib", type=float, default=40)
    p.add_argument("--presets", default="dense", help="comma list (sparseserve: layer segments)")
    p.add_argument("--cudagraph-modes", default="FULL_DECODE_ONLY",
                   help="comma list of FULL_DECODE_ONLY, FULL_AND_PIECEWISE (A/B in one run)")
    p.add_argument("--host-gib", type=float, default=16, help="host tier (two-tier presets)")
    p.add_argument("--d2h-methods", default="",
                   help="comma list of save methods the two-tier presets run with, side by side "
                        "(gpu-direct, copy-engine, ...; empty: the preset's)")
    p.add_argument("--token-budget", type=int, default=2048, help="sparse presets")
    p.add_argument("--peak-tflops", type=float, default=790.0,
                   help="the bf16 matmul rate MFU is relative to (measured on the H200)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", type=int, default=0, metavar="TOP",
                   help="also prefill two more prompts, under torch.profiler and cProfile, and keep "
                        "each step's TOP host ops by self CPU time and TOP Python functions "
                        "(where the host share goes)")
    p.add_argument("--trace-dir", default=None,
                   help="with --profile: write each profiled step's Chrome trace here")
    p.add_argument("--gc-freeze", action="store_true",
                   help="freeze the start-up heap once the engine is built, as `sparseserve "
                        "serve` does (engine/gc_pauses.py); the collector's time per step is "
                        "recorded either way (gc_ms)")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    a = p.parse_args(argv)
    contexts = [int(x) for x in a.contexts.split(",")]
    row_counts = [int(x) for x in a.decode_rows.split(",")]
    if a.smoke:
        a.chunk, a.kv_gib, a.decode_prompt = 128, 0.05, 32
        contexts, row_counts = [300], [0, 2]
    model, _, name = C.resolve_model(argparse.Namespace(model=a.model, smoke=a.smoke),
                                     tempfile.mkdtemp(), max(contexts) + 64)
    import torch
    device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    res = {"meta": C.meta(argv), "model": name, "args": vars(a), "runs": []}
    if a.smoke:
        a.host_gib = 0.05
    for preset in a.presets.split(","):
        saves = [m or None for m in a.d2h_methods.split(",")] if preset != "dense" else [None]
        # graph modes and save methods side by side
        for ctx, rows, mode, d2h in itertools.product(contexts, row_counts,
                                                      a.cudagraph_modes.split(","), saves):
            res["runs"].append(run_context(model, ctx, rows, a, device, dtype, preset, mode, d2h))
            C.write_json(a.out, res)
    print(C.table(["preset", "saves", "graphs", "context", "decode rows", "chunk", "step ms",
                   "TFLOP/s", "MFU", "host share", "gc ms (max step)"],
                  [[r["preset"], r["d2h_method"] or "-", r["cudagraph_mode"], r["context"],
                    r["decode_rows"], r["chunk"],
                    C.fmt(r["mean_step_ms"]),
                    C.fmt(r["mean_tflops"]), f"{100 * r['mean_mfu']:.1f} %",
                    f"{100 * r['host_share']:.1f} %",
                    C.fmt(max((s["gc_ms"] for s in r["steps"] if s["prompt"] == 1),
                              default=0.0))] for r in res["runs"]]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
