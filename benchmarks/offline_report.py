"""The output of benchmarks/offline_throughput.py: the sparseserve / transformers ratios and
the target check, the headline summary, and the text table printed last."""
from __future__ import annotations

import common as C
from engine_bench import errors_line
from offline_workloads import TARGET_RATIO_A


def finalize(result: dict) -> None:
    for name in ("a", "b"):
        r = result["results"].get(name)
        if not r:
            continue
        ss, hf = r.get("sparseserve", {}), r.get("hf", {})
        for key in ("total_tokens_per_s", "output_tokens_per_s"):
            if ss.get(key) and hf.get(key) and "error" not in hf:
                r[f"ratio_{key}"] = ss[key] / hf[key]
        if "ratio_total_tokens_per_s" in r:  # both ran every request to full length
            r["comparable"] = bool(ss.get("all_full_length") and hf.get("all_full_length"))
        if name == "a" and "ratio_total_tokens_per_s" in r:
            r["target_ratio"] = TARGET_RATIO_A
            r["meets_target"] = r["ratio_total_tokens_per_s"] >= TARGET_RATIO_A
    # the headline numbers in one place (for docs/results)
    summ: dict = {}
    for name in ("a", "b"):
        r = result["results"].get(name) or {}
        for eng in ("sparseserve", "hf"):
            summ[f"{name}_{eng}_tokens_per_s"] = r.get(eng, {}).get("total_tokens_per_s")
            summ[f"{name}_{eng}_output_tokens_per_s"] = r.get(eng, {}).get("output_tokens_per_s")
        summ[f"{name}_ratio"] = r.get("ratio_total_tokens_per_s")
    for key, rec in result["results"].get("decode_steps", {}).items():
        for b, d in rec.get("batches", {}).items():
            if "error" not in d:
                summ[f"decode_{key}_b{b}_ms"] = d["step_ms"]["mean"]
                summ[f"decode_{key}_b{b}_host_frac"] = d["host_frac"]
                summ[f"decode_{key}_b{b}_host_total_frac"] = d["host_total_frac"]
    result["summary"] = summ


def summary_table(result: dict) -> str:
    rows = []
    for name in ("a", "b"):
        r = result["results"].get(name)
        if not r:
            continue
        w = result["workloads"][name]
        label = f"{name}: {w['num_requests']}x{w['prompt_len']}/{w['output_len']}"
        for eng in ("sparseserve", "hf"):
            e = r.get(eng, {})
            rows.append([label, eng if "error" not in e else f"{eng} (error)",
                         C.fmt(e.get("wall_s"), 2), C.fmt(e.get("total_tokens_per_s"), 0),
                         C.fmt(e.get("output_tokens_per_s"), 0),
                         C.fmt(r.get("ratio_total_tokens_per_s"), 2) if eng == "hf" else ""])
    out = [C.table(["workload", "engine", "wall s", "tok/s", "out tok/s", "ss/hf"], rows)] \
        if rows else []
    rows = []
    pct = (lambda x: C.fmt(None if x is None else 100 * x, 1))
    for key, rec in result["results"].get("decode_steps", {}).items():
        if "error" in rec:
            rows.append([key, "-", "error", "", "", "", "", ""])
        for b, r in rec.get("batches", {}).items():
            if "error" in r:
                rows.append([key, b, "error", "", "", "", "", ""])
                continue
            rows.append([key, b, C.fmt(r["step_ms"]["mean"], 2), C.fmt(r["step_ms"]["median"], 2),
                         C.fmt(r["host_ms"]["mean"], 2), pct(r["host_frac"]),
                         pct(r["host_total_frac"]), f"{r['pure_decode_steps']}/{r['timed_steps']}"])
    if rows:
        out.append(C.table(["decode", "batch", "ms/step", "median", "host ms", "host %",
                            "host+eng %", "pure"], rows))
    if result["errors"]:
        out.append(errors_line(result["errors"]))
    return "\n\n".join(out)
