"""Side by side: several `benchmarks/system.py` JSONs (e.g. two trees run alternately in one
command, A/B), per configuration: mean / p99 TBT, TTFT, the decode-only step's median and mean,
its median batch and CUDA-graph launch (host) time, prefill tokens/s in prefill steps. Ratios are to the first file's `dense`.

  python benchmarks/system_ab.py old1.json new1.json old2.json new2.json [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np


def summary(run: dict) -> dict:
    """One configuration's record of system.py -> the numbers compared. Per output token
    (steps' wall times x their decode rows, over all decode rows): what decode-only steps and
    steps with prefill work ("hybrid") add to the mean TBT; and the host time between steps."""
    steps = run["steps"]
    pure = [s for s in steps if s["decode"] and not s.get("prefill_token_layers")]
    hybrid = [s for s in steps if s["decode"] and s.get("prefill_token_layers")]
    walls = np.array([1e3 * s["wall_s"] for s in pure]) if pure else np.array([np.nan])
    rows = max(1, sum(s["decode"] for s in steps))
    gaps = [1e3 * (b["t"] - a["t"] - b["wall_s"]) for a, b in zip(steps, steps[1:])]
    return {"ttft_s": run["ttft_s"]["mean"], "tbt_ms": run["tbt_ms"]["mean"],
            "p99_tbt_ms": run["p99_tbt_ms"],
            "decode_median_ms": float(np.median(walls)), "decode_mean_ms": float(walls.mean()),
            "decode_batch_median": float(np.median([s["decode"] for s in pure])) if pure else 0,
            "replay_median_ms": float(np.median([1e3 * s.get("replay_s", np.nan) for s in pure]))
            if pure else np.nan,
            "prefill_tok_s": run["prefill_tokens_per_s_in_prefill_steps"],
            "pure_ms_per_token": sum(1e3 * s["wall_s"] * s["decode"] for s in pure) / rows,
            "hybrid_ms_per_token": sum(1e3 * s["wall_s"] * s["decode"] for s in hybrid) / rows,
            "gap_median_ms": float(np.median(gaps)) if gaps else np.nan}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--json", default=None, help="write the table as JSON here")
    p.add_argument("--kernels", action="store_true",
                   help="also print each configuration's profiled decode-only steps "
                        "(system.py --profile-steps): kernel time, launches, top kernels")
    a = p.parse_args()
    rows = []
    for f in a.files:
        for name, run in json.load(open(f))["runs"].items():
            rows.append({"file": os.path.basename(f), "config": name, **summary(run)})
    ref = next((r for r in rows if r["config"] == "dense"), None)
    cols = ["ttft_s", "tbt_ms", "p99_tbt_ms", "decode_median_ms", "decode_mean_ms",
            "decode_batch_median", "replay_median_ms", "prefill_tok_s", "pure_ms_per_token",
            "hybrid_ms_per_token", "gap_median_ms"]
    print(f"{'file':32s} {'config':14s} " + " ".join(f"{c[:12]:>12s}" for c in cols))
    for r in rows:
        print(f"{r['file'][:32]:32s} {r['config'][:14]:14s} "
              + " ".join(f"{r[c]:12.2f}" for c in cols))
    if a.kernels:
        for f in a.files:
            for name, run in json.load(open(f))["runs"].items():
                for i, st in enumerate(run["steps"]):
                    prof = st.get("profile")
                    if not prof or st.get("prefill_token_layers") or not st["decode"]:
                        continue
                    print(f"\n{os.path.basename(f)} {name} step {i}: batch {st['decode']}, "
                          f"kernel {prof['kernel_ms']} ms in {prof['kernels']} launches, "
                          f"profiled wall {prof['wall_ms']} ms")
                    for k, n, ms in prof["top_kernels"]:
                        print(f"  {ms:7.3f} ms {n:5d}x  {k}")
    if a.json:
        json.dump({"rows": rows, "reference": ref}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
