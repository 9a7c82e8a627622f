"""The output of benchmarks/offload.py: the definitions the JSON carries, the ratios and the
headline summary, the plot (decode ms/step against the device cache size per batch, prefill
time per saving method) and the text table printed last."""
from __future__ import annotations

import common as C
from engine_bench import errors_line
from offload_decode import decode_ratios
from offload_prefill import TARGET_PREFILL_RATIO, prefill_ratios

DEFINITIONS = {
    "prefill time_s": "wall time from add_request to the first token (the "
                      "prefill steps), device synchronised; median of reps",
    "prefill drained_s": "time_s plus waiting for the saver's last copies to "
                         "land in DRAM (FlashD2H scatters after the step)",
    "cache_fraction": "device slots per layer / (batch x kv_heads x pages of "
                      "max_model_len): 1.0 = the whole KV of the batch fits",
    "mandatory_slots_per_layer": "batch x kv_heads x token_budget/page_size: what "
                                 "one decode step may select; the engine's minimum",
    "pages_loaded_per_step": "page loads (K+V of one KV head's page in one layer) "
                             "per decode step, summed over layers; get_stats deltas",
    "hit_rate": "cache_hits / (hits + misses) over the timed steps: selected "
                "(request, layer, head, page) entries already resident",
    "host_ms": "engine.last_step_host_time_s: runner prepare + launch before the "
               "step's one sync",
    "cuda_graphs_used": "every timed decode step replayed a captured CUDA graph "
                        "(cuda_graph_replays counts the runner's graph calls)",
}


def finalize(result: dict) -> None:
    result["prefill"]["ratios"] = prefill_ratios(result)
    decode_ratios(result)
    summ: dict = {}
    for key, r in result["prefill"]["runs"].items():
        summ[f"prefill_{key}_s"] = r.get("median_s")
        if r.get("ratio_to_nosave") is not None:
            summ[f"prefill_{key}_ratio"] = r["ratio_to_nosave"]
    fl = result["prefill"]["ratios"].get("chunked/flash")
    summ["prefill_flash_meets_target"] = fl["meets_target"] if fl else None
    for key, c in result["decode"]["configs"].items():
        for label, r in c["runs"].items():
            if r.get("ms_per_step") is None:
                continue
            summ[f"decode_{key}_{label}_ms"] = r["ms_per_step"]
            if r.get("kind") == "offload":
                summ[f"decode_{key}_{label}_x_resident"] = r.get("ratio_to_resident_sparse")
                summ[f"decode_{key}_{label}_hit_rate"] = r.get("hit_rate")
                summ[f"decode_{key}_{label}_pages_per_step"] = r.get("pages_loaded_per_step")
    result["summary"] = summ


def plot(result: dict, path: str) -> str:
    plt = C.pyplot()
    configs = [(k, c) for k, c in result["decode"]["configs"].items()]
    n = len(configs) + 1
    fig, axes = plt.subplots(1, n, figsize=(4.6 * n, 4.4), squeeze=False)
    for ax, (key, c) in zip(axes[0], configs):
        runs = c["runs"]
        pts = sorted((r["cache_fraction"], r["ms_per_step"], r.get("hit_rate"))
                     for r in runs.values()
                     if r.get("kind") == "offload" and r.get("ms_per_step") is not None)
        if pts:
            ax.plot([p[0] * 100 for p in pts], [p[1] for p in pts], "o-", color="tab:red",
                    label="two-tier (offload)")
            for x, y, h in pts:
                if h is not None:
                    ax.annotate(f"hit {100 * h:.0f}%", (x * 100, y), textcoords="offset points",
                                xytext=(4, 6), fontsize=7)
        for label, color, style in (("resident-sparse", "tab:blue", "--"),
                                    ("dense", "0.3", ":")):
            ms = runs.get(label, {}).get("ms_per_step")
            if ms is not None:
                ax.axhline(ms, color=color, linestyle=style,
                           label=f"{label} (all in HBM) {ms:.1f} ms")
        mf = c["plan"]["mandatory_fraction"] * 100
        ax.axvline(mf, color="0.6", lw=0.8)
        ax.text(mf, 0, " mandatory\n selection", fontsize=7, va="bottom", color="0.4")
        ax.set_xlim(0, 105)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("device cache (% of the batch's full KV per layer)")
        ax.set_ylabel("decode ms / step (median)")
        p = c["plan"]
        ax.set_title(f"decode: batch {p['batch']} x {p['max_model_len']} tokens", fontsize=10)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="lower right")
    ax = axes[0][-1]
    runs = result["prefill"]["runs"]
    palette = {"nosave": "tab:blue", "flash": "tab:red", "memcpy": "tab:orange",
               "gpu-direct": "tab:green"}
    items = [(k, r, r.get("median_s") or r.get("extrapolated_time_s")) for k, r in runs.items()]
    items = [it for it in items if it[2] is not None]
    for i, (key, r, v) in enumerate(items):
        mode, method = key.split("/")
        bar = ax.bar(i, v, color=palette.get(method, "0.5"),
                     hatch="//" if r.get("median_s") is None else None)[0]
        ratio = r.get("ratio_to_nosave")
        text = f"{ratio:.2f}x" if ratio is not None else ""
        if r.get("median_s") is None:
            text += " (cut, extrap.)"
        if text:
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, v), ha="center",
                        va="bottom", fontsize=7)
    for mode in ("chunked", "segmented"):  # the target: 1.05x the same mode's nosave time
        base = runs.get(f"{mode}/nosave", {}).get("median_s")
        xs = [i for i, (k, _, _) in enumerate(items) if k.startswith(mode + "/")]
        if base and xs:
            ax.hlines(base * TARGET_PREFILL_RATIO, min(xs) - 0.45, max(xs) + 0.45, colors="k",
                      linestyles="--", lw=0.8,
                      label=f"{TARGET_PREFILL_RATIO}x nosave (target)" if mode == "chunked"
                      else None)
    ax.set_xticks(range(len(items)), [f"{k.split('/')[1]}\n{k.split('/')[0]}"
                                      for k, _, _ in items], fontsize=7)
    if items:
        ax.set_ylim(0, 1.15 * max(v for _, _, v in items))
        ax.legend(fontsize=7, loc="upper left")
    ax.set_ylabel("prefill time (s), median")
    ax.set_title(f"prefill of {result['settings']['prefill_len']} tokens by saving method",
                 fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"two-tier KV cache, {result['settings']['model']} on "
                 f"{result.get('gpu_name') or 'CPU'} ({result['date_utc'][:10]})", fontsize=10)
    return C.save_figure(fig, path)


def summary_table(result: dict) -> str:
    out = []
    rows = []
    for key, r in result["prefill"]["runs"].items():
        mode, method = key.split("/")
        t = r.get("median_s")
        note = "error" if "error" in r else ("CUT, extrapolated" if r.get("cut_by_time_budget")
                                             else "")
        rows.append([f"{mode} {method}", C.fmt(t if t is not None
                                                else r.get("extrapolated_time_s"), 3),
                     C.fmt(r.get("median_drained_s"), 3), C.fmt(r.get("ratio_to_nosave"), 3),
                     C.fmt(r.get("ratio_drained_to_nosave"), 3), len(r.get("reps", [])), note])
    if rows:
        out.append(f"prefill of one {result['settings']['prefill_len']}-token prompt "
                   f"(target flash <= {TARGET_PREFILL_RATIO}x nosave)")
        out.append(C.table(["prefill", "s", "drained s", "x nosave", "drained x", "reps", ""],
                           rows))
    rows = []
    for key, c in result["decode"]["configs"].items():
        p = c["plan"]
        for label, r in c["runs"].items():
            if r.get("ms_per_step") is None:
                why = ("error" if "error" in r else f"= {r['same_as']}" if r.get("same_as")
                       else "skipped")
                rows.append([f"b{p['batch']} x {p['max_model_len']}", label, "-", "-", "-", "-",
                             "-", "-", "-", why])
                continue
            frac = r.get("cache_fraction")
            rows.append([f"b{p['batch']} x {p['max_model_len']}", label,
                         C.fmt(None if frac is None else 100 * frac, 1),
                         C.fmt(r["ms_per_step"], 2), C.fmt(r["host_ms"]["median"], 2),
                         C.fmt(r.get("pages_loaded_per_step"), 0),
                         C.fmt(None if r.get("hit_rate") is None else 100 * r["hit_rate"], 1),
                         C.fmt(r.get("ratio_to_resident_sparse"), 2),
                         "yes" if r.get("cuda_graphs_used") else "no",
                         "eager retry" if r.get("retried_eager") else ""])
    if rows:
        out.append("decode (median ms/step; pages = per-layer pages loaded per step, all "
                   "layers)")
        out.append(C.table(["decode", "config", "cache %", "ms/step", "host ms", "pages/step",
                            "hit %", "x resident", "graphs", ""], rows))
    if result["skipped"]:
        out.append("skipped: " + "; ".join(f"{s['part']} ({s['reason']})"
                                           for s in result["skipped"]))
    if result["errors"]:
        out.append(errors_line(result["errors"]))
    return "\n".join(out)
