"""The output of benchmarks/sparse_decode.py: where select's time goes at the largest context
(and what that suggests), the targets at that context, the plot (time per layer vs context;
select and attend stacked against dense / 10) and the table printed last."""
from __future__ import annotations

import common as C
from sparse_decode_measure import TARGETS


def label(ctx):
    return f"{ctx // 1024}k" if ctx % 1024 == 0 else str(ctx)


def analyse(rows):
    """Where select's time goes at the largest context, and what that suggests."""
    sp = [r for r in rows if r["algorithm"] != "dense"]
    if not sp:
        return {"lines": [], "suggestions": []}
    top = max(r["context"] for r in sp)
    lines, sugg = [], []
    at = sorted((r for r in sp if r["context"] == top), key=lambda r: (r["batch"], r["algorithm"]))
    for r in at:
        r = dict(r, select_unfused_us=r.get("select_unfused_us", r["select_us"]))  # older JSON
        head = f"select {r['select_us']:.1f} us; generic select"
        if r.get("fused_select"):
            alone = "-" if r["fused_us"] is None else f"{r['fused_us']:.1f}"
            head = (f"fused select {r['select_us']:.1f} us (kernel call alone {alone} us; "
                    f"speed-up {r['select_speedup']:.1f}x over the generic select)")
        lines.append(
            f"{label(top)} B={r['batch']} {r['algorithm']}: {head} "
            f"{r['select_unfused_us']:.1f} us = score "
            f"{r['score_us']:.1f} us ({r['score_bw_tbs'] or 0:.2f} TB/s, "
            f"{r['score_bw_frac_copy'] or 0:.0%} of copy) + topk {r['topk_us']:.1f} us (unsorted "
            f"{r['topk_unsorted_us']:.1f}) + other ops {r['select_glue_us']:.1f} us; attend "
            f"{r['attend_us']:.1f} us; select = {r['select_share']:.0%} of select+attend; "
            f"select reads {r['select_over_attend_bytes']:.2f}x attend's bytes")
        if r.get("select_kernels"):
            lines.append("    select launches: " + "; ".join(
                f"{k['name']} {k['us']:.1f} us" if k["us"] is not None else k["name"]
                for k in r["select_kernels"]))
    dom = [r for r in at if r["select_share"] > 0.5]
    if dom:
        sugg.append(f"select dominates at {label(top)} for B in {sorted({r['batch'] for r in dom})}"
                    f"; by bytes alone select reads {dom[0]['select_over_attend_bytes']:.1f}x "
                    "attend (2 summary rows x every page vs K+V of the budget's pages)")
    generic = [r for r in at if not r.get("fused_select")]  # the fused kernel has no topk/glue
    tk = [r for r in generic if r["topk_us"] > 0.3 * r["select_us"]]
    if tk:
        worst = max(tk, key=lambda r: r["topk_us"] / r["select_us"])
        sugg.append(f"torch.topk is {worst['topk_us'] / worst['select_us']:.0%} of select at "
                    f"B={worst['batch']} ({worst['topk_us']:.1f} us for {worst['batch']}x"
                    f"{worst['pages_per_head']}-wide rows per KV head; sorted=False "
                    f"{worst['topk_unsorted_us']:.1f} us): fuse the top-k into the score kernel "
                    "(per (request, head) radix/threshold select) or at least use sorted=False")
    gl = [r for r in generic if r["select_glue_us"] > 0.3 * r["select_us"]]
    if gl:
        worst = max(gl, key=lambda r: r["select_glue_us"])
        sugg.append(f"the torch ops around score/topk in SparseAlgorithm.select cost "
                    f"{worst['select_glue_us']:.1f} us at B={worst['batch']}: fold the kept-page "
                    "(+inf) / last-page (-inf) masking into the score kernel and emit int32 page "
                    "ids from the top-k (drops ~10 elementwise kernels and 2 full-size temporaries)")
    slow = [r for r in generic if (r["score_bw_frac_copy"] or 0) < 0.6 and r["batch"] >= 16]
    if slow:
        sugg.append(f"the score kernel reaches {min(r['score_bw_frac_copy'] or 0 for r in slow):.0%}"
                    " of copy bandwidth at large batch: tune BLOCK_W / num_warps, or store kmin/kmax"
                    " interleaved per page ([S, 2, D]) so one gather reads both")
    fz = [r for r in at if r.get("fused_select") and (r["select_bw_frac_copy"] or 0) < 0.5]
    if fz:
        worst = min(fz, key=lambda r: r["select_bw_frac_copy"] or 0)
        sugg.append(f"the fused select (score + topk kernel) reaches "
                    f"{worst['select_bw_frac_copy'] or 0:.0%} of copy "
                    f"bandwidth at B={worst['batch']}: try num_splits / block_w / num_warps of "
                    "kernels.page_select.select_pages (SPARSESERVE_FUSED_SELECT=0: generic path)")
    return {"context": top, "lines": lines, "suggestions": sugg}


def targets(rows):
    sp = [r for r in rows if r["algorithm"] != "dense"]
    if not sp:
        return {"context": None, "rows": [], "all_met": None}
    top = max(r["context"] for r in sp)
    out = [{k: r[k] for k in ("batch", "algorithm", "ratio", "ratio_graph", "attend_bw_frac_copy",
                              "summary_frac", "meets")} for r in sp if r["context"] == top]
    return {"context": top, "is_128k": top == 131072, "thresholds": TARGETS, "rows": out,
            "all_met": all(all(r["meets"].values()) for r in out)}


def plot(rows, path, batches):
    """Top row: time per layer vs context (log). Bottom: select/attend stacked (linear), with
    dense / 10 (the 128k target) marked."""
    plt = C.pyplot()
    batches = [b for b in batches if any(r["batch"] == b for r in rows)]
    algs = sorted({r["algorithm"] for r in rows} - {"dense"})
    nb = max(1, len(batches))
    fig, axes = plt.subplots(2, nb, figsize=(4.2 * nb, 7), squeeze=False)
    width = 0.8 / max(1, len(algs))
    for col, b in enumerate(batches):
        top, bot = axes[0][col], axes[1][col]
        get = {(r["context"], r["algorithm"]): r for r in rows if r["batch"] == b}
        ctxs = sorted({r["context"] for r in rows if r["batch"] == b})
        xs = range(len(ctxs))
        dense = [get[c, "dense"]["dense_us"] if (c, "dense") in get else None for c in ctxs]
        top.plot(xs, dense, "o-", color="0.4", label="dense")
        for j, a in enumerate(algs):
            rs = [get.get((c, a)) for c in ctxs]
            top.plot(xs, [r and r["select_plus_attend_us"] for r in rs], "s-", color=f"C{j}",
                     label=f"{a} select+attend")
            top.plot(xs, [r and r.get("graph_us") for r in rs], "^--", color=f"C{j}",
                     label=f"{a} CUDA graph")
            for i, r in enumerate(rs):
                if r is None:
                    continue
                x = i - 0.4 + (j + 0.5) * width
                bot.bar(x, r["select_us"], width * 0.9, color=f"C{j}", alpha=0.5,
                        label=f"{a} select" if i == 0 else None)
                bot.bar(x, r["attend_us"], width * 0.9, bottom=r["select_us"], color=f"C{j}",
                        label=f"{a} attend" if i == 0 else None)
        for i, d in enumerate(dense):
            if d is not None:
                bot.plot([i - 0.45, i + 0.45], [d / 10] * 2, "k--", lw=1,
                         label="dense / 10" if i == 0 else None)
        for ax in (top, bot):
            ax.set_xticks(list(xs), [label(c) for c in ctxs])
            ax.grid(axis="y", alpha=0.3, which="both")
        top.set_yscale("log")
        top.set_title(f"batch {b}")
        bot.set_xlabel("context (tokens)")
    axes[0][0].set_ylabel("time per layer (us, log)")
    axes[1][0].set_ylabel("sparse time per layer (us)")
    axes[0][0].legend(fontsize=7)
    axes[1][0].legend(fontsize=7)
    fig.suptitle("sparse decode attention (select + attend) vs dense paged decode, per layer "
                 "(device time)", fontsize=10)
    return C.save_figure(fig, path)


def print_table(C, rows, copy):
    dense = {(r["context"], r["batch"]): r for r in rows if r["algorithm"] == "dense"}
    pct = lambda x, dg=0: C.fmt(x * 100, dg) if x is not None else "-"  # noqa: E731
    out = [[label(r["context"]), r["batch"], r["algorithm"], C.fmt(r["dense_us"]),
            pct(dense.get((r["context"], r["batch"]), {}).get("bw_frac_copy")),
            C.fmt(r["select_us"]), C.fmt(r.get("select_unfused_us")), C.fmt(r["attend_us"]),
            C.fmt(r["select_plus_attend_us"]),
            C.fmt(r["graph_us"]), C.fmt(r["ratio"], 3), C.fmt(r["ratio_graph"], 3),
            pct(r["attend_bw_frac_copy"]), pct(r["select_bw_frac_copy"]), pct(r["summary_frac"], 2)]
           for r in rows if r["algorithm"] != "dense"]
    print(f"device copy: {C.fmt(copy.get('bw_tbs'), 2)} TB/s (read+write); us per layer, "
          "device time; %cp = achieved bandwidth / copy bandwidth")
    print(C.table(["ctx", "B", "alg", "dense", "dense%cp", "select", "generic", "attend",
                   "sel+att", "graph",
                   "sparse/dense", "graph/dense", "att%cp", "sel%cp", "summ%KV"], out))
