"""Needles only: the needle-in-a-haystack phase of `sparseserve eval fidelity`
(bench/needle.py: one multi-key haystack with 5 keys and single needles at the given depths,
per length; greedy, pass = the number in the first 8 tokens) for explicit settings, without
the teacher-forced phase that decides a default (which takes over an hour at 8k on 2 cores).
SmolLM2-135M on the CPU, the same engine setup as the fidelity run (page 32).

  python benchmarks/needles.py --out needles.json --lengths 4096 8192 \\
      --needle-depths 0.1 0.5 0.9 --needle-settings dense keycode2/b1024/s1/l2/d0 \\
      keycode2/b2048/s1/l2/d0 arkvale/b2048/s1/l2/d0 oracle/b2048/s1/l2/d0
  python benchmarks/needles.py --out /tmp/n.json --quick      # one 512-token length
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as C  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="JSON result path")
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--needle-depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    p.add_argument("--needle-settings", nargs="+", required=False,
                   default=["dense", "keycode2/b2048/s1/l2/d0", "arkvale/b2048/s1/l2/d0"],
                   help="setting keys (algorithm/bBUDGET/sSINK/lLOCAL/dDENSE) or 'dense'")
    p.add_argument("--quick", action="store_true", help="one 512-token length, 2 settings")
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.needle_depths = [512], [0.5]
        args.needle_settings = ["dense", "keycode2/b256/s1/l2/d0"]
    from sparseserve import LLM
    from sparseserve.bench.fidelity_tail import TailHarness
    from sparseserve.bench.needle import _parse_key, run_needles
    from sparseserve.model.loader import load_model_config, resolve_model_source

    settings = [k for k in args.needle_settings if k != "dense"]
    parsed = [_parse_key(k) for k in settings]
    if any(s is None for s in parsed):
        bad = [k for k, s in zip(settings, parsed) if s is None]
        raise SystemExit(f"--needle-settings: cannot parse {bad}; use e.g. "
                         "keycode2/b2048/s1/l2/d0 or dense")
    budgets = sorted({s.token_budget for s in parsed}) or [2048]
    ns = argparse.Namespace(lengths=args.lengths, budgets=budgets, quick=False,
                            needle_depths=args.needle_depths,
                            needle_settings=args.needle_settings, verify_needle=False)
    mc = load_model_config(resolve_model_source(args.model, "auto"))
    longest = max(args.lengths)
    llm = LLM(args.model, max_num_seqs=64, max_model_len=longest, page_size=32,
              kv_cache_memory_bytes=mc.kv_bytes_per_token(4) * (longest + 1024) * 2)
    harness = TailHarness(llm.engine.runner, chunk_rows=64)
    result = {"meta": C.meta(argv), "settings": vars(args)}
    t0 = time.perf_counter()
    result["needle"] = run_needles(ns, harness, llm.get_tokenizer(), None,
                                   sorted({s.algorithm for s in parsed}), print)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    C.write_json(args.out, result)
    rows = result["needle"]["settings"]
    dense = {(r["length"], r["haystack"], r["depth"]): r["passed"]
             for r in rows[0]["results"]} if rows and rows[0]["key"] == "dense" else None
    print(f"\n{'setting':28s} " + " ".join(f"{n:>6d}" for n in args.lengths) +
          "  misses where dense passes")
    for row in rows:
        per = [sum(r["passed"] for r in row["results"] if r["length"] == n) for n in args.lengths]
        tot = [sum(1 for r in row["results"] if r["length"] == n) for n in args.lengths]
        miss = "-" if dense is None else sum(
            1 for r in row["results"] if dense[(r["length"], r["haystack"], r["depth"])]
            and not r["passed"])
        print(f"{row['key']:28s} " + " ".join(f"{a:>3d}/{b:<2d}" for a, b in zip(per, tot))
              + f"  {miss}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
