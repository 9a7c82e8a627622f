"""SparseServe's serving evaluation (Figures 10–13): for each preset, one engine, then a sweep
of request rates through `sparseserve bench serve`'s benchmark loop (in-process backend:
AsyncLLMEngine without HTTP, the same metric code as the HTTP path); mean TTFT, output
throughput and mean TBT (ITL) against the rate, goodput (the highest rate whose P99 TBT and
mean queueing delay meet the SLOs), and the saturation targets as ratios to `dense` measured
in the same run (definitions: serving_report.py).

  # one H200, LWM-7B shape, dummy bf16 weights, 20 GiB device KV (the command of
  # docs/results/serving.md); presets run in the order given, the table lists dense first
  python benchmarks/serving.py --out $OUT/serving_lwm7b.json --model lwm-7b \
      --presets sparseserve,dense --rates 0.5,1,2,inf --num-prompts 24 --time-budget-s 480
  # a goodput sweep: each configuration at rates around its own saturation
  python benchmarks/serving.py --out $OUT/goodput.json --model lwm-7b --presets sparseserve,dense \
      --rates-of sparseserve=1,1.5,2 --rates-of dense=0.25,0.5,0.75 --num-prompts 32
  # Figure 13's ladder (one rung per configuration; --presets lists them in order)
  python benchmarks/serving.py --out $OUT/ladder.json --model lwm-7b --rates 2 \
      --presets sparse,sparse-offload,sparse-offload+ft,sparse-offload+ft+wc,sparse-offload+ft+wc+lp
  python benchmarks/serving.py --out /tmp/serving.json --smoke        # tiny model on the CPU

Time: the run ends within --time-budget-s. Each preset gets an equal share of what is left
(so time a fast preset leaves over goes to the next), its engine build and warm-up included;
each rate point gets its arrival span (the last request's send time) plus an equal share of the rest of
its preset's time, at most --point-budget-s. At the cap the point's unfinished requests are
cut (aborted, as a server's forced shutdown does) and the point is marked `truncated`.

Needs prometheus-client (the in-process backend feeds the server's metrics object and reads
its counters: preemptions, pages loaded, queue time); nothing of the HTTP stack.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as C  # noqa: E402
import engine_bench as E  # noqa: E402
import serving_report as R  # noqa: E402
from system_run import StepRecorder, prefill_work, step_range, summarize_steps  # noqa: E402

GiB = 1 << 30
PRESETS = ("dense", "sparse", "sparse-offload", "sparseserve")
# SparseServe's ablation ladder (Figure 13): each rung adds one technique to the rung before.
# SA = sparse, +Offload = sparse-offload (per-page copies, LRU), +FT (FlashH2D, GPU-direct
# saves), +WC (working-set-aware batch control), +LP (layer-segmented prefill); the sparseserve
# preset then differs from +LP only by Spin's category LRU. name -> (preset, overrides)
_FT = dict(h2d_method="flash", d2h_method="gpu-direct")
LADDER = {
    "sparse-offload+ft": ("sparse-offload", _FT),
    "sparse-offload+ft+wc": ("sparse-offload", {**_FT, "working_set_control": True}),
    "sparse-offload+ft+wc+lp": ("sparse-offload", {**_FT, "working_set_control": True,
                                                   "layer_segmented_prefill": True}),
}
CONFIGS = {**{name: (name, {}) for name in PRESETS}, **LADDER}
POINT_KEYS = ("completed", "failed", "duration", "request_throughput", "output_throughput",
              "total_output_tokens", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
              "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_tpot_ms", "mean_e2el_ms",
              "p99_e2el_ms")


def engine_args(a, name: str, device: str, dtype: str) -> dict:
    """EngineArgs keywords of configuration `name` (a preset or a ladder step, CONFIGS)."""
    preset, overrides = CONFIGS[name]
    kw = dict(load_format="dummy", dtype=dtype, device=device, seed=a.seed, preset=preset,
              max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
              max_num_batched_tokens=a.batched_tokens_of.get(name, a.max_num_batched_tokens),
              kv_cache_memory_bytes=int(a.kv_cache_gib * GiB))
    if preset != "dense":
        kw["token_budget"] = a.token_budget
    if a.async_scheduling:
        kw["async_scheduling"] = True
    kw.update(overrides)
    if preset in ("sparse-offload", "sparseserve"):
        kw["kv_offloading_size"] = a.host_gib
        if a.d2h_method is not None:
            kw["d2h_method"] = a.d2h_method
    if a.working_set_window is not None and kw.get("working_set_control", preset == "sparseserve"):
        kw["working_set_window"] = a.working_set_window  # configurations with batch control
    return kw


def warmup(engine, vocab: int, lengths: list[int], max_tokens: int) -> None:
    """A few concurrent requests through add_request/step: Triton compilation, SDPA / cuBLAS
    heuristics, the allocator and the host tier settle before the first timed point."""
    import numpy as np

    from sparseserve.request import SamplingParams

    rng = np.random.default_rng(1)
    for i, n in enumerate(lengths):
        engine.add_request(f"warmup-{i}", {"prompt_token_ids": rng.integers(0, vocab, n).tolist()},
                           SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


class RecordingBackend:
    """The in-process backend, keeping every raw RequestResult (for the cut points' TTFT)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.results: list = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    async def read_metrics(self):
        return await self.inner.read_metrics()

    async def send(self, req):
        res = await self.inner.send(req)
        self.results.append(res)
        return res


def run_point(engine, requests: list, rate: float, cap_s: float, seed: int,
              profile_steps=()) -> dict:
    """One benchmark run at `rate`, cut at `cap_s` seconds: a point record (serving_report).
    profile_steps: indices of the point's steps whose execute runs under torch.profiler
    (diagnosis: they run slower); their summaries go in the record's "profiles"."""
    from sparseserve.bench.serve_inprocess import InProcessBackend
    from sparseserve.bench.serve_runner import arrival_offsets, arun_benchmark

    offsets = arrival_offsets(len(requests), rate, 1.0, seed)
    late = int((offsets >= cap_s).sum())  # would arrive after the cap: not sent at all
    requests = requests[:max(1, len(requests) - late)]  # offsets are prefix-consistent
    backend = RecordingBackend(InProcessBackend(engine, {"ignore_eos": True}))
    cut_at: list[float] = []

    async def go() -> dict:
        async def watchdog() -> None:
            await asyncio.sleep(cap_s)
            if backend.inner.async_engine is not None:
                cut_at.append(time.perf_counter())
                backend.inner.async_engine.cut_all()  # every stream ends with an error

        task = asyncio.create_task(watchdog())
        try:
            return await arun_benchmark(requests, backend, request_rate=rate, seed=seed,
                                        disable_tqdm=True,
                                        percentile_metrics=["ttft", "tpot", "itl", "e2el"],
                                        percentiles=[50, 90, 99])
        finally:
            task.cancel()

    t = time.perf_counter()
    with StepRecorder(engine.executor, engine.config.model.num_hidden_layers,
                      count_loads=True, profile_steps=profile_steps) as steps:
        r = asyncio.run(go())
    if engine.has_unfinished_requests():  # the shutdown aborts; make sure nothing is left
        engine.abort_request(list(engine._parents))
        while engine.has_unfinished_requests():
            engine.step()
    sm = r.get("server_metrics") or {}
    # cut: requests unfinished at the cap, or some never sent (the point ran fewer requests)
    truncated = (bool(cut_at) and r["completed"] < len(requests)) or late > 0
    gen = sm.get("generation_tokens")
    point = {"rate": "inf" if math.isinf(rate) else rate, "num_prompts": len(requests),
             "not_sent_after_cap": late, "cap_s": cap_s, "truncated": truncated,
             "wall_s": time.perf_counter() - t, **{k: r.get(k) for k in POINT_KEYS},
             "out_tok_s": gen / r["duration"] if gen is not None else r["output_throughput"],
             "mean_queue_s": sm.get("mean_queue_time_s"),
             "preemptions": sm.get("preemptions"), "pages_loaded": sm.get("pages_loaded"),
             "kv_cache_hit_rate": sm.get("kv_cache_hit_rate"), "server_metrics": sm,
             "first_error": next((e for e in r.get("errors", []) if e), None),
             "steps": summarize_steps(steps.history, engine.config.model.num_hidden_layers,
                                      r["duration"]),
             "profiles": [{"step": i, **{k: h[k] for k in ("decode", "prefill_token_layers",
                                                           "exec_s", "profile")}}
                          for i, h in enumerate(steps.history) if "profile" in h]}
    point.update(prefill_work(point["steps"], sm.get("prompt_tokens")))
    # mean TTFT over every sent request, the time until the cut standing in for a missing one
    ttfts = [(x.ttft if x.ttft is not None else x.latency) for x in backend.results]
    point["mean_ttft_lb_ms"] = 1000 * sum(ttfts) / len(ttfts) if ttfts else None
    return point


def _log_point(deadline, preset: str, p: dict) -> None:
    E.log(deadline, f"  {preset} rate {p['rate']}: {p['completed']}/{p['num_prompts']} done"
                    f"{' (cut at %.0f s)' % p['cap_s'] if p['truncated'] else ''}, "
                    f"{C.fmt(R.out_tok_s(p), 0)} out tok/s, TTFT {C.fmt(R.ttft_ms(p), 0)} ms, "
                    f"ITL p99 {C.fmt(p['p99_itl_ms'], 0)} ms, {C.fmt(p['preemptions'], 0)} "
                    f"preemptions, {p['wall_s']:.1f} s")
    st = p.get("steps")
    if st:
        d, m = st["decode_only"], st["with_prefill"]
        E.log(deadline, f"    steps: {d['steps']} decode-only ({C.fmt(d['mean_ms'], 1)} ms, "
                        f"{C.fmt(d['mean_decode_rows'], 1)} rows, "
                        f"{C.fmt(d.get('pages_loaded_per_step'), 0)} pages loaded), "
                        f"{m['steps']} with prefill "
                        f"({C.fmt(m['mean_ms'], 1)} ms, {C.fmt(m['mean_decode_rows'], 1)} rows, "
                        f"{C.fmt(m['prefill_tokens_per_s'], 0)} prefill tok/s), "
                        f"{st['outside_exec_s']:.1f} s outside execute; prompts prefilled "
                        f"{C.fmt(p.get('prefill_run_x'), 2)}x (useful "
                        f"{C.fmt(p.get('useful_prefill_tok_s'), 0)} tok/s)")


EXTRA_RUNGS = 4  # --extend-ladder probes at most this many rates past a preset's list


def run_preset(a, preset: str, model: str, vocab: int, device: str, dtype: str, deadline,
               stop_at: float, result: dict, save) -> None:
    """Build the preset's engine, warm it up, sweep the rates until `stop_at` (perf_counter)."""
    from sparseserve.bench.serve_datasets import build_requests
    from sparseserve.bench.serve_runner import arrival_offsets
    from sparseserve.engine.args import EngineArgs
    from sparseserve.engine.llm_engine import LLMEngine

    kw = engine_args(a, preset, device, dtype)
    rec = result["presets"][preset] = {"engine_args": kw, "points": []}
    E.log(deadline, f"{preset}: loading ({stop_at - time.perf_counter():.0f} s for this preset)")
    engine = None
    try:
        t = time.perf_counter()
        engine = LLMEngine(EngineArgs(model=model, **kw))
        rec["load_s"] = time.perf_counter() - t
        rec["num_slots_or_pages_per_layer"] = engine.config.cache.num_pages
        t = time.perf_counter()
        warmup(engine, vocab, a.warmup_lens, a.warmup_max_tokens)
        rec["warmup_s"] = time.perf_counter() - t
        E.log(deadline, f"  {preset}: built in {rec['load_s']:.1f} s, warm-up {rec['warmup_s']:.1f} s")
        reqs = build_requests(a.dataset_name, a.num_prompts, a.seed, tokenizer=None,
                              vocab_size=vocab, max_input_len=a.max_input_len,
                              max_model_len=a.max_model_len, random_input_len=a.random_input_len,
                              random_output_len=a.random_output_len)
        rec["prompt_tokens"] = sum(r.prompt_len for r in reqs)
        rec["max_tokens"] = sum(r.output_len for r in reqs)
        rates = list(a.rates_of.get(preset, a.rates))  # grows when --extend-ladder probes on
        max_rungs = len(rates) + EXTRA_RUNGS
        for j, rate in enumerate(rates):
            spans = [float(arrival_offsets(a.num_prompts, r, 1.0, a.seed)[-1]) for r in rates[j:]]
            left = stop_at - time.perf_counter()
            cap = spans[0] + max(0.0, left - sum(spans)) / len(spans)
            cap = min(cap, left, a.point_budget_s or math.inf)
            if cap < a.min_point_s:
                rec["points"].append({"rate": "inf" if math.isinf(rate) else rate,
                                      "skipped": f"time budget ({cap:.0f} s left)"})
                E.log(deadline, f"  {preset} rate {rate}: skipped (time budget)")
                continue
            point = run_point(engine, reqs, rate, cap, a.seed, a.profile_steps)
            rec["points"].append(point)
            _log_point(deadline, preset, point)
            save()
            if j == len(rates) - 1 and len(rates) < max_rungs:
                nxt = R.next_rung(point, R.tbt_slo_ms(result, a.tbt_slo_ms), a.queue_slo_s,
                                  a.extend_ladder)
                if nxt is not None:
                    E.log(deadline, f"  {preset}: met the SLOs at its highest rate {rate:g}; "
                                    f"probing {nxt:g} (--extend-ladder)")
                    rates.append(nxt)
    except Exception as exc:  # noqa: BLE001 - record and go on with the next preset
        E.fail(deadline, result, preset, exc)
        rec.update(C.error_record(exc))
    finally:
        if engine is not None:
            engine.shutdown()  # closes the two-tier cache (and stops any TP ranks)
        engine = None  # every reference, so the next preset starts from an empty GPU
        C.free_device_memory()
        C.empty_host_cache()
        save()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    E.add_run_args(p, "JSON result path (the figure goes next to it, .png)", list(CONFIGS))
    p.set_defaults(only=",".join(PRESETS))  # the ladder's intermediate rungs when asked for
    p.add_argument("--presets", default=None, help="alias of --only (run in this order)")
    p.add_argument("--d2h-method", default=None, choices=["flash", "gpu-direct"],
                   help="prefill saves of the offloaded presets (default: the preset's)")
    p.add_argument("--working-set-window", type=int, default=None,
                   help="decode steps of the working-set window of `sparseserve` (the preset with "
                        "working-set control; the engine default when unset)")
    p.add_argument("--rates", default="0.5,1,2,inf", help="comma list of request rates (req/s; inf)")
    p.add_argument("--rates-of", action="append", default=[], metavar="NAME=R1,R2",
                   help="rates of one configuration instead of --rates (repeatable): a goodput "
                        "sweep probes dense below its saturation and sparseserve around its own")
    p.add_argument("--batched-tokens-of", action="append", default=[], metavar="NAME=N",
                   help="--max-num-batched-tokens of one configuration (repeatable): each engine "
                        "at the step budget it serves best, e.g. sparseserve=4096")
    p.add_argument("--async-scheduling", action="store_true",
                   help="every configuration launches step N + 1 before reading step N's tokens "
                        "(the engine's --async-scheduling; off: vLLM's default)")
    p.add_argument("--num-prompts", type=int, default=24)
    E.add_workload_args(p)
    p.add_argument("--tbt-slo-ms", type=float, default=None,
                   help="P99 TBT SLO (default 25x the dense preset's mean TBT at its lowest rate)")
    p.add_argument("--queue-slo-s", type=float, default=2.0)
    p.add_argument("--extend-ladder", type=float, default=None, metavar="FACTOR",
                   help="after a configuration's rates, while its highest point met both SLOs, "
                        f"probe FACTOR x that rate (up to {EXTRA_RUNGS} more): a goodput is "
                        "measured only once a higher rate misses. Needs the TBT SLO before the "
                        "ladders: --tbt-slo-ms, or dense first in --presets")
    p.add_argument("--time-budget-s", type=float, default=480, help="the whole run")
    p.add_argument("--profile-steps", type=step_range, default=[], metavar="A:B[,C:D]",
                   help="step indices of each point run under torch.profiler (diagnosis: they "
                        "run slower; summaries in the point's 'profiles')")
    p.add_argument("--point-budget-s", type=float, default=None, help="cap of one rate point")
    p.add_argument("--min-point-s", type=float, default=10.0,
                   help="skip a point whose cap would be shorter")
    p.add_argument("--reserve-s", type=float, default=10.0,
                   help="kept at the end for the report")
    p.add_argument("--warmup-lens", default="3000,5000,700,1500",
                   help="prompt lengths of the warm-up requests")
    p.add_argument("--warmup-max-tokens", type=int, default=40)
    a = p.parse_args(argv)
    a.names = E.parse_parts(a.presets or a.only, list(CONFIGS))
    a.rates = [float(x) for x in E.split_list(a.rates)]
    if a.smoke:
        a.dataset_name, a.num_prompts = "random", 6
        if a.rates == [0.5, 1.0, 2.0, math.inf]:
            a.rates = [2.0, math.inf]
        a.random_input_len, a.random_output_len = 200, 8
        a.max_input_len, a.max_model_len, a.max_num_batched_tokens = 512, 1024, 128
        a.kv_cache_gib, a.host_gib, a.token_budget = 0.004, 0.05, 128
        a.warmup_lens, a.warmup_max_tokens, a.min_point_s = "100,300", 4, 0.0
    a.warmup_lens = [int(x) for x in E.split_list(a.warmup_lens)]
    a.rates_of = {name: [float(x) for x in E.split_list(v)]
                  for name, v in E.per_config(a.rates_of, a.names, "--rates-of", "R1,R2").items()}
    a.batched_tokens_of = E.per_config(a.batched_tokens_of, a.names, "--batched-tokens-of", "N")
    for name, v in a.batched_tokens_of.items():  # at parse time, not after the others ran
        if not v.isdigit() or int(v) < 1:
            raise SystemExit(f"--batched-tokens-of {name}={v}: N must be an integer >= 1")
        a.batched_tokens_of[name] = int(v)
    if any(not r > 0 for rs in (a.rates, *a.rates_of.values()) for r in rs):
        raise SystemExit("--rates / --rates-of: every rate must be > 0 (or inf)")
    if a.extend_ladder is not None:
        if not a.extend_ladder > 1:
            raise SystemExit(f"--extend-ladder {a.extend_ladder:g}: the factor must be > 1")
        if not a.tbt_slo_ms and a.names[0] != "dense":
            raise SystemExit("--extend-ladder needs the TBT SLO before the ladders run: pass "
                             "--tbt-slo-ms, or put dense first in --presets (its lowest rate "
                             "sets the SLO)")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    device, dtype = E.device_and_dtype(a)
    deadline = C.Deadline(a.time_budget_s)
    settings = {k: v for k, v in vars(a).items() if k != "names"}
    settings["rates"] = ["inf" if math.isinf(r) else r for r in a.rates]
    settings["rates_of"] = {k: ["inf" if math.isinf(r) else r for r in v]
                            for k, v in a.rates_of.items()}
    result = {"meta": C.meta(argv), "settings": {**settings, "presets": a.names, "device": device,
                                                 "dtype": dtype},
              "presets": {}, "errors": []}

    def save():
        C.write_json(a.out, result)

    with tempfile.TemporaryDirectory() as tmp:
        model, cfg, label = C.resolve_model(a, tmp, a.max_model_len)
        result["settings"]["model_label"] = label
        result["settings"]["model_config"] = cfg
        for i, name in enumerate(a.names):
            share = (deadline.remaining() - a.reserve_s) / (len(a.names) - i)
            if share < a.min_point_s + 5:
                result["presets"][name] = {"skipped": "time budget", "points": []}
                E.log(deadline, f"{name}: skipped (time budget)")
                continue
            run_preset(a, name, model, cfg["vocab_size"], device, dtype, deadline,
                       time.perf_counter() + share, result, save)
    slo = R.tbt_slo_ms(result, a.tbt_slo_ms) or math.inf
    result["settings"]["tbt_slo_ms_used"] = slo
    for rec in result["presets"].values():
        rec["goodput_rate"] = R.goodput(rec.get("points") or [], slo, a.queue_slo_s)
    result["comparison"] = R.compare(result)
    try:
        result["figure"] = R.plots(result, os.path.splitext(a.out)[0] + ".png")
        ladder = R.ladder_plots(result, os.path.splitext(a.out)[0] + "_ladder.png")
        if ladder is not None:
            result["ladder_figure"] = ladder
    except Exception as exc:  # noqa: BLE001 - a missing plot must not lose the numbers
        E.fail(deadline, result, "plots", exc)
    E.finish(deadline, result, save, a.out, R.table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
