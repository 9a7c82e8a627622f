"""Pure-decode step time and pages loaded per step versus batch size, with and without
working-set control (SparseServe's Figure 1), against dense in the same run.

For each batch size B: the first B requests of the long32 trace (prompts 8k-16k, 512 output
tokens, all arriving at once) through benchmarks/system.py, for each configuration (default:
sparseserve, sparseserve-no-wc, dense). Per (B, configuration): the pure-decode step time and
the decode batch those steps actually ran (working-set control may hold requests back; dense
preempts), pages loaded from DRAM per decode step, the hit rate, output tokens/s, wall time.
The time budget is split evenly over the batch sizes.

    python3 benchmarks/decode_batch.py --out $OUT/decode_batch.json --batches 8,16,24,32 \\
        --time-budget-s 560
    python3 benchmarks/decode_batch.py --out /tmp/db.json --smoke --batches 2,4
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as C  # noqa: E402
import system  # noqa: E402

FIELDS = ("wall_s", "output_tokens_per_s", "pure_decode_ms_per_step", "pure_decode_mean_batch",
          "pages_loaded_per_decode_step", "hit_rate", "num_preemptions", "p99_tbt_ms")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="JSON result path (+ .png)")
    p.add_argument("--batches", default="8,16,24,32", help="batch sizes (<= 32: long32)")
    p.add_argument("--configs", default="sparseserve,sparseserve-no-wc,dense")
    p.add_argument("--time-budget-s", type=float, default=560)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    p.add_argument("--model", default=None)
    args, rest = p.parse_known_args(argv)  # the rest goes to system.py (e.g. --token-budget)
    batches = [int(b) for b in args.batches.split(",")]
    if max(batches) > 32 or min(batches) < 1:
        raise SystemExit("--batches: 1..32 (the long32 trace has 32 requests)")
    share = args.time_budget_s / len(batches)
    result = {"meta": C.meta(argv), "settings": {**vars(args), "system_args": rest},
              "rows": [], "errors": []}
    with tempfile.TemporaryDirectory() as tmp:
        for b in batches:
            path = os.path.join(tmp, f"b{b}.json")
            sub = ["--out", path, "--trace", "long32", "--num-requests", str(b),
                   "--configs", args.configs, "--time-budget-s", str(share),
                   "--run-budget-s", str(max(20.0, share / len(args.configs.split(",")))),
                   *(["--smoke"] if args.smoke else []),
                   *(["--model", args.model] if args.model else []), *rest]
            system.main(sub)
            run = _load(path)
            result["errors"] += [{**e, "batch": b} for e in run.get("errors", [])]
            for name, rec in run["runs"].items():
                row = {"batch": b, "config": name, **{k: rec.get(k) for k in FIELDS},
                       "truncated": rec.get("truncated_by_time_budget"),
                       "error": rec.get("error")}
                result["rows"].append(row)
            C.write_json(args.out, result)
    _plot(result, os.path.splitext(args.out)[0] + ".png")
    print(f"wrote {args.out}\n")
    rows = [[r["batch"], r["config"], C.fmt(r["pure_decode_ms_per_step"], 1),
             C.fmt(r["pure_decode_mean_batch"], 1), C.fmt(r["pages_loaded_per_decode_step"], 0),
             C.fmt(None if r["hit_rate"] is None else 100 * r["hit_rate"], 1),
             C.fmt(r["output_tokens_per_s"], 0), r["num_preemptions"],
             "cut" if r["truncated"] else ""] for r in result["rows"]]
    print(C.table(["B", "config", "decode ms", "decode batch", "loaded/step", "hit %",
                   "out tok/s", "preempt", ""], rows))
    return 0


def _load(path: str) -> dict:
    import json
    with open(path) as f:
        return json.load(f)


def _plot(result: dict, path: str) -> None:
    plt = C.pyplot()
    if plt is None:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name in dict.fromkeys(r["config"] for r in result["rows"]):
        rs = [r for r in result["rows"] if r["config"] == name
              and r["pure_decode_ms_per_step"] is not None]
        if not rs:
            continue
        a.plot([r["batch"] for r in rs], [r["pure_decode_ms_per_step"] for r in rs], marker="o",
               label=name)
        b.plot([r["batch"] for r in rs], [r["pages_loaded_per_decode_step"] or 0 for r in rs],
               marker="o", label=name)
    a.set_xlabel("requests (batch size)")
    a.set_ylabel("pure-decode step (ms)")
    b.set_xlabel("requests (batch size)")
    b.set_ylabel("pages loaded per decode step")
    a.legend()
    fig.suptitle("decode step vs batch size, with and without working-set control")
    C.save_figure(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
