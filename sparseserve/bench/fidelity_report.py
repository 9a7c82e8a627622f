"""Markdown tables and the plot of a fidelity run (fidelity.json -> text / png)."""
from __future__ import annotations


def _p(x, nd=1) -> str:
    return "–" if x is None else f"{100 * x:.{nd}f}"


def _kl(x) -> str:
    return "–" if x is None else f"{x:.4f}"


def _rows(out: dict, **match) -> list[dict]:
    return [r for r in out["teacher_forced"] if all(r.get(k) == v for k, v in match.items())]


def _knobs(r: dict) -> str:
    return f"s{r['sink_pages']} l{r['local_pages']} d{r['dense_layers']}"


def grid_table(out: dict, length: int) -> str:
    base = out["meta"].get("base") or dict(sink_pages=1, local_pages=2, dense_layers=0)
    lines = [f"#### {length} tokens (teacher-forced, last {out['meta']['tail']} positions of "
             f"{out['meta']['num_texts']} texts; sink {base['sink_pages']}, local "
             f"{base['local_pages']}, dense layers {base['dense_layers']} unless noted)",
             "",
             "| algorithm | budget | settings | top-1 % | confident top-1 % | KL(dense‖sparse) "
             "| recall % | mass % |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    seen = set()
    for phase in ("grid", "default"):
        for r in sorted(_rows(out, length=length, phase=phase),
                        key=lambda r: (r["algorithm"] != "dense", r["algorithm"],
                                       r["token_budget"])):
            if r["key"] in seen:
                continue
            seen.add(r["key"])
            budget = "all" if r["algorithm"] == "dense" else r["token_budget"]
            knobs = "–" if r["algorithm"] == "dense" else _knobs(r)
            lines.append(f"| {r['algorithm']} | {budget} | {knobs} | {_p(r['top1'])} | "
                         f"{_p(r['top1_confident'])} | {_kl(r['kl'])} | {_p(r['recall'])} | "
                         f"{_p(r['mass'])} |")
    return "\n".join(lines) + "\n"


def sweep_table(out: dict) -> str:
    length = max(out["meta"]["lengths"])
    rows = [r for r in out["teacher_forced"] if r["length"] == length
            and r["algorithm"] not in ("dense", "oracle", "streaming")
            and r["token_budget"] in (512, 2048) and r["phase"] in ("grid", "sweep")]
    budgets = sorted({r["token_budget"] for r in rows})
    cfgs = sorted({(r["algorithm"], r["sink_pages"], r["local_pages"], r["dense_layers"])
                   for r in rows})
    head = " | ".join(f"top-1 % @{b} | KL @{b}" for b in budgets)
    lines = [f"#### Settings sweep, {length} tokens", "",
             f"| algorithm | sink | local | dense layers | {head} |",
             "|---|---:|---:|---:|" + "---:|---:|" * len(budgets)]
    for c in cfgs:
        cells = []
        for b in budgets:
            r = next((r for r in rows if (r["algorithm"], r["sink_pages"], r["local_pages"],
                                          r["dense_layers"]) == c and r["token_budget"] == b),
                     None)
            cells += [_p(r["top1"]) if r else "–", _kl(r["kl"]) if r else "–"]
        lines.append(f"| {c[0]} | {c[1]} | {c[2]} | {c[3]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def needle_table(out: dict) -> str:
    nd = out.get("needle")
    if not nd:
        return ""
    lengths = sorted(out["meta"]["lengths"])
    cols = [(k, n) for n in lengths for k in ("single", "multikey")]
    lines = ["#### Needle in a haystack (greedy, pass = the number appears in the first 8 "
             "tokens)", "",
             "| setting | " + " | ".join(f"{k} {n}" for k, n in cols) + " | all |",
             "|---|" + "---:|" * (len(cols) + 1)]
    for r in nd["settings"]:
        res = r["results"]
        cells = []
        for k, n in cols:
            sub = [x["passed"] for x in res if x["kind"] == k and x["length"] == n]
            cells.append(f"{sum(sub)}/{len(sub)}" if sub else "–")
        lines.append(f"| {r['key']} | " + " | ".join(cells) + f" | {_p(r['pass_rate'], 0)}% |")
    checks = nd.get("llm_generate_checks") or []
    if checks:
        lines += ["", "LLM.generate cross-check (same prompt through the normal engine): " +
                  "; ".join(f"{c['key']} @{c['length']}: "
                            f"{'identical tokens' if c['equal'] else 'DIFFERENT'}"
                            for c in checks)]
    return "\n".join(lines) + "\n"


def per_text_table(out: dict, length: int, keys: list[str]) -> str:
    """Top-1 % / KL of each text for the given setting keys at one length."""
    rows = {r["key"]: r for r in out["teacher_forced"] if r["length"] == length}
    keys = [k for k in keys if k in rows]
    if not keys:
        return ""
    texts = [p["text"] for p in rows[keys[0]]["per_text"]]
    lines = [f"| setting ({length}) | " + " | ".join(texts) + " |",
             "|---|" + "---:|" * len(texts)]
    for k in keys:
        by = {p["text"]: p for p in rows[k]["per_text"]}
        lines.append(f"| {k} | " + " | ".join(
            f"{_p(by[t]['top1'])} / {by[t]['kl']:.3f}" if t in by else "–" for t in texts) + " |")
    return "\n".join(lines) + "\n"


def default_summary(out: dict) -> str:
    d = out.get("default")
    if not d:
        return ""
    cost = d.get("dense_layer_cost")
    charged = f", each dense layer charged {_p(cost)} point" if cost else ""
    lines = [f"**Chosen default:** `{d['algorithm']}` with sink_pages={d['sink_pages']}, "
             f"local_pages={d['local_pages']}, dense_layers={d['dense_layers']} "
             f"(best mean top-1 over budgets {d['budgets']} at "
             f"{max(out['meta']['lengths'])} tokens{charged}: {_p(d['mean_top1'], 2)}%).", ""]
    return "\n".join(lines) + "\n"


def markdown(out: dict) -> str:
    parts = [default_summary(out)]
    for length in sorted(out["meta"]["lengths"], reverse=True):
        parts.append(grid_table(out, length))
    parts.append(sweep_table(out))
    parts.append(needle_table(out))
    return "\n".join(p for p in parts if p)


def plot(out: dict, path: str, length: int | None = None) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    length = length or max(out["meta"]["lengths"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    algos = [a for a in out["meta"]["algorithms"] if a != "dense"]
    for a in algos:
        rs = sorted(_rows(out, length=length, phase="grid", algorithm=a),
                    key=lambda r: r["token_budget"])
        if rs:
            ax.plot([r["token_budget"] for r in rs], [100 * r["top1"] for r in rs], marker="o",
                    label=f"{a} ({_knobs(rs[0])})",
                    linestyle="--" if a == "oracle" or a.endswith("-sum") else "-")
    d = out.get("default")
    if d:
        knobs = {k: d[k] for k in ("algorithm", "sink_pages", "local_pages", "dense_layers")}
        rs = sorted({r["token_budget"]: r for r in _rows(out, length=length, **knobs)}.values(),
                    key=lambda r: r["token_budget"])
        if rs:
            ax.plot([r["token_budget"] for r in rs], [100 * r["top1"] for r in rs], marker="s",
                    linewidth=2.5, color="black",
                    label=f"default: {d['algorithm']} ({_knobs(rs[0])})")
    ax.set_xscale("log", base=2)
    budgets = sorted(out["meta"]["budgets"])
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("token budget (tokens per request, layer, KV head)")
    ax.set_ylabel("top-1 agreement with dense (%)")
    ax.set_title(f"SmolLM2-135M, teacher-forced, {length}-token texts")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
