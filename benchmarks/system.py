"""End to end: presets side by side on one offline trace through LLMEngine (the end-to-end
issue's measurement; `sparseserve bench serve` measures the same through the server).

Traces (greedy, ignore_eos; every request arrives at t=0 unless --request-rate is given):
  mix40   40 requests, prompts log-uniform in [2k, 24k] tokens, outputs uniform in [32, 512]
  long32  32 requests, prompts uniform in [8k, 16k], 512 output tokens
  light8  the HTTP light-load run's requests (`benchmarks/serving_http.py --num-prompts 8
          --max-input-len 4096 --max-model-len 5120`: LongBench-shaped, seed --seed); with
          --request-rate 2 the same Poisson send times, so its per-step records say where that
          run's TTFT and TBT go
Configurations: the presets (dense, sparse, sparse-offload, sparseserve) and ablations of the
full system (sparseserve-chunked: no layer-segmented prefill; sparseserve-no-wc: no
working-set control; sparseserve-flashd2h: prefill saves by FlashD2H's CPU scatter instead of
the preset's GPU-direct writes; sparseserve-copyengine: by the copy engine; dense-async,
sparseserve-async: with async scheduling; *-piecewise: with piecewise CUDA graphs for steps
with prefill work, `--cudagraph-mode FULL_AND_PIECEWISE`; dense-full, dense-async-full: whole
steps with prefill work as CUDA graphs, `--cudagraph-mode FULL`; sparseserve-full: the same
for the full system, layer by layer; the presets take the engine's default, FULL where it
captures something, so *-decode-only runs their steps with prefill work eagerly). The device KV
budget is the same for all (default 20 GiB, an A100-40GB-like budget); the host tier is sized
for the trace. Ratios are to `dense` in the same run.

  python benchmarks/system.py --out system.json --trace mix40 --configs dense,sparseserve
  python benchmarks/system.py --out /tmp/s.json --smoke        # tiny model on the CPU
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as C  # noqa: E402
import engine_bench as E  # noqa: E402
import numpy as np  # noqa: E402
from system_run import run_trace, step_range  # noqa: E402

GiB = 1 << 30
CONFIGS = {
    "dense": dict(preset="dense"),
    "sparse": dict(preset="sparse"),
    "sparse-offload": dict(preset="sparse-offload"),
    "sparseserve": dict(preset="sparseserve"),
    "sparseserve-chunked": dict(preset="sparseserve", layer_segmented_prefill=False),
    "sparseserve-no-wc": dict(preset="sparseserve", working_set_control=False),
    # prefill saves by FlashD2H (SparseServe's design: staging + CPU scatter threads) instead of
    # the preset's GPU-direct writes from a side stream
    "sparseserve-flashd2h": dict(preset="sparseserve", d2h_method="flash"),
    # prefill saves by the copy engine (DMA per run of host rows, no SMs) instead of GPU-direct
    "sparseserve-copyengine": dict(preset="sparseserve", d2h_method="copy-engine"),
    # the next step scheduled and launched while the current one runs (async scheduling)
    "dense-async": dict(preset="dense", async_scheduling=True),
    "sparseserve-async": dict(preset="sparseserve", async_scheduling=True),
    # steps with prefill work run their layers' attention-free pieces as CUDA graphs
    "dense-piecewise": dict(preset="dense", cudagraph_mode="FULL_AND_PIECEWISE"),
    "sparseserve-piecewise": dict(preset="sparseserve", cudagraph_mode="FULL_AND_PIECEWISE"),
    "dense-async-piecewise": dict(preset="dense", async_scheduling=True,
                                  cudagraph_mode="FULL_AND_PIECEWISE"),
    "sparseserve-async-piecewise": dict(preset="sparseserve", async_scheduling=True,
                                        cudagraph_mode="FULL_AND_PIECEWISE"),
    # steps with prefill work as whole CUDA graphs (dense attention only)
    "dense-full": dict(preset="dense", cudagraph_mode="FULL"),
    "dense-async-full": dict(preset="dense", async_scheduling=True, cudagraph_mode="FULL"),
    # the full system's steps with prefill work (chunks and layer segments up to the largest
    # token bucket) as CUDA graphs of each layer's two-tier work (worker/two_tier_graphs.py)
    "sparseserve-full": dict(preset="sparseserve", cudagraph_mode="FULL"),
    # steps with prefill work eager (the default before FULL became it, twenty-ninth session;
    # the presets above take the engine's default: FULL where it captures something)
    "dense-decode-only": dict(preset="dense", cudagraph_mode="FULL_DECODE_ONLY"),
    "sparseserve-decode-only": dict(preset="sparseserve", cudagraph_mode="FULL_DECODE_ONLY"),
}
TRACES = ("mix40", "long32", "light8")


def make_trace(name: str, vocab: int, seed: int, scale: float = 1.0) -> list[dict]:
    """Prompt lengths and output limits of a trace (`scale` shrinks lengths for smoke runs)."""
    rng = np.random.default_rng(seed)
    if name == "light8":
        from sparseserve.bench.serve_datasets import build_requests
        # a smoke run (scale < 1) shrinks prompts and fixes outputs at 16 tokens
        small = dict(longbench_output_len=16) if scale < 1 else {}
        cap = max(16, int(4096 * scale))
        reqs = build_requests("longbench", 8, seed, vocab_size=vocab, token_ids=True,
                              max_input_len=cap, max_model_len=cap + 16 if small else 5120,
                              **small)
        return [{"prompt_token_ids": r.prompt_token_ids, "max_tokens": r.output_len}
                for r in reqs]
    if name == "mix40":
        n = 40
        plen = np.exp(rng.uniform(np.log(2048), np.log(24576), n))
        olen = rng.integers(32, 513, n)
    elif name == "long32":
        n = 32
        plen = rng.uniform(8192, 16384, n)
        olen = np.full(n, 512)
    else:
        raise SystemExit(f"--trace: unknown trace {name!r}; choose from {TRACES}")
    plen = np.maximum(1, (plen * scale).astype(int))
    olen = np.maximum(2, (olen * min(1.0, scale * 8)).astype(int))
    return [{"prompt_token_ids": rng.integers(0, vocab, int(p)).tolist(), "max_tokens": int(o)}
            for p, o in zip(plen, olen)]


def engine_kwargs(args, cfg: dict, trace: list[dict], device: str, dtype: str,
                  name: str) -> dict:
    from sparseserve.engine.presets import PRESETS

    longest = max(len(t["prompt_token_ids"]) + t["max_tokens"] for t in trace)
    kw = dict(load_format="dummy", dtype=dtype, device=device, seed=args.seed,
              max_model_len=-(-(longest + 1) // 512) * 512, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes, **CONFIGS[name])
    if args.enforce_eager:
        kw["enforce_eager"] = True
    if PRESETS[kw["preset"]]["kv_offload"]:
        # every page of the trace in DRAM: tokens rounded up to whole host chunks (512 tokens)
        tokens = sum(-(-(len(t["prompt_token_ids"]) + t["max_tokens"]) // 512) * 512
                     for t in trace)
        kv_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * \
            cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]) * \
            (2 if dtype != "float32" else 4)
        kw["kv_offloading_size"] = tokens * kv_per_token * 1.02 / GiB
        kw["token_budget"] = args.token_budget
    elif kw["preset"] == "sparse":
        kw["token_budget"] = args.token_budget
    return kw


def warmup(engine, vocab: int, scale: float) -> None:
    """Two requests with chunked prompts and a few decode steps: Triton compilation, SDPA and
    cuBLAS heuristics, the allocator and the host tier settle before timing."""
    from sparseserve import SamplingParams

    rng = np.random.default_rng(1)
    for i, n in enumerate((int(3000 * scale) + 1, int(5000 * scale) + 1)):
        engine.add_request(f"warm{i}", {"prompt_token_ids": rng.integers(0, vocab, n).tolist()},
                           SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def run_config(name: str, model: str, cfg: dict, args, trace, device, dtype, deadline,
               result, save) -> None:
    from sparseserve import LLM

    kw = engine_kwargs(args, cfg, trace, device, dtype, name)
    rec: dict = {"engine_args": kw}
    result["runs"][name] = rec
    E.log(deadline, f"{name}: loading ({kw})")
    llm = eng = None
    try:
        t = time.perf_counter()
        llm = LLM(model, **kw)
        rec["load_s"] = time.perf_counter() - t
        eng = llm.engine
        rec["num_slots_or_pages_per_layer"] = eng.config.cache.num_pages
        rec["cuda_graphs"] = eng.executor.graph_info()["batch_sizes"]
        warmup(eng, cfg["vocab_size"], args.scale)
        stop_at = time.perf_counter() + max(5.0, min(args.run_budget_s, deadline.remaining() - 30))
        C.free_device_memory()  # an engine of the previous configuration is gone by now
        rec["memory_before_run"] = C.free_device_memory()
        with C.peak_memory(rec):
            rec.update(run_trace(eng, trace, device, stop_at, args.profile_steps))
        E.log(deadline, f"  {name}: {rec['wall_s']:.1f}s, {rec['output_tokens_per_s']:.0f} out "
                        f"tok/s, TTFT {rec['ttft_s']['mean']:.2f}s, "
                        f"{rec['pages_loaded_per_decode_step']:.0f} pages loaded/decode step, "
                        f"{rec['num_preemptions']} preemptions")
    except Exception as exc:  # noqa: BLE001 - record and go on with the next configuration
        E.fail(deadline, result, name, exc)
        rec.update(C.error_record(exc))
    finally:
        if llm is not None:
            try:
                llm.engine.shutdown()  # closes the two-tier cache (and stops any TP ranks)
            except Exception as exc:  # noqa: BLE001 - the run's own error is what matters
                rec.setdefault("close_error", f"{type(exc).__name__}: {exc}"[:500])
        save()  # before anything else can fail (a sticky CUDA error aborts the process)
        # drop every reference before collecting: the engine's graphs and runner form cycles,
        # and a live `eng` kept the previous engine's ~36 GB allocated into the next run's peak
        eng = llm = None
        C.free_device_memory()
        C.empty_host_cache()
        save()


def ratios(result: dict) -> None:
    base = result["runs"].get("dense")
    if not base or "wall_s" not in base:
        return
    for rec in result["runs"].values():
        if "wall_s" not in rec:
            continue
        rec["vs_dense"] = {
            "wall": rec["wall_s"] / base["wall_s"],
            "output_throughput": rec["output_tokens_per_s"] / base["output_tokens_per_s"],
            "mean_ttft_reduction": base["ttft_s"]["mean"] / max(rec["ttft_s"]["mean"], 1e-9),
            "prefill_tokens_per_s": (
                (rec["prefill_tokens_per_s_in_prefill_steps"] or 0)
                / (base["prefill_tokens_per_s_in_prefill_steps"] or 1)),
        }


def table(result: dict) -> str:
    rows = []
    for name, r in result["runs"].items():
        if "wall_s" not in r:
            rows.append([name, "error: " + r.get("error", "?")[:60]] + [""] * 11)
            continue
        v = r.get("vs_dense", {})
        rows.append([name, C.fmt(r["wall_s"]), C.fmt(v.get("wall"), 2), C.fmt(r["output_tokens_per_s"], 0),
                     C.fmt(r["ttft_s"]["mean"], 2), C.fmt(r["tbt_ms"]["mean"], 1),
                     C.fmt(r["p99_tbt_ms"], 0),
                     C.fmt(r["prefill_tokens_per_s_in_prefill_steps"], 0),
                     C.fmt(r["pure_decode_ms_per_step"], 1), C.fmt(r["pure_decode_mean_batch"], 1),
                     C.fmt(r["pages_loaded_per_decode_step"], 0), r["num_preemptions"],
                     C.fmt(r["recomputed_tokens"], 0)])
    head = ["config", "wall s", "x dense", "out tok/s", "TTFT s", "TBT ms", "p99 TBT ms", "prefill tok/s",
            "decode ms", "batch", "loaded/step", "preempt", "recomputed"]
    out = C.table(head, rows)
    if result["errors"]:
        out += "\n" + E.errors_line(result["errors"])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    E.add_run_args(p, "JSON result path", list(CONFIGS))
    p.add_argument("--trace", default="mix40", choices=TRACES)
    p.add_argument("--configs", default=None, help="alias of --only")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=20 * GiB)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--token-budget", type=int, default=2048)
    p.add_argument("--num-requests", type=int, default=None,
                   help="only the first N requests of the trace")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrivals at this rate (requests/s; the first at t=0, send times as "
                        "`sparseserve bench serve --seed`); inf = every request at t=0")
    p.add_argument("--time-budget-s", type=float, default=560)
    p.add_argument("--run-budget-s", type=float, default=200, help="cap of one configuration's run")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs (debugging: a device fault then names its kernel)")
    p.add_argument("--profile-steps", type=step_range, default=[], metavar="A:B[,C:D]",
                   help="run steps A..B-1 of each configuration under torch.profiler and record "
                        "their kernel time, top kernels / CPU ops and blocking CUDA calls "
                        "(diagnosis: those steps run slower)")
    args = p.parse_args(argv)
    names = E.parse_parts(args.configs or args.only, list(CONFIGS))
    device, dtype = E.device_and_dtype(args)
    args.scale = 1.0
    if args.smoke:
        # a 2-layer model, lengths /40, a device budget that holds ~3 of the 40 prompts
        args.scale = 1 / 40
        args.kv_cache_memory_bytes = min(args.kv_cache_memory_bytes, 3 * 2**20)
        args.max_num_batched_tokens = min(args.max_num_batched_tokens, 64)
        args.token_budget = min(args.token_budget, 128)
    deadline = C.Deadline(args.time_budget_s)
    result = {"meta": C.meta(argv), "settings": {**vars(args), "device": device, "dtype": dtype},
              "runs": {}, "errors": []}

    def save():
        ratios(result)
        C.write_json(args.out, result)

    with tempfile.TemporaryDirectory() as tmp:
        model, cfg, label = C.resolve_model(args, tmp, 131072)
        result["settings"]["model_label"] = label
        trace = make_trace(args.trace, cfg["vocab_size"], args.seed, args.scale)
        trace = trace[:args.num_requests] if args.num_requests else trace
        from sparseserve.bench.serve_runner import arrival_offsets
        for t, at in zip(trace, arrival_offsets(len(trace), args.request_rate, seed=args.seed)):
            t["arrival_s"] = float(at)
        result["trace"] = {"name": args.trace, "prompt_lens": [len(t["prompt_token_ids"]) for t in trace],
                           "max_tokens": [t["max_tokens"] for t in trace]}
        for name in names:
            if deadline.expired(45):
                E.log(deadline, f"{name}: skipped (time budget)")
                break
            run_config(name, model, cfg, args, trace, device, dtype, deadline, result, save)
    E.finish(deadline, result, save, args.out, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
