"""Tensor parallelism on one host (issue 13): TP=N against TP=1 on the Llama-3-8B shape with
dummy weights, each configuration in its own child process (so one configuration's GPU
memory is gone before the next starts; the TP ranks are the child's own processes).

Parts (--only):
  equal  fp32 dummy weights, a KV cache of --equal-kv-gib per rank: the greedy tokens and
         logprobs of a few concurrent requests at TP=N against TP=1 (tokens equal, the
         largest |logprob difference| up to a request's first differing token).
  perf   bf16, the device KV cache sized the way a user gets it (gpu_memory_utilization less
         each rank's weight shard): per-rank weights and KV bytes, device pages, the KV
         capacity in tokens and the largest batch of --context + --decode-room tokens that
         fits; the median pure-decode step time at --batch requests of --context tokens;
         then the serving benchmark's loop (serving.run_point: in-process AsyncLLMEngine,
         rate inf) over --num-prompts random prompts: output throughput, peak running batch.
Targets (the issue): TP=2 holds >= 1.7x the KV tokens and serves >= 1.7x the throughput.

  # 2 GPUs (about 8 minutes): TP=2 vs TP=1, Llama-3-8B shape
  python benchmarks/tp_scaling.py --out $OUT/tp_scaling.json --tp 1,2
  # CPU smoke (tiny model, gloo)
  python benchmarks/tp_scaling.py --out /tmp/tp_scaling.json --smoke
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as C  # noqa: E402
import engine_bench as E  # noqa: E402

GiB = 1 << 30
PARTS = ("equal", "perf")
TARGET = 1.7


# ---- the child: one (part, tp) configuration ------------------------------------------------
def run_equal(a, model: str, tp: int) -> dict:
    import numpy as np

    from sparseserve import LLM, SamplingParams

    llm = LLM(model, load_format="dummy", dtype="float32", device=a.device, seed=a.seed,
              tensor_parallel_size=tp, max_model_len=a.equal_max_len,
              max_num_seqs=len(a.equal_lens), kv_cache_memory_bytes=int(a.equal_kv_gib * GiB))
    try:
        rng = np.random.default_rng(a.seed)
        prompts = [{"prompt_token_ids": E.prompt_ids(rng, n, a.vocab)} for n in a.equal_lens]
        params = SamplingParams(temperature=0.0, max_tokens=a.equal_tokens, ignore_eos=True,
                                logprobs=1)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return {"tokens": [o.outputs[0].token_ids for o in outs],
                "logprobs": [[d[t].logprob for d, t in zip(o.outputs[0].logprobs,
                                                           o.outputs[0].token_ids)]
                             for o in outs]}
    finally:
        llm.engine.shutdown()


def engine_kwargs(a, tp: int) -> dict:
    kw = dict(load_format="dummy", dtype=a.dtype, device=a.device, seed=a.seed, preset=a.preset,
              tensor_parallel_size=tp, max_model_len=a.max_model_len,
              max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
              gpu_memory_utilization=a.gpu_memory_utilization)
    if a.kv_cache_gib:
        kw["kv_cache_memory_bytes"] = int(a.kv_cache_gib * GiB)  # per rank
    if a.preset in ("sparse-offload", "sparseserve"):
        kw["kv_offloading_size"] = a.host_gib  # the total over the ranks
    return kw


def memory_plan(engine, tp: int) -> dict:
    from sparseserve.engine.args import DTYPE_BYTES
    from sparseserve.engine.memory_plan import param_count

    cfg = engine.config
    mc, cc = cfg.model, cfg.cache
    heads = mc.num_key_value_heads // tp
    pool = cc.num_host_pages if cc.kv_offload else cc.num_pages
    return {"weights_per_rank_gib": param_count(mc, tp) * DTYPE_BYTES[cfg.dtype] / GiB,
            "kv_bytes_per_rank_gib": cc.kv_cache_memory_bytes / GiB,
            "kv_heads_per_rank": heads, "device_pages_per_rank": cc.num_pages,
            "host_pages_per_rank": cc.num_host_pages,
            "kv_capacity_tokens": pool // heads * cc.page_size,
            "max_model_len": cfg.scheduler.max_model_len}


def measure_decode(a, engine) -> dict:
    """--batch requests of --context tokens prefilled, then timed pure-decode steps."""
    import numpy as np

    from sparseserve import SamplingParams

    rng = np.random.default_rng(a.seed + 1)
    params = SamplingParams(temperature=0.0, max_tokens=a.decode_warmup + a.decode_steps + 8,
                            ignore_eos=True)
    ids = [f"decode-{i}" for i in range(a.batch)]
    for rid in ids:
        engine.add_request(rid, {"prompt_token_ids": E.prompt_ids(rng, a.context, a.vocab)},
                           params)
    sched, seen, steps = engine.scheduler, set(), 0
    t0 = time.perf_counter()
    try:
        while not (len(seen) == a.batch and E.pure_decode(sched, a.batch) is not False):
            seen.update(o.request_id for o in engine.step())
            steps += 1
            if steps > 8 * a.batch * a.context + 64:
                raise RuntimeError("the batch did not reach decode (does it fit the KV cache?)")
        prefill_s = time.perf_counter() - t0
        for _ in range(a.decode_warmup):
            engine.step()
        walls, host, pure = [], [], []
        for _ in range(a.decode_steps):
            pure.append(E.pure_decode(sched, a.batch))
            t = time.perf_counter()
            engine.step()  # returns after rank 0's token copy: the step's device work is done
            walls.append(time.perf_counter() - t)
            host.append(engine.last_step_host_time_s)
    finally:
        engine.abort_request(ids)
    return {"batch": a.batch, "context": a.context, "prefill_s": prefill_s,
            "prefill_tokens_per_s": a.batch * a.context / prefill_s,
            "step_ms": C.summarize(walls, 1e3), "host_ms": C.summarize(host, 1e3),
            "pure_decode_steps": sum(1 for p in pure if p)}


def measure_serve(a, engine, deadline_s: float) -> dict:
    import serving as S

    from sparseserve.bench.serve_datasets import build_requests

    reqs = build_requests("random", a.num_prompts, a.seed, vocab_size=a.vocab,
                          max_model_len=a.max_model_len, random_input_len=a.input_len,
                          random_output_len=a.output_len)
    peak = [0]
    step = engine.step

    def counted_step():  # the AsyncLLMEngine's thread drives engine.step
        outs = step()
        peak[0] = max(peak[0], len(engine.scheduler.running))
        return outs

    engine.step = counted_step
    try:
        cap = max(10.0, min(a.serve_cap_s, deadline_s - time.perf_counter() - 15))
        point = S.run_point(engine, reqs, math.inf, cap, a.seed)
    finally:
        engine.__dict__.pop("step", None)
    keep = ("completed", "num_prompts", "truncated", "duration", "out_tok_s",
            "output_throughput", "total_output_tokens", "mean_ttft_ms", "mean_itl_ms",
            "p99_itl_ms", "preemptions", "first_error", "cap_s")
    return {**{k: point.get(k) for k in keep}, "peak_running": peak[0],
            "input_len": a.input_len, "output_len": a.output_len}


def run_perf(a, model: str, tp: int, deadline_s: float) -> dict:
    import serving as S

    from sparseserve.engine.args import EngineArgs
    from sparseserve.engine.llm_engine import LLMEngine

    kw = engine_kwargs(a, tp)
    rec: dict = {"engine_args": kw}
    t = time.perf_counter()
    engine = LLMEngine(EngineArgs(model=model, **kw))
    try:
        rec["load_s"] = time.perf_counter() - t
        rec["memory"] = plan = memory_plan(engine, tp)
        plan["max_batch_at_context"] = min(
            a.max_num_seqs, plan["kv_capacity_tokens"] // (a.context + a.decode_room))
        rec["cuda_graph_batch_sizes"] = engine.executor.graph_info()["batch_sizes"]
        t = time.perf_counter()
        S.warmup(engine, a.vocab, a.warmup_lens, 8)
        rec["warmup_s"] = time.perf_counter() - t
        rec["decode"] = measure_decode(a, engine)
        rec["serve"] = measure_serve(a, engine, deadline_s)
        ex = engine.executor
        if getattr(ex, "num_sent", 0):  # the SchedulerOutput broadcast (TP > 1)
            rec["broadcast"] = {"bytes_per_step": ex.bytes_sent_total / ex.num_sent,
                                "send_us_per_step": 1e6 * ex.send_s_total / ex.num_sent,
                                "steps": ex.num_sent}
    finally:
        engine.shutdown()
    return rec


def child_main(a) -> int:
    deadline_s = time.perf_counter() + a.child_budget_s
    if a.child == "equal":
        rec = run_equal(a, a.model, a.tp_size)
    else:
        rec = run_perf(a, a.model, a.tp_size, deadline_s)
    C.write_json(a.child_out, rec)
    return 0


# ---- the parent: children, comparison, table ------------------------------------------------
def compare_equal(ref: dict, got: dict) -> dict:
    same, worst = 0, 0.0
    for rt, gt, rl, gl in zip(ref["tokens"], got["tokens"], ref["logprobs"], got["logprobs"]):
        for x, y, lx, ly in zip(rt, gt, rl, gl):
            if x != y:
                break  # later tokens follow different histories
            same += 1
            worst = max(worst, abs(lx - ly))
    total = sum(len(t) for t in ref["tokens"])
    return {"tokens_equal": ref["tokens"] == got["tokens"], "matching_tokens": same,
            "tokens": total, "max_abs_logprob_diff": worst}


def ratio(x, y):
    return x / y if x is not None and y else None


def summarize(result: dict) -> dict:
    runs = result["runs"]
    out: dict = {}
    ref = runs.get("equal", {}).get("1")
    for tp, rec in runs.get("equal", {}).items():
        if tp != "1" and ref and "tokens" in ref and "tokens" in rec:
            out.setdefault(tp, {})["equal"] = compare_equal(ref, rec)
    p1 = runs.get("perf", {}).get("1", {})
    for tp, rec in runs.get("perf", {}).items():
        if "memory" not in rec:
            continue
        s = out.setdefault(tp, {})
        cap = rec["memory"]["kv_capacity_tokens"]
        thr = (rec.get("serve") or {}).get("out_tok_s")
        s["kv_capacity_x_tp1"] = ratio(cap, (p1.get("memory") or {}).get("kv_capacity_tokens"))
        s["throughput_x_tp1"] = ratio(thr, (p1.get("serve") or {}).get("out_tok_s"))
        if tp != "1":
            s["targets_met"] = {k: (v is not None and v >= TARGET) for k, v in
                                (("kv_capacity", s["kv_capacity_x_tp1"]),
                                 ("throughput", s["throughput_x_tp1"]))}
    return out


def table(result: dict) -> str:
    rows = []
    perf, summ = result["runs"].get("perf", {}), result["summary"]
    for tp in sorted(set(perf) | set(result["runs"].get("equal", {})), key=int):
        rec, s = perf.get(tp, {}), summ.get(tp, {})
        m, d, sv = rec.get("memory") or {}, rec.get("decode") or {}, rec.get("serve") or {}
        eq = s.get("equal")
        rows.append([f"TP={tp}", C.fmt(m.get("weights_per_rank_gib"), 2),
                     C.fmt(m.get("kv_bytes_per_rank_gib"), 1), C.fmt(m.get("kv_capacity_tokens")),
                     C.fmt(s.get("kv_capacity_x_tp1"), 2), C.fmt(m.get("max_batch_at_context")),
                     C.fmt((d.get("step_ms") or {}).get("median"), 2),
                     C.fmt(sv.get("out_tok_s"), 0),
                     C.fmt(s.get("throughput_x_tp1"), 2), C.fmt(sv.get("peak_running")),
                     "ref" if tp == "1" else ("-" if eq is None else
                                              f"{eq['matching_tokens']}/{eq['tokens']}"),
                     "-" if eq is None else f"{eq['max_abs_logprob_diff']:.1e}"])
    a = result["settings"]
    head = ["", "weights/rank GiB", "KV/rank GiB", "KV tokens", "x TP1",
            f"max batch @{a['context'] + a['decode_room']}", f"decode ms (B={a['batch']})",
            "out tok/s", "x TP1", "peak batch", "greedy = TP1", "max |dlogprob|"]
    text = C.table(head, rows) + f"\ntargets: KV capacity and throughput >= {TARGET}x TP=1"
    if result["errors"]:
        text += "\n" + E.errors_line(result["errors"])
    return text


def run_child(a, part: str, tp: int, model: str, budget_s: float, tmp: str) -> dict:
    """One configuration in a child process (its own session: on timeout the child and its
    TP ranks are killed together); its output goes to <out>.<part>-tp<N>.log."""
    import signal

    out = os.path.join(tmp, f"{part}-tp{tp}.json")
    log_path = f"{os.path.splitext(a.out)[0]}.{part}-tp{tp}.log"
    cmd = [sys.executable, os.path.abspath(__file__), *a.argv, "--child", part,
           "--tp-size", str(tp), "--child-out", out, "--model", model,
           "--child-budget-s", str(budget_s)]
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=budget_s + 60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise TimeoutError(f"child {part} tp={tp} ran past {budget_s + 60:.0f} s "
                               f"(log: {log_path})") from None
    if code != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"child {part} tp={tp} exited {code} (log: {log_path}): {tail}")
    with open(out) as f:
        return json.load(f)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    E.add_run_args(p, "JSON result path", PARTS)
    p.add_argument("--tp", default="1,2", help="tensor-parallel sizes (1 is the reference)")
    p.add_argument("--preset", default="dense")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="device KV per rank (default: what gpu_memory_utilization leaves)")
    p.add_argument("--host-gib", type=float, default=64, help="host tier in total (offload)")
    p.add_argument("--context", type=int, default=4096, help="decode timing: prompt tokens")
    p.add_argument("--decode-room", type=int, default=512,
                   help="tokens a request adds past --context (max batch that fits)")
    p.add_argument("--batch", type=int, default=64, help="decode timing: requests")
    p.add_argument("--decode-warmup", type=int, default=3)
    p.add_argument("--decode-steps", type=int, default=20)
    p.add_argument("--num-prompts", type=int, default=256, help="serving: requests (rate inf)")
    p.add_argument("--input-len", type=int, default=6000)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--serve-cap-s", type=float, default=200)
    p.add_argument("--warmup-lens", default="3000,700,1500")
    p.add_argument("--equal-lens", default="1,17,300,777")
    p.add_argument("--equal-tokens", type=int, default=16)
    p.add_argument("--equal-max-len", type=int, default=1024)
    p.add_argument("--equal-kv-gib", type=float, default=2.0)
    p.add_argument("--time-budget-s", type=float, default=540, help="the whole run")
    p.add_argument("--child", choices=PARTS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--tp-size", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-budget-s", type=float, default=600, help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    a = p.parse_args(argv)
    a.argv = argv
    a.parts = E.parse_parts(a.only, PARTS)
    a.tps = sorted({int(x) for x in E.split_list(a.tp)} | {1})
    if a.smoke:
        a.max_model_len, a.max_num_seqs, a.max_num_batched_tokens = 512, 8, 256
        a.context, a.decode_room, a.batch, a.decode_steps = 200, 40, 4, 5
        a.num_prompts, a.input_len, a.output_len, a.serve_cap_s = 8, 120, 16, 60
        a.warmup_lens, a.equal_lens, a.equal_tokens = "60", "1,17,54,97", 6
        a.equal_max_len, a.equal_kv_gib = 256, 0.01
    a.warmup_lens = [int(x) for x in E.split_list(a.warmup_lens)]
    a.equal_lens = [int(x) for x in E.split_list(a.equal_lens)]
    a.device, a.dtype = E.device_and_dtype(a)
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.child is not None:
        from sparseserve.model.loader import load_model_config, resolve_model_source
        a.vocab = load_model_config(resolve_model_source(a.model, "dummy")).vocab_size
        return child_main(a)
    deadline = C.Deadline(a.time_budget_s)
    settings = {k: v for k, v in vars(a).items() if k not in ("argv", "child", "child_out")}
    result = {"meta": C.meta(), "settings": settings, "runs": {}, "summary": {}, "errors": []}

    def save():
        result["summary"] = summarize(result)
        C.write_json(a.out, result)

    with tempfile.TemporaryDirectory() as tmp:
        model, cfg, label = C.resolve_model(a, tmp, max(a.max_model_len, a.equal_max_len))
        settings.update(model_label=label, model_config=cfg)
        jobs = [(part, tp) for part in a.parts for tp in a.tps]
        for i, (part, tp) in enumerate(jobs):
            budget = (deadline.remaining() - 10) / (len(jobs) - i)
            if budget < 30:
                E.fail(deadline, result, f"{part} tp={tp}", TimeoutError("time budget"))
                continue
            E.log(deadline, f"{part} TP={tp}: {budget:.0f} s")
            try:
                rec = run_child(a, part, tp, model, budget, tmp)
            except Exception as exc:  # noqa: BLE001 - record it, go on with the next
                rec = C.error_record(exc)
                E.fail(deadline, result, f"{part} tp={tp}", exc)
            result["runs"].setdefault(part, {})[str(tp)] = rec
            save()
    E.finish(deadline, result, save, a.out, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
