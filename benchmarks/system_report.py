"""Figures of benchmarks/system.py results: per trace, wall time / output throughput / mean
TTFT as ratios to dense, and decode batch vs pages loaded per decode step over the run.

    python benchmarks/system_report.py docs/results/data/system_mix40.json \
        docs/results/data/system_long32.json --out docs/results/system.png
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as C  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("results", nargs="+")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    plt = C.pyplot()
    runs = [json.load(open(f)) for f in a.results]
    fig, axes = plt.subplots(2, len(runs), figsize=(6 * len(runs), 8), squeeze=False)
    for col, r in enumerate(runs):
        trace = r["trace"]["name"]
        names = [n for n, rec in r["runs"].items() if "vs_dense" in rec]
        metrics = [("wall", "total time"), ("output_throughput", "output tok/s"),
                   ("mean_ttft_reduction", "mean TTFT reduction")]
        ax = axes[0][col]
        w = 0.8 / len(names)
        for i, n in enumerate(names):
            vals = [r["runs"][n]["vs_dense"][m] for m, _ in metrics]
            ax.bar([j + i * w for j in range(len(metrics))], vals, w, label=n)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([j + w * (len(names) - 1) / 2 for j in range(len(metrics))],
                      [t for _, t in metrics])
        ax.set_ylabel("x dense (same run)")
        ax.set_title(f"{trace}: ratios to dense (same run)")
        ax.legend(fontsize=8)
        ax = axes[1][col]
        for n in names:
            steps = [s for s in r["runs"][n]["steps"] if s.get("decode")]
            if not any(s["pages_loaded"] for s in steps):
                continue
            ax.scatter([s["decode"] for s in steps], [s["pages_loaded"] for s in steps], s=4,
                       label=n, alpha=0.5)
        ax.set_xlabel("decode rows in the step")
        ax.set_ylabel("pages loaded from DRAM in the step")
        ax.set_yscale("symlog")
        ax.set_title(f"{trace}: loads per step vs batch")
        ax.legend(fontsize=8)
    C.save_figure(fig, a.out)
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
