"""What benchmarks/serving.py reports from its points: ratios to `dense` at the same rate, the
saturation targets of the end-to-end issue, goodput, the summary table and the figure.

Definitions (a point = one preset at one request rate):

* out tok/s (`out_tok_s`): tokens the engine generated during the point / its duration. It
  equals vLLM's `output_throughput` (completed requests' tokens / duration) when every request
  completed (ignore_eos), and still counts the tokens of requests cut at a time cap.
* mean TTFT (`ttft_ms`): vLLM's mean TTFT over completed requests; for a point cut at its time
  cap, the mean over every sent request with the time until the cut standing in for a first
  token that never came (`mean_ttft_lb_ms`, a lower bound).
* saturation throughput of a preset: its highest out tok/s over the rates (the plateau of
  SparseServe's Figure 11); the throughput target compares these.
* TTFT ratio: dense's mean TTFT / the preset's at the same rate; reported at the highest rate
  both ran and as the best over rates (the paper's "up to"). A ratio is "exact" when neither
  point was cut, a "lower bound" when only dense's was (its TTFT is a lower bound), and
  "unreliable" when the preset's own point was cut.

    python benchmarks/serving_report.py docs/results/data/serving_lwm7b.json   # table again
"""
from __future__ import annotations

import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as C  # noqa: E402

TARGETS = {"throughput_x": 3.14, "ttft_x_lower": 9.26}  # SparseServe on LWM-7B (the issue)
# SparseServe's ablation ladder (Figure 13), SA first; serving.py's LADDER names the middle rungs
LADDER_ORDER = ("sparse", "sparse-offload", "sparse-offload+ft", "sparse-offload+ft+wc",
                "sparse-offload+ft+wc+lp", "sparseserve")
ORDER = ("dense",) + LADDER_ORDER


def rate_value(rate) -> float:
    """A point's rate as a float ("inf" in the JSON is math.inf)."""
    return math.inf if rate in ("inf", None) else float(rate)


def out_tok_s(p: dict):
    v = p.get("out_tok_s")
    return v if v is not None else p.get("output_throughput")


def ttft_ms(p: dict):
    if p.get("truncated"):
        return p.get("mean_ttft_lb_ms")
    return p.get("mean_ttft_ms")


def _div(a, b):
    return a / b if a is not None and b else None


def ordered(result: dict) -> list[tuple[str, dict]]:
    recs = result["presets"]
    return sorted(recs.items(), key=lambda kv: ORDER.index(kv[0]) if kv[0] in ORDER else 99)


def compare(result: dict) -> dict:
    """Per preset other than dense: per-rate ratios, saturation throughput ratio, TTFT ratio
    at the highest common rate and best over rates, and whether the targets are met."""
    base = {rate_value(p["rate"]): p for p in
            result["presets"].get("dense", {}).get("points", []) if p.get("completed") is not None}
    out: dict = {}
    dense_peak = max((out_tok_s(p) or 0 for p in base.values()), default=0) or None
    for name, rec in ordered(result):
        pts = [p for p in rec.get("points", []) if p.get("completed") is not None]
        if name == "dense" or not pts or not base:
            continue
        per_rate = []
        for p in pts:
            b = base.get(rate_value(p["rate"]))
            if b is None:
                continue
            quality = ("unreliable" if p.get("truncated") else
                       "lower bound" if b.get("truncated") else "exact")
            per_rate.append({"rate": p["rate"], "throughput_x": _div(out_tok_s(p), out_tok_s(b)),
                             "ttft_x_lower": _div(ttft_ms(b), ttft_ms(p)),
                             "ttft_ratio_quality": quality})
        peak = max((out_tok_s(p) or 0 for p in pts), default=0) or None
        ttfts = [r for r in per_rate if r["ttft_x_lower"] is not None]
        best = max(ttfts, key=lambda r: r["ttft_x_lower"], default=None)
        top = max(per_rate, key=lambda r: rate_value(r["rate"]), default=None)
        sat = _div(peak, dense_peak)
        g, g_dense = rec.get("goodput_rate"), result["presets"]["dense"].get("goodput_rate")
        out[name] = {
            # goodput ratio: both rates measured and finite (an `inf` goodput has no ratio)
            "goodput_x": (_div(rate_value(g), rate_value(g_dense)) if None not in (g, g_dense)
                          and math.isfinite(rate_value(g) * rate_value(g_dense)) else None),
            "goodput_quality": goodput_quality(pts, g, result["presets"]["dense"].get("points")
                                               or [], g_dense),
            "goodput_x_range": goodput_ratio_range(pts, g, result["presets"]["dense"].get(
                "points") or [], g_dense),
            "goodput_x_interpolated": _interpolated_ratio(result, pts, g, g_dense),
            "per_rate": per_rate,
            "saturation_throughput_x": sat,
            "throughput_x_at_highest_rate": top and top["throughput_x"],
            "ttft_x_lower_at_highest_rate": top and top["ttft_x_lower"],
            "ttft_x_lower_best": best and best["ttft_x_lower"],
            "ttft_x_lower_best_rate": best and best["rate"],
            "ttft_x_lower_best_quality": best and best["ttft_ratio_quality"],
            "targets": TARGETS,
            "throughput_target_met": None if sat is None else sat >= TARGETS["throughput_x"],
            "ttft_target_met": (None if best is None or best["ttft_ratio_quality"] == "unreliable"
                                else best["ttft_x_lower"] >= TARGETS["ttft_x_lower"]),
        }
    return out


def goodput(points: list[dict], tbt_slo_ms: float, queue_slo_s: float):
    """SparseServe's goodput: the highest rate whose P99 TBT and mean queueing delay meet the
    SLOs (points cut at their time cap never count; a missing queue time counts as met)."""
    ok = [p for p in points
          if p.get("completed") and not p.get("truncated")
          and p.get("p99_itl_ms") is not None and p["p99_itl_ms"] <= tbt_slo_ms
          and (p.get("mean_queue_s") or 0) <= queue_slo_s]
    return max(ok, key=lambda p: rate_value(p["rate"]))["rate"] if ok else None


def tbt_slo_ms(result: dict, override: float | None = None) -> float | None:
    """The P99 TBT SLO: `override` (--tbt-slo-ms), else 25x the dense preset's mean TBT at its
    lowest rate (SparseServe's definition); None while dense has no measured point."""
    if override:
        return override
    dense = [p for p in result["presets"].get("dense", {}).get("points") or []
             if p.get("mean_itl_ms") is not None]
    return 25 * dense[0]["mean_itl_ms"] if dense else None


def next_rung(point: dict, tbt_slo: float | None, queue_slo_s: float,
              factor: float | None) -> float | None:
    """The rate to probe after `point`, the last of its preset's ladder (serving.py
    --extend-ladder): `factor` x its rate when it met both SLOs (until a higher rate misses, a
    goodput is only a floor: goodput_quality), else None (no factor, no SLO yet, `inf`)."""
    rate = rate_value(point["rate"])
    if not factor or math.isinf(rate) or tbt_slo is None:
        return None
    if goodput([point], tbt_slo, queue_slo_s) is None:
        return None
    return round(rate * factor, 3)


def goodput_is_bracketed(points: list[dict], rate) -> bool:
    """Whether a measured point above `rate` (the goodput) missed the SLOs: only then is the
    goodput the preset's, not a floor under it (its ladder stopped while it still met them)."""
    if rate is None:
        return True  # no rate met: "below the lowest probed" is what was measured
    return any(p.get("completed") is not None and rate_value(p["rate"]) > rate_value(rate)
               for p in points)


def goodput_bracket(points: list[dict], rate) -> tuple[float, float | None] | None:
    """Where a preset's goodput lies on its ladder: [rate, the lowest measured rate above it)
    -> (rate, that rate), or (rate, None) when nothing above it was measured (a floor); None
    without a finite goodput."""
    if rate is None or not math.isfinite(rate_value(rate)):
        return None
    above = [rate_value(p["rate"]) for p in points if p.get("completed") is not None
             and rate_value(p["rate"]) > rate_value(rate)]
    return rate_value(rate), (min(above) if above else None)


def _interpolated_ratio(result: dict, points: list[dict], rate, dense_rate):
    """goodput_interpolated's ratio to dense's, with the run's SLOs (settings); None when
    either end is not interpolable."""
    st = result.get("settings") or {}
    slo, queue = st.get("tbt_slo_ms_used"), st.get("queue_slo_s")
    if slo is None or queue is None:
        return None
    mine = goodput_interpolated(points, rate, slo, queue)
    dense = goodput_interpolated(result["presets"]["dense"].get("points") or [], dense_rate,
                                 slo, queue)
    return _div(mine, dense) if None not in (mine, dense) else None


def goodput_ratio_range(points, rate, dense_points, dense_rate) -> list | None:
    """The goodput ratio's range given the ladders' resolution: [mine / dense's next rung,
    my next rung / dense's], open at both ends; None for an end a floor leaves unbounded
    (e.g. a 1.5x ladder with goodputs 4.5 and 3.0 puts the 1.5x ratio in (1.0, 2.25))."""
    mine, dense = goodput_bracket(points, rate), goodput_bracket(dense_points, dense_rate)
    if mine is None or dense is None:
        return None
    lo = mine[0] / dense[1] if dense[1] else None
    hi = mine[1] / dense[0] if mine[1] else None
    return [lo, hi]


def goodput_interpolated(points: list[dict], rate, tbt_slo: float, queue_slo_s: float):
    """Where between the goodput rung and the next measured rung the SLOs are crossed, by
    linear interpolation of each SLO metric (P99 TBT, mean queueing delay) that the next rung
    misses: the lowest crossing rate. None when the goodput is not bracketed by a measured
    higher rung, or either rung lacks a metric it needs. An estimate between two measurements,
    reported beside the measured goodput, never instead of it."""
    br = goodput_bracket(points, rate)
    if br is None or br[1] is None:
        return None
    by_rate = {rate_value(p["rate"]): p for p in points if p.get("completed") is not None}
    lo, hi = by_rate.get(br[0]), by_rate.get(br[1])
    if lo is None or hi is None:
        return None
    crossings = []
    for key, slo in (("p99_itl_ms", tbt_slo), ("mean_queue_s", queue_slo_s)):
        a, b = lo.get(key), hi.get(key)
        if b is None or b <= slo:
            continue  # the next rung meets this SLO: it did not bound the goodput
        if a is None or a > slo or b <= a:
            return None
        crossings.append(br[0] + (slo - a) / (b - a) * (br[1] - br[0]))
    return min(crossings) if crossings else None


def goodput_quality(points: list[dict], rate, dense_points: list[dict], dense_rate) -> str:
    """How a goodput ratio relates to the truth: "exact" when both goodputs are bracketed by a
    failing higher rate; a ladder that stopped while meeting the SLOs makes its goodput a floor,
    so the ratio is a "lower bound" (this preset's floor), an "upper bound" (dense's floor), or
    "undetermined" (both floors)."""
    mine = goodput_is_bracketed(points, rate)
    dense = goodput_is_bracketed(dense_points, dense_rate)
    return {(True, True): "exact", (False, True): "lower bound",
            (True, False): "upper bound", (False, False): "undetermined"}[(mine, dense)]


def _goodput_text(result: dict, name: str, c: dict) -> str:
    """The comparison line's goodput part: the ratio with its quality, range and interpolation,
    or which configuration met the SLOs at none of its rates (no ratio)."""
    if c.get("goodput_x") is None:
        none = [n for n in (name, "dense") if result["presets"][n].get("goodput_rate") is None]
        if none:
            return f"goodput: no ratio ({' and '.join(none)} met the SLOs at none of its rates)"
        return "goodput: no ratio (an `inf` goodput)"
    return (f"goodput {_x(c['goodput_x'])}x ({c.get('goodput_quality')}"
            f"{_range(c.get('goodput_x_range'))}"
            + (f"; ~{c['goodput_x_interpolated']:.2f}x interpolating each SLO metric to its "
               "limit between the rungs" if c.get("goodput_x_interpolated") else "") + ")")


def _x(v, digits: int = 2) -> str:
    return "" if v is None else f"{v:.{digits}f}"


def _range(r) -> str:
    """'; between the rungs: (lo, hi)' for a goodput ratio's range (a floor's end: 0 or
    unbounded); '' when neither end is known."""
    if not r or r == [None, None]:
        return ""
    lo = "0" if r[0] is None else f"{r[0]:.2f}"
    hi = "unbounded" if r[1] is None else f"{r[1]:.2f}"
    return f"; between the rungs: ({lo}, {hi})"


def table(result: dict) -> str:
    """The summary printed last: one row per point, goodput, then the targets."""
    base = {rate_value(p["rate"]): p for p in result["presets"].get("dense", {}).get("points", [])}
    rows = []
    for name, rec in ordered(result):
        for p in rec.get("points", []):
            if p.get("completed") is None:  # skipped or failed point
                rows.append([name, p["rate"], "-", p.get("skipped") or p.get("error", "")[:40]]
                            + [""] * 7)
                continue
            b = base.get(rate_value(p["rate"])) if name != "dense" else None
            done = f"{p['completed']}/{p['num_prompts']}" + ("*" if p.get("truncated") else "")
            rows.append([name, p["rate"], done, C.fmt(out_tok_s(p), 0),
                         _x(_div(out_tok_s(p), out_tok_s(b))) if b else "",
                         C.fmt(None if ttft_ms(p) is None else ttft_ms(p) / 1e3, 2),
                         _x(_div(ttft_ms(b), ttft_ms(p))) if b else "",
                         C.fmt(p.get("mean_itl_ms"), 1), C.fmt(p.get("p99_itl_ms"), 0),
                         C.fmt(p.get("preemptions"), 0), C.fmt(p.get("duration"), 1)])
        rows.append([name, "goodput", C.fmt(rec.get("goodput_rate"), 2)] + [""] * 8)
    out = C.table(["preset", "rate", "done", "out tok/s", "x dense", "TTFT s", "TTFT x lower",
                   "TBT ms", "p99 TBT ms", "preempt", "dur s"], rows)
    if any(p.get("truncated") for _, r in ordered(result) for p in r.get("points", [])):
        out += "\n* cut at the point's time cap: out tok/s counts the cut requests' tokens, " \
               "TTFT is a lower bound"
    for name, c in (result.get("comparison") or {}).items():
        if c["ttft_x_lower_best"] is None:
            ttft = "mean TTFT: no rate run by both"
        else:
            ttft = (f"mean TTFT {_x(c['ttft_x_lower_best'])}x lower at rate "
                    f"{c['ttft_x_lower_best_rate']} ({c['ttft_x_lower_best_quality']}; target >= "
                    f"{TARGETS['ttft_x_lower']}x: {_met(c['ttft_target_met'])}), "
                    f"{_x(c['ttft_x_lower_at_highest_rate'])}x at the highest rate")
        out += (f"\n{name} vs dense: saturation throughput {_x(c['saturation_throughput_x'])}x "
                f"(target >= {TARGETS['throughput_x']}x: {_met(c['throughput_target_met'])}); "
                f"{ttft}; {_goodput_text(result, name, c)}")
    if result.get("errors"):
        out += "\nerrors: " + "; ".join(f"{e['part']}: {e['error'][:120]}" for e in result["errors"])
    return out


def _met(v) -> str:
    return "n/a" if v is None else ("met" if v else "MISSED")


def plots(result: dict, path: str) -> str:
    """SparseServe's Figures 10-12 (mean TTFT, output throughput, mean TBT vs rate); `inf` is
    drawn at twice the highest finite rate."""
    plt = C.pyplot()
    finite = [rate_value(p["rate"]) for _, r in ordered(result) for p in r.get("points", [])
              if math.isfinite(rate_value(p["rate"]))]
    inf_x = 2 * max(finite) if finite else 1.0
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    metrics = ((lambda p: None if ttft_ms(p) is None else ttft_ms(p) / 1e3, "mean TTFT (s)"),
               (out_tok_s, "output tokens/s"), (lambda p: p.get("mean_itl_ms"), "mean TBT (ms)"))
    for name, rec in ordered(result):
        pts = [p for p in rec.get("points", []) if p.get("completed")]
        xs = [rate_value(p["rate"]) if math.isfinite(rate_value(p["rate"])) else inf_x for p in pts]
        for ax, (fn, _) in zip(axes, metrics):
            ys = [fn(p) for p in pts]
            ax.plot([x for x, y in zip(xs, ys) if y is not None], [y for y in ys if y is not None],
                    "o-", label=name)
    for ax, (_, title) in zip(axes, metrics):
        ax.set_xlabel(f"request rate (req/s; inf drawn at {inf_x:g})")
        ax.set_ylabel(title)
        ax.legend(fontsize=8)
    return C.save_figure(fig, path)


def ladder_plots(result: dict, path: str) -> str | None:
    """SparseServe's Figures 13, 15 and 16a from the ladder's rungs in the run (None if fewer
    than two): per rung its goodput (the highest rate meeting the SLOs; `dense` first when the
    run has it), and at the highest rate every rung ran (dense aside), output tokens/s, DRAM
    pages loaded per decode-only step, mean TTFT."""
    rungs = [(n, result["presets"][n]) for n in ORDER if n in result["presets"]]
    if len([n for n, _ in rungs if n != "dense"]) < 2:
        return None
    rates = [{rate_value(p["rate"]) for p in r.get("points", []) if p.get("completed") is not None}
             for n, r in rungs if n != "dense"]
    common = set.intersection(*rates) if all(rates) else set()
    top = max(common) if common else None
    at_top = [None if n == "dense" else
              next((p for p in r["points"] if p.get("completed") is not None
                    and rate_value(p["rate"]) == top), None) for n, r in rungs]

    def loads(p):
        d = ((p or {}).get("steps") or {}).get("decode_only") or {}
        return d.get("pages_loaded_per_step")
    panels = (("goodput (req/s)", [r.get("goodput_rate") for _, r in rungs]),
              ("output tokens/s", [out_tok_s(p) if p else None for p in at_top]),
              ("pages loaded / decode-only step", [loads(p) for p in at_top]),
              ("mean TTFT (s)", [ttft_ms(p) / 1e3 if p and ttft_ms(p) is not None else None
                                 for p in at_top]))
    plt = C.pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    names = [n.replace("sparse-offload", "SO") for n, _ in rungs]
    finite = [v for r in rates for v in r if math.isfinite(v)]
    inf_x = 2 * max(finite) if finite else 1.0
    for ax, (title, ys) in zip(axes, panels):
        vals = [0.0 if y is None else rate_value(y) for y in ys]
        vals = [v if math.isfinite(v) else inf_x for v in vals]  # a goodput of `inf`
        bars = ax.bar(range(len(names)), vals)
        if title.startswith("goodput"):
            ax.bar_label(bars, ["-" if y is None else str(y) for y in ys], fontsize=8)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(title + ("" if title.startswith("goodput") else f" at {top:g} req/s"
                              if top is not None and math.isfinite(top) else " at inf"),
                     fontsize=9)
    return C.save_figure(fig, path)


def merged(paths: list[str]) -> dict:
    """One result from several runs' JSONs (a ladder split over device commands): the presets
    of every file, a preset in two files taken from the later one, errors concatenated."""
    out: dict = {"presets": {}, "errors": [], "sources": list(paths)}
    for path in paths:
        with open(path) as f:
            r = json.load(f)
        out["presets"].update(r.get("presets", {}))
        out["errors"] += r.get("errors", [])
    return out


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="print the summary table of serving.py results")
    p.add_argument("results", nargs="+", help="serving.py JSON files")
    p.add_argument("--ladder-figure", default=None, metavar="PNG",
                   help="merge the files' presets and draw the ladder (Figures 13/15/16a)")
    a = p.parse_args(argv)
    if a.ladder_figure is None:
        for path in a.results:
            with open(path) as f:
                print(table(json.load(f)))
        return 0
    result = merged(a.results)
    result["comparison"] = compare(result)
    print(table(result))
    if ladder_plots(result, a.ladder_figure) is None:
        raise SystemExit("--ladder-figure: the files hold fewer than two rungs of the ladder "
                         f"({', '.join(LADDER_ORDER)})")
    print("wrote", a.ladder_figure)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
