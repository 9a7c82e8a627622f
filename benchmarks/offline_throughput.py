"""Offline throughput of the dense engine vs Hugging Face transformers, and decode step time.

    python benchmarks/offline_throughput.py --out DIR [--smoke] [--only a,b,steps] [--skip-hf]

Llama-3-8B shape, dummy bf16 weights, dense attention, random prompt token ids (fixed seed),
greedy, ignore_eos (every request generates exactly its output length):
  a      64 requests x 4096-token prompts / 256 output tokens
  b       8 requests x 32768-token prompts / 128 output tokens
  steps  decode ms/step at batch 1, 8, 32 (context 4096): prefill the batch, then time steps
         in which every request decodes; host (Python) time per step from the engine's
         `last_step_host_time_s` (runner: prepare + launch) and the engine's own overhead
         (schedule + update + outputs = step wall time - runner.execute wall time); with the
         engine's defaults (CUDA graphs when the runner has them) and with enforce_eager=True.
For a and b, in the same run: transformers `generate` (SDPA, static cache, greedy,
min_new_tokens = max_new_tokens) on the same prompts, and the ratio sparseserve / HF.

Writes DIR/offline_throughput.json (rewritten after every part, so a run cut short still
leaves what it measured) and prints a table last. `--smoke`: a tiny 2-layer model on the CPU
with tiny workloads, exercising every path in well under a minute (used by the tests).

This file holds the arguments and the order of the parts; the rest lives beside it:
offline_workloads.py (workloads, targets, engine sizes), offline_engine.py (sparseserve runs),
offline_decode_steps.py, offline_hf.py (the transformers baseline) and offline_report.py.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import asdict

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

import common as C  # noqa: E402
import engine_bench as E  # noqa: E402
from offline_engine import sparseserve_part  # noqa: E402
from offline_hf import hf_part  # noqa: E402
from offline_report import finalize, summary_table  # noqa: E402
from offline_workloads import TARGET_HOST_FRAC, TARGET_RATIO_A, workloads  # noqa: E402

PARTS = ("a", "b", "steps")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    E.add_run_args(p, "directory for offline_throughput.json", PARTS)
    p.add_argument("--skip-hf", action="store_true", help="no transformers comparison")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="sparseserve step token budget (default 16384; 128 with --smoke)")
    p.add_argument("--decode-batches", default=None, help="default 1,8,32 (1,2,4 with --smoke)")
    p.add_argument("--decode-context", type=int, default=None, help="default 4096 (48 smoke)")
    p.add_argument("--decode-steps", type=int, default=None, help="timed steps (default 40)")
    p.add_argument("--no-eager", action="store_true", help="skip the enforce_eager decode run")
    p.add_argument("--hf-batch", type=int, default=None, help="HF batch (default: all requests)")
    p.add_argument("--hf-compile", action="store_true",
                   help="let transformers torch.compile decode (timed on a second run)")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="stop starting new work after this (default 480; 300 with --smoke)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    deadline = C.Deadline(args.time_budget_s or (300.0 if args.smoke else 480.0))
    parts = E.parse_parts(args.only, PARTS)
    device, dtype = E.device_and_dtype(args)
    os.makedirs(args.out, exist_ok=True)
    out_path = os.path.join(args.out, "offline_throughput.json")
    ws = workloads(args.smoke, args.max_num_batched_tokens)
    decode = {"batches": [int(b) for b in (args.decode_batches or
                                           ("1,2,4" if args.smoke else "1,8,32")).split(",")],
              "context": args.decode_context or (48 if args.smoke else 4096),
              "warmup": 2 if args.smoke else 5,
              "steps": args.decode_steps or (4 if args.smoke else 40)}
    with tempfile.TemporaryDirectory(prefix="sparseserve-bench-",
                                     ignore_cleanup_errors=True) as tmpdir:
        model, cfg, model_name = C.resolve_model(args, tmpdir, 2048)
        setup = {"device": device, "dtype": dtype, "dtype_bytes": 4 if dtype == "float32" else 2,
                 "parts": parts, "decode": decode, "cfg": cfg}
        result = {
            "benchmark": "offline_throughput", "schema_version": 1, **C.meta(argv),
            "settings": {"smoke": args.smoke, "model": model_name, "model_config": cfg,
                         "device": device, "dtype": dtype, "seed": args.seed, "parts": parts,
                         "skip_hf": args.skip_hf, "decode": decode, "attention": "dense",
                         "time_budget_s": deadline.budget_s},
            "workloads": {k: asdict(w) for k, w in ws.items()},
            "targets": {"ratio_a_min": TARGET_RATIO_A, "host_frac_batch32_max": TARGET_HOST_FRAC},
            "results": {**{n: {} for n in ("a", "b") if n in parts},
                        **({"decode_steps": {}} if "steps" in parts else {})},
            "errors": [], "skipped": [], "complete": False,
        }

        def save() -> None:
            result["elapsed_s"] = deadline.elapsed()
            C.write_json(out_path, result)

        save()
        E.log(deadline, f"{model_name} on {device} ({result['gpu_name'] or 'no GPU'}), "
                        f"parts {parts}, writing {out_path}")
        plan = [n for n in ("a", "b") if n in parts]
        if "steps" in parts:
            if "a" not in parts:
                plan.insert(0, "steps")  # else it runs on workload a's engine
            if not args.no_eager:
                plan.insert(plan.index("b") if "b" in plan else len(plan), "steps-eager")
        for name in plan:
            if deadline.expired(30):
                result["skipped"].append({"part": name, "reason": "time budget used up"})
                continue
            sparseserve_part(name, model, setup, args, ws, deadline, result, save)
            save()
        if not args.skip_hf and any(n in parts for n in ("a", "b")):
            if deadline.expired(60):
                result["skipped"].append({"part": "hf", "reason": "time budget used up"})
            else:
                hf_part(cfg, setup, args, ws, deadline, result, save)
        finalize(result)
        E.finish(deadline, result, save, out_path, summary_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
