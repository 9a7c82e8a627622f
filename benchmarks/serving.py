"""SparseServe's serving evaluation (Figures 10–12): for each preset, one engine, then a sweep
of request rates through `sparseserve bench serve`'s benchmark loop (in-process backend:
AsyncLLMEngine without HTTP, the same metric code as the HTTP path); mean TTFT, output
throughput and mean TBT (ITL) against the rate, and goodput (the highest rate whose P99 TBT
and mean queueing delay meet the SLOs). Ratios are to `dense` at the same rate, same run.

  python benchmarks/serving.py --out $OUT/serving.json --model lwm-7b --presets dense,sparseserve \
      --rates 0.5,1,2,4 --num-prompts 64 --max-input-len 32768
  python benchmarks/serving.py --out /tmp/serving.json --smoke        # tiny model on the CPU

On the GPU machine prometheus-client must travel as a wheel (the in-process backend feeds the
server's metrics object).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as C  # noqa: E402
import engine_bench as E  # noqa: E402

GiB = 1 << 30
PRESETS = ("dense", "sparse", "sparse-offload", "sparseserve")


def engine_args(a, preset: str, device: str, dtype: str) -> dict:
    kw = dict(load_format="dummy", dtype=dtype, device=device, seed=a.seed, preset=preset,
              max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
              max_num_batched_tokens=a.max_num_batched_tokens,
              kv_cache_memory_bytes=int(a.kv_cache_gib * GiB))
    if preset != "dense":
        kw["token_budget"] = a.token_budget
    if preset in ("sparse-offload", "sparseserve"):
        kw["kv_offloading_size"] = a.host_gib
    return kw


def goodput(points: list[dict], tbt_slo_ms: float, queue_slo_s: float) -> float | None:
    """The highest rate whose P99 ITL and mean queueing delay (TTFT minus prefill is not
    separable from outside; the server's queue-time histogram is) meet the SLOs."""
    ok = [p["rate"] for p in points
          if (p.get("p99_itl_ms") or 0) <= tbt_slo_ms
          and (p.get("mean_queue_s") if p.get("mean_queue_s") is not None else 0) <= queue_slo_s]
    return max(ok) if ok else None


def run_preset(a, preset: str, model: str, vocab: int, device: str, dtype: str, deadline,
               result: dict, save) -> None:
    from sparseserve.bench.serve_datasets import build_requests
    from sparseserve.bench.serve_inprocess import InProcessBackend
    from sparseserve.bench.serve_runner import run_benchmark
    from sparseserve.engine.args import EngineArgs
    from sparseserve.engine.llm_engine import LLMEngine

    kw = engine_args(a, preset, device, dtype)
    rec = result["presets"][preset] = {"engine_args": kw, "points": []}
    E.log(deadline, f"{preset}: loading")
    engine = None
    try:
        engine = LLMEngine(EngineArgs(model=model, **kw))
        for rate in a.rates:
            if deadline.expired(60):
                E.log(deadline, f"  {preset} rate {rate}: skipped (time budget)")
                break
            reqs = build_requests(a.dataset_name, a.num_prompts, a.seed, tokenizer=None,
                                  vocab_size=vocab, max_input_len=a.max_input_len,
                                  max_model_len=a.max_model_len,
                                  random_input_len=a.random_input_len,
                                  random_output_len=a.random_output_len)
            t = time.perf_counter()
            r = run_benchmark(reqs, InProcessBackend(engine, {"ignore_eos": True}),
                              request_rate=rate, seed=a.seed, disable_tqdm=True,
                              percentile_metrics=["ttft", "tpot", "itl", "e2el"],
                              percentiles=[50, 90, 99])
            sm = r.get("server_metrics") or {}
            point = {"rate": rate, "wall_s": time.perf_counter() - t,
                     **{k: r.get(k) for k in (
                         "completed", "failed", "duration", "request_throughput",
                         "output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms",
                         "p99_itl_ms", "mean_tpot_ms", "mean_e2el_ms")},
                     "mean_queue_s": sm.get("mean_queue_time_s"),
                     "server_metrics": sm}
            rec["points"].append(point)
            E.log(deadline, f"  {preset} rate {rate}: {point['output_throughput']:.0f} out tok/s, "
                            f"TTFT {point['mean_ttft_ms']:.0f} ms, ITL p99 "
                            f"{point['p99_itl_ms']:.0f} ms")
            save()
    except Exception as exc:  # noqa: BLE001 - record and go on with the next preset
        E.fail(deadline, result, preset, exc)
        rec.update(C.error_record(exc))
    finally:
        if engine is not None and engine.runner.offload is not None:
            engine.runner.offload.close()
        engine = None
        C.free_device_memory()
        save()


def plots(result: dict, path: str) -> None:
    plt = C.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, rec in result["presets"].items():
        pts = rec.get("points") or []
        if not pts:
            continue
        rates = [p["rate"] for p in pts]
        axes[0].plot(rates, [p["mean_ttft_ms"] / 1e3 for p in pts], "o-", label=name)
        axes[1].plot(rates, [p["output_throughput"] for p in pts], "o-", label=name)
        axes[2].plot(rates, [p["mean_itl_ms"] for p in pts], "o-", label=name)
    for ax, t in zip(axes, ("mean TTFT (s)", "output tokens/s", "mean TBT (ms)")):
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(t)
        ax.legend(fontsize=8)
    C.save_figure(fig, path)


def table(result: dict) -> str:
    rows = []
    base = {p["rate"]: p for p in result["presets"].get("dense", {}).get("points", [])}
    for name, rec in result["presets"].items():
        for p in rec.get("points", []):
            b = base.get(p["rate"])
            rows.append([name, p["rate"], p["completed"], C.fmt(p["output_throughput"], 0),
                         C.fmt(p["output_throughput"] / b["output_throughput"], 2) if b else "",
                         C.fmt(p["mean_ttft_ms"] / 1e3, 2),
                         C.fmt(b["mean_ttft_ms"] / p["mean_ttft_ms"], 2) if b else "",
                         C.fmt(p["mean_itl_ms"], 1), C.fmt(p["p99_itl_ms"], 0)])
        rows.append([name, "goodput", C.fmt(rec.get("goodput_rate"), 2), "", "", "", "", "", ""])
    out = C.table(["preset", "rate", "done", "out tok/s", "x dense", "TTFT s", "TTFT x lower",
                   "TBT ms", "p99 TBT ms"], rows)
    if result["errors"]:
        out += "\n" + E.errors_line(result["errors"])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    E.add_run_args(p, "JSON result path", list(PRESETS))
    p.add_argument("--presets", default=None, help="alias of --only")
    p.add_argument("--rates", default="0.5,1,2,4", help="comma list of request rates (req/s)")
    p.add_argument("--dataset-name", default="longbench", choices=["longbench", "random"])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-input-len", type=int, default=32768)
    p.add_argument("--max-model-len", type=int, default=33792)
    p.add_argument("--random-input-len", type=int, default=8192)
    p.add_argument("--random-output-len", type=int, default=256)
    p.add_argument("--kv-cache-gib", type=float, default=20)
    p.add_argument("--host-gib", type=float, default=64)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--token-budget", type=int, default=2048)
    p.add_argument("--tbt-slo-ms", type=float, default=None,
                   help="P99 TBT SLO (default 25x the dense preset's median TBT at the lowest rate)")
    p.add_argument("--queue-slo-s", type=float, default=2.0)
    p.add_argument("--time-budget-s", type=float, default=560)
    a = p.parse_args(argv)
    names = E.parse_parts(a.presets or a.only, list(PRESETS))
    a.rates = [float(x) for x in E.split_list(a.rates)]
    device, dtype = E.device_and_dtype(a)
    if a.smoke:
        a.dataset_name, a.num_prompts, a.rates = "random", 6, [2.0, float("inf")]
        a.random_input_len, a.random_output_len = 200, 8
        a.max_input_len, a.max_model_len, a.max_num_batched_tokens = 512, 1024, 128
        a.kv_cache_gib, a.host_gib, a.token_budget = 0.004, 0.05, 128
    deadline = C.Deadline(a.time_budget_s)
    result = {"meta": C.meta(argv), "settings": {**vars(a), "device": device}, "presets": {},
              "errors": []}

    def save():
        C.write_json(a.out, result)

    with tempfile.TemporaryDirectory() as tmp:
        model, cfg, label = C.resolve_model(a, tmp, a.max_model_len)
        result["settings"]["model_label"] = label
        for name in names:
            if deadline.expired(60):
                break
            run_preset(a, name, model, cfg["vocab_size"], device, dtype, deadline, result, save)
    dense = result["presets"].get("dense", {}).get("points") or []
    slo = a.tbt_slo_ms or (25 * dense[0]["mean_itl_ms"] if dense else float("inf"))
    result["settings"]["tbt_slo_ms_used"] = slo
    for rec in result["presets"].values():
        rec["goodput_rate"] = goodput(rec.get("points") or [], slo, a.queue_slo_s)
    fig = os.path.splitext(a.out)[0] + ".png"
    plots(result, fig)
    result["figure"] = fig
    E.finish(deadline, result, save, a.out, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
