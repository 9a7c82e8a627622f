"""The output of benchmarks/transfer.py: the plot (load and save panels, GB/s against page
count per method and page size, bulk bandwidth marked) and the table printed last."""
from __future__ import annotations

import common as C

COLORS = {"flash-h2d": "tab:red", "per-page-copy": "tab:blue", "gpu-direct": "tab:green"}
STYLES = ["-", "--", "-.", ":", (0, (3, 1, 1, 1, 1, 1))]


def plot(res, path):
    plt = C.pyplot()
    from matplotlib.lines import Line2D

    rows = [r for r in res["rows"] if r.get("status") == "ok"]
    kbs = sorted({r["page_kb"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    d2h_colors = ["tab:orange", "tab:purple", "tab:brown", "tab:pink"]
    for ax, direction, bulk_key in ((axes[0], "load", "h2d_gbps"), (axes[1], "save", "d2h_gbps")):
        methods = sorted({r["method"] for r in rows if r["direction"] == direction})
        colors = {}
        for m in methods:
            colors[m] = COLORS.get(m) or d2h_colors[len([c for c in colors if c not in COLORS]) % 4]
        for m in methods:
            for i, kb in enumerate(kbs):
                pts = sorted((r["pages"], r["gbps"]) for r in rows
                             if r["direction"] == direction and r["method"] == m and r["page_kb"] == kb)
                if pts:
                    ax.plot(*zip(*pts), color=colors[m], linestyle=STYLES[i % len(STYLES)],
                            marker="o", markersize=3)
        bulk = (res.get("bulk") or {}).get(bulk_key)
        if bulk:
            ax.axhline(bulk, color="black", linewidth=1, alpha=0.6)
            ax.text(ax.get_xlim()[0] if rows else 1, bulk, f" bulk {bulk:.1f} GB/s",
                    va="bottom", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("pages (K + V each)")
        ax.set_title(f"{direction} ({'host -> device' if direction == 'load' else 'device -> host'})")
        ax.grid(True, which="both", alpha=0.3)
        handles = [Line2D([], [], color=colors[m], label=m) for m in methods]
        handles += [Line2D([], [], color="gray", linestyle=STYLES[i % len(STYLES)],
                           label=f"{kb:g} KB pages") for i, kb in enumerate(kbs)]
        ax.legend(handles=handles, fontsize=8, loc="best")
    axes[0].set_ylabel("effective GB/s")
    fig.suptitle(f"KV page transfers on {res['device']} ({res['date']})", fontsize=10)
    return C.save_figure(fig, path)


def print_table(res, args):
    bulk = res.get("bulk") or {}
    if "h2d_gbps" in bulk:
        print(f"\nbulk pinned: H2D {bulk['h2d_gbps']:.1f} GB/s, D2H {bulk['d2h_gbps']:.1f} GB/s")
    for s in res["skipped"][:3]:
        print("skipped:", s)
    if len(res["skipped"]) > 3:
        print(f"skipped: ... {len(res['skipped']) - 3} more (see JSON)")
    bad = [c for c in res["checks"] if not c.get("exact")]
    print(f"exactness checks: {len(res['checks']) - len(bad)}/{len(res['checks'])} ok"
          + (f"; FAILED: {[(c['direction'], c['method'], c['page_kb']) for c in bad]}" if bad else ""))
    for g in res["graph"]:
        print(f"cuda graph FlashH2D: {g}")
    headers = ["GB/s", *[str(n) for n in args.pages]]
    lines = []
    keys = []
    for r in res["rows"]:
        k = (r["direction"], r["method"], r["page_kb"])
        if k not in keys:
            keys.append(k)
    for k in keys:
        cells = []
        for n in args.pages:
            r = next((x for x in res["rows"] if (x["direction"], x["method"], x["page_kb"]) == k
                      and x["pages"] == n), None)
            cells.append("-" if r is None else f"{r['gbps']:.3g}" if r.get("status") == "ok"
                         else r.get("status", "?"))
        lines.append([f"{k[0]} {k[1]} {k[2]:g}KB", *cells])
    print(C.table(headers, lines))
