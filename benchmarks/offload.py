"""Two-tier KV cache end to end: prefill with write-through saving, decode with offload.

    python benchmarks/offload.py --out DIR [--smoke] [--only prefill,decode]

Llama-3-8B shape, dummy bf16 weights, arkvale sparse attention (token budget 2048, 1 sink + 2
local pages, page size 32), random prompt token ids (fixed seed), greedy.

prefill  One 32768-token prompt, max_tokens=1: wall time from add_request to the first token
         (the prefill), and until the last save has landed in DRAM ("drained"), with the
         two-tier cache saving through FlashD2H ("flash"), per-page copies ("memcpy"), or
         GPU-direct writes ("gpu-direct"), vs the all-resident sparse engine that saves
         nothing ("nosave": kv_offload=False, same sparse settings). Chunked prefill with
         max_num_batched_tokens=16384 (2 chunks; the second gathers its history from DRAM on
         the offload path), then the layer-segmented mode (max_num_batched_tokens=32768,
         max_inject_tokens = 4 layers x the prompt: one chunk, no history) for nosave and flash. One warm-up
         prefill per engine (shorter prompt) before the timed ones; the per-page-copy run is
         stopped between steps after --memcpy-budget-s and extrapolated (recorded as cut).
decode   Batches of B requests: prefill them (chunks of 16384), a few warm-up decode steps,
         then ~20 timed pure-decode steps: ms/step (median), runner host time per step, pages
         loaded per step and the hit rate (get_stats deltas). Device cache ("slots per layer")
         = a fraction of the batch's FULL KV per layer (B x kv_heads x pages of the context;
         1.0 = every page fits), floored at the mandatory selection B x kv_heads x budget pages
         (the least the engine accepts; "min" = that floor). Baselines on the same batch and
         context: the all-resident sparse engine and the dense engine.
         Default batches: 8 x 32k and 32 x 8k. 32 x 32k of Llama-3-8B KV is 128 GiB, more than
         the host's RAM, so batch 32 runs at 8k (or --decode-configs 32x16384: 64 GiB pinned).

Host memory: the engine registers its host tier with CUDA at its exact size (one scratch page
on top, each (request, KV head) in whole chunks of pages); runs that would pin more than the
host allows are skipped and recorded in the JSON ("notes", "pinned_gib").

Writes DIR/offload.json (rewritten after every run, so a run cut short keeps what it measured),
DIR/offload.png, and prints a table last. A wall-clock budget (--time-budget-s) skips runs that
would not finish in it (recorded under "skipped"). `--smoke`: a tiny model on the CPU with tiny
workloads through the same code paths, in well under a minute (used by the tests).

This file holds the arguments and the run order; the parts live beside it: offload_shape.py
(sizes), offload_bench.py (shared run state), offload_engine.py (one engine per run),
offload_prefill.py, offload_decode.py and offload_report.py (JSON summary, plot, table).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

import common as C  # noqa: E402
import engine_bench as E  # noqa: E402
from offload_bench import Bench  # noqa: E402
from offload_decode import decode_run, make_plans  # noqa: E402
from offload_prefill import PREFILL_METHODS, prefill_run  # noqa: E402
from offload_report import DEFINITIONS, finalize, plot, summary_table  # noqa: E402
from offload_shape import GiB, host_pinned_stats, meminfo  # noqa: E402

PARTS = ("prefill", "decode")


def parse_decode_configs(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        b, c = item.split("x")
        out.append((int(b), int(c)))
    return out


def parse_fractions(text: str) -> list:
    out = []
    for f in text.split(","):
        f = f.strip().lower()
        if f:
            out.append("min" if f == "min" else float(f))
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    E.add_run_args(p, "directory for offload.json and offload.png", PARTS)
    p.add_argument("--page-size", type=int, default=None, help="default 32 (8 with --smoke)")
    p.add_argument("--sparse-algorithm", default="arkvale")
    p.add_argument("--token-budget", type=int, default=None, help="default 2048 (32 smoke)")
    p.add_argument("--sink-pages", type=int, default=1)
    p.add_argument("--local-pages", type=int, default=2)
    p.add_argument("--h2d-method", default="flash", choices=["flash", "memcpy"],
                   help="loads in decode (and prefill history)")
    p.add_argument("--d2h-method", default="flash", choices=["flash", "memcpy", "gpu-direct"],
                   help="saving method of the decode runs")
    p.add_argument("--eviction", default="category-lru", choices=["category-lru", "lru"])
    # prefill part
    p.add_argument("--prefill-len", type=int, default=None, help="default 32768 (192 smoke)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="max_num_batched_tokens of the chunked runs (default 16384; 128 smoke)")
    p.add_argument("--prefill-methods", default=",".join(PREFILL_METHODS))
    p.add_argument("--segment-layers", type=int, default=None,
                   help="layers per step of the segmented runs (default 4; 1 smoke; "
                        "0: no segmented runs)")
    p.add_argument("--segmented-methods", default="nosave,flash")
    p.add_argument("--prefill-reps", type=int, default=None,
                   help="timed prefills (default 2; 1 smoke)")
    p.add_argument("--memcpy-reps", type=int, default=1)
    p.add_argument("--memcpy-budget-s", type=float, default=40.0,
                   help="stop a per-page-copy prefill after this and extrapolate")
    # decode part
    p.add_argument("--decode-configs", default=None,
                   help="BATCHxCONTEXT list (default 8x32768,32x8192; 2x128,4x64 smoke)")
    p.add_argument("--cache-fractions", default="0.25,0.5,1.0,min",
                   help="device cache as fractions of the full KV; 'min' = the mandatory "
                        "selection (runs last)")
    p.add_argument("--no-dense", action="store_true", help="skip the dense baseline")
    p.add_argument("--decode-chunk", type=int, default=None,
                   help="max_num_batched_tokens of the decode engines (default 16384; 128 smoke)")
    p.add_argument("--decode-warmup", type=int, default=None, help="default 4 (2 smoke)")
    p.add_argument("--decode-steps", type=int, default=None, help="default 20 (3 smoke)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="decode engines without CUDA graphs (default: the engine's choice)")
    p.add_argument("--no-eager-retry", action="store_true",
                   help="do not retry a failed offload decode run with enforce_eager=True")
    p.add_argument("--gpu-reserve-gib", type=float, default=10.0,
                   help="HBM kept free of the device cache (activations, graphs)")
    p.add_argument("--host-mem-limit-gib", type=float, default=None,
                   help="most pinned host memory at a time (default: min(65%% of RAM, "
                        "available - min(16 GiB, 15%% of RAM)))")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="skip runs that would end after this (default 320; 75 with --smoke)")
    p.add_argument("--reserve-s", type=float, default=None,
                   help="seconds kept for the report (default 12; 3 with --smoke)")
    args = p.parse_args(argv)
    s = args.smoke
    for name, full, smoke in (("page_size", 32, 8), ("token_budget", 2048, 32),
                              ("prefill_len", 32768, 192), ("prefill_chunk", 16384, 128),
                              ("segment_layers", 4, 1), ("prefill_reps", 2, 1),
                              ("decode_configs", "8x32768,32x8192", "2x128,4x64"),
                              ("decode_chunk", 16384, 128), ("decode_warmup", 4, 2),
                              ("decode_steps", 20, 3), ("time_budget_s", 320.0, 75.0),
                              ("reserve_s", 12.0, 3.0)):
        if getattr(args, name) is None:
            setattr(args, name, smoke if s else full)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    deadline = C.Deadline(args.time_budget_s)
    parts = E.parse_parts(args.only, PARTS)
    methods = E.split_list(args.prefill_methods)
    seg_methods = E.split_list(args.segmented_methods) if args.segment_layers else []
    for m in methods + seg_methods:
        if m not in PREFILL_METHODS:
            raise SystemExit(f"unknown prefill method {m!r}; choose from {PREFILL_METHODS}")
    import torch

    device, dtype = E.device_and_dtype(args)
    if args.smoke and device == "cpu":
        torch.set_num_threads(1)  # tiny ops: threads only add barrier stalls on a busy host
    os.makedirs(args.out, exist_ok=True)
    out_path = os.path.join(args.out, "offload.json")
    with tempfile.TemporaryDirectory(prefix="sparseserve-offload-",
                                     ignore_cleanup_errors=True) as tmpdir:
        model, cfg, model_name = C.resolve_model(args, tmpdir, 4096)
        decode_cfgs = parse_decode_configs(args.decode_configs)
        fractions = parse_fractions(args.cache_fractions)
        settings = {k: v for k, v in vars(args).items() if k != "out"}
        settings.update(model=model_name, model_config=cfg, device=device, dtype=dtype,
                        parts=parts, prefill_methods=methods, segmented_methods=seg_methods)
        result = {
            "benchmark": "offload", "schema_version": 1, **C.meta(argv),
            "settings": settings,
            "definitions": dict(DEFINITIONS),
            "notes": [],
            "host": {**{k: v / GiB for k, v in meminfo().items()}},
            "prefill": {"runs": {}},
            "decode": {"configs": {}},
            "errors": [], "skipped": [], "complete": False,
        }
        b = Bench(args, model, cfg, device, dtype, deadline, result, out_path)
        result["host"]["pinned_limit_gib"] = b.host_limit / GiB
        result["shape"] = b.shape.describe()
        plans = make_plans(b, decode_cfgs) if "decode" in parts else []
        if "prefill" in parts:
            result["prefill"]["prompt_len"] = args.prefill_len
        b.save()
        E.log(deadline, f"{model_name} on {device} ({result['gpu_name'] or 'no GPU'}), parts "
                        f"{parts}, budget {args.time_budget_s:.0f} s, pinned limit "
                        f"{b.host_limit / GiB:.1f} GiB, writing {out_path}")

        # run order = priority: the time budget skips what comes last
        schedule = []
        if "prefill" in parts:
            schedule += [("prefill", "chunked", m) for m in methods]
        fr_main = [f for f in fractions if f != "min"]
        for plan in plans:
            schedule.append(("decode", plan, ("resident-sparse", None)))
            schedule += [("decode", plan, ("offload", f)) for f in fr_main]
            if not args.no_dense:
                schedule.append(("decode", plan, ("dense", None)))
        if "prefill" in parts:
            schedule += [("prefill", "segmented", m) for m in seg_methods]
        if "min" in fractions:
            schedule += [("decode", plan, ("offload", "min")) for plan in plans]
        result["settings"]["run_order"] = [
            f"{w}/{x}/{y}" if w == "prefill" else f"{w}/{x['key']}/{y[0]}"
            + (f"-{y[1]}" if y[1] is not None else "") for w, x, y in schedule]
        for what, x, y in schedule:  # each run checks the time budget itself
            try:
                if what == "prefill":
                    prefill_run(b, x, y)
                else:
                    decode_run(b, x, *y)
            except Exception as exc:  # noqa: BLE001 - never lose the other runs
                b.fail(f"{what}/{x if what == 'prefill' else x['key']}/{y}", exc)
                C.free_device_memory()
        C.empty_host_cache()
        result["host_pinned_final"] = host_pinned_stats()
        finalize(result)
        try:
            result["plot"] = plot(result, os.path.join(args.out, "offload.png"))
        except Exception as exc:  # noqa: BLE001
            b.fail("plot", exc)
        E.finish(deadline, result, b.save, out_path, summary_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
