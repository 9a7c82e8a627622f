"""Offline throughput of the dense engine vs Hugging Face transformers, and decode step time.

    python benchmarks/offline_throughput.py --out DIR [--smoke] [--only a,b,steps] [--skip-hf]

Llama-3-8B shape, dummy bf16 weights, dense attention, random prompt token ids (fixed seed),
greedy, ignore_eos (every request generates exactly its output length):
  a      64 requests x 4096-token prompts / 256 output tokens
  b       8 requests x 32768-token prompts / 128 output tokens
  steps  decode ms/step at batch 1, 8, 32 (context 4096): prefill the batch, then time steps
         in which every request decodes; host (Python) time per step from the engine's
         `last_step_host_time_s` (runner: prepare + launch) and the engine's own overhead
         (schedule + update + outputs = step wall time - runner.execute wall time); with the
         engine's defaults (CUDA graphs when the runner has them) and with enforce_eager=True.
For a and b, in the same run: transformers `generate` (SDPA, static cache, greedy,
min_new_tokens = max_new_tokens) on the same prompts, and the ratio sparseserve / HF.

Writes DIR/offline_throughput.json (rewritten after every part, so a run cut short still
leaves what it measured) and prints a table last. `--smoke`: a tiny 2-layer model on the CPU
with tiny workloads, exercising every path in well under a minute (used by the tests).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

import common as C  # noqa: E402
import numpy as np  # noqa: E402

PARTS = ("a", "b", "steps")
TARGET_RATIO_A = 2.0  # issue 2: >= 2x transformers' throughput on workload a
TARGET_HOST_FRAC = 0.10  # issue 2: host time < 10% of the decode step at batch 32


@dataclass(frozen=True)
class Workload:
    name: str
    num_requests: int
    prompt_len: int
    output_len: int
    max_num_batched_tokens: int  # sparseserve's per-step token budget (chunked prefill)

    @property
    def max_model_len(self) -> int:
        return self.prompt_len + self.output_len


def workloads(smoke: bool, batched_tokens: int | None) -> dict[str, Workload]:
    if smoke:
        ws = [Workload("a", 4, 64, 8, 128), Workload("b", 2, 256, 4, 128)]
    else:
        ws = [Workload("a", 64, 4096, 256, 16384), Workload("b", 8, 32768, 128, 16384)]
    if batched_tokens:
        ws = [Workload(w.name, w.num_requests, w.prompt_len, w.output_len, batched_tokens)
              for w in ws]
    return {w.name: w for w in ws}


def log(deadline: C.Deadline, msg: str) -> None:
    print(f"[{deadline.elapsed():7.1f}s] {msg}", flush=True)


# ---- model ----------------------------------------------------------------------------------
def kv_bytes_per_token(cfg: dict, dtype_bytes: int) -> int:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes


def kv_cache_bytes(cfg: dict, dtype_bytes: int, num_seqs: int, max_len: int,
                   page_size: int = 32) -> int:
    """KV bytes for `num_seqs` sequences of `max_len` tokens, page-rounded, plus 5% + 64 pages
    of slack, so a workload never preempts."""
    tokens = num_seqs * (-(-max_len // page_size) * page_size) + 64 * page_size
    return int(tokens * kv_bytes_per_token(cfg, dtype_bytes) * 1.05)


def make_prompts(rng: np.random.Generator, n: int, length: int, vocab: int) -> np.ndarray:
    return rng.integers(0, vocab, size=(n, length), dtype=np.int64)


# ---- sparseserve ----------------------------------------------------------------------------
def make_llm(model: str, setup: dict, max_len: int, num_seqs: int, batched: int, kv_bytes: int,
             enforce_eager: bool, seed: int):
    import dataclasses

    from sparseserve import LLM
    from sparseserve.engine.args import EngineArgs

    kw = dict(load_format="dummy", dtype=setup["dtype"], device=setup["device"],
              max_model_len=max_len, max_num_seqs=num_seqs, max_num_batched_tokens=batched,
              kv_cache_memory_bytes=kv_bytes, enforce_eager=enforce_eager, seed=seed)
    if "sparse_algorithm" in {f.name for f in dataclasses.fields(EngineArgs)}:
        kw["sparse_algorithm"] = "dense"  # this benchmark measures the dense engine
    t0 = time.perf_counter()
    llm = LLM(model, **kw)
    C.synchronize()
    eng = llm.engine
    graphs = getattr(eng.runner, "graphs", None)
    info = {"engine_args": kw, "load_s": time.perf_counter() - t0,
            "num_pages": eng.config.cache.num_pages,
            "max_model_len": eng.config.scheduler.max_model_len,
            # decode CUDA graphs the runner captured (None: it runs eagerly)
            "cuda_graph_batch_sizes": (list(getattr(graphs, "sizes", None) or [])
                                       if graphs is not None else None)}
    return llm, info


def warmup(llm, w: Workload, vocab: int) -> None:
    """A short version of the workload before timing: as many requests, prompts long enough
    to need chunking, and staggered lengths (34 + i tokens, past a page boundary), so decode
    runs at every batch size from n down to 1. Triton compilation, CUDA graphs captured on
    first use, cuBLAS/SDPA heuristics and the allocator all settle here, not in the timed run."""
    from sparseserve import SamplingParams

    rng = np.random.default_rng(1)
    n = w.num_requests
    length = min(w.prompt_len, max(16, w.max_num_batched_tokens * 5 // 4 // n))
    prompts = [{"prompt_token_ids": rng.integers(0, vocab, length).tolist()} for _ in range(n)]
    params = [SamplingParams(temperature=0.0, max_tokens=34 + i, ignore_eos=True)
              for i in range(n)]
    llm.generate(prompts, params, use_tqdm=False)


def run_offline(engine, prompts: np.ndarray, output_len: int, stop_at: float,
                device: str) -> dict:
    """Add every request, then step until all finish (what LLM.generate does, plus per-step
    records and a deadline). Tokens/s count prompt + output tokens over the wall time."""
    from sparseserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    n, p = prompts.shape
    ids = [f"bench-{i}" for i in range(n)]
    started, produced = set(), {}
    steps, host_s, all_started_s, truncated = 0, 0.0, None, False
    preempt0 = engine.get_stats().get("num_preemptions_total", 0)
    C.synchronize(device)
    t0 = time.perf_counter()
    for rid, row in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": row.tolist()}, params)
    while engine.has_unfinished_requests():
        if time.perf_counter() > stop_at:
            engine.abort_request(ids)
            truncated = True
            break
        for out in engine.step():
            started.add(out.request_id)
            produced[out.request_id] = len(out.outputs[0].token_ids)
        steps += 1
        host_s += engine.last_step_host_time_s
        if all_started_s is None and len(started) == n:
            all_started_s = time.perf_counter() - t0
    C.synchronize(device)
    wall = time.perf_counter() - t0
    out_tokens = sum(produced.values())
    return {
        "wall_s": wall, "num_steps": steps,
        "prompt_tokens": n * p, "output_tokens": out_tokens,
        "total_tokens_per_s": (n * p + out_tokens) / wall,
        "output_tokens_per_s": out_tokens / wall,
        "requests_per_s": n / wall,
        "time_to_all_first_tokens_s": all_started_s,  # ~ the prefill phase
        "host_time_s_total": host_s, "host_frac_of_wall": host_s / wall,
        "all_full_length": (not truncated and len(produced) == n
                            and all(v == output_len for v in produced.values())),
        "truncated_by_time_budget": truncated,
        "num_preemptions": engine.get_stats().get("num_preemptions_total", 0) - preempt0,
    }


def _pure_decode(sched, batch: int) -> bool | None:
    try:
        return (not sched.waiting and len(sched.running) == batch and all(
            r.num_tokens - r.num_computed_tokens == 1 and getattr(r, "prefill_layer", 0) == 0
            for r in sched.running))
    except AttributeError:
        return None  # the scheduler changed shape: cannot verify


def bench_decode(engine, batch: int, ctx: int, warm: int, steps: int, vocab: int,
                 seed: int, stop_at: float) -> dict:
    """Prefill `batch` requests of `ctx` tokens, then time `steps` pure decode steps."""
    from sparseserve import SamplingParams

    rng = np.random.default_rng(seed + batch)
    params = SamplingParams(temperature=0.0, max_tokens=warm + steps + 8, ignore_eos=True)
    ids = [f"decode-{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, {"prompt_token_ids": rng.integers(0, vocab, ctx).tolist()}, params)
    sched, runner = engine.scheduler, engine.runner
    exec_times: list[float] = []
    original = runner.execute

    def timed_execute(out):  # instance-level wrapper: runner wall time of this step
        t = time.perf_counter()
        res = original(out)
        exec_times.append(time.perf_counter() - t)
        return res

    step_s, host_s, pure = [], [], []
    try:
        seen: set[str] = set()  # requests that produced their first token
        for _ in range(4 * ctx + 16):  # prefill (chunked) until every request decodes
            if len(seen) == batch and _pure_decode(sched, batch) is not False:
                break
            seen.update(o.request_id for o in engine.step())
        else:
            raise RuntimeError(f"batch {batch}: requests did not all reach decode")
        for _ in range(warm):
            engine.step()
        runner.execute = timed_execute
        for _ in range(steps):
            if time.perf_counter() > stop_at:
                break
            pure.append(_pure_decode(sched, batch))
            t = time.perf_counter()
            engine.step()
            step_s.append(time.perf_counter() - t)
            host_s.append(engine.last_step_host_time_s)
    finally:
        runner.__dict__.pop("execute", None)
        engine.abort_request(ids)
    overhead = [s - e for s, e in zip(step_s, exec_times)] if len(exec_times) == len(step_s) \
        else []
    mean_step = float(np.mean(step_s)) if step_s else float("nan")
    res = {
        "batch": batch, "context_len_start": ctx + warm, "timed_steps": len(step_s),
        "pure_decode_steps": sum(1 for p in pure if p), "pure_decode_verified": None not in pure,
        "step_ms": C.summarize(step_s, 1e3), "host_ms": C.summarize(host_s, 1e3),
        "execute_ms": C.summarize(exec_times, 1e3),
        "engine_overhead_ms": C.summarize(overhead, 1e3),
        "host_frac": float(np.mean(host_s)) / mean_step if step_s else None,
        "host_total_frac": (float(np.mean(host_s)) + float(np.mean(overhead))) / mean_step
        if overhead else None,
        "output_tokens_per_s": batch / mean_step if step_s else None,
    }
    res["meets_host_target"] = res["host_frac"] is not None and res["host_frac"] < TARGET_HOST_FRAC
    return res


def _engine_plan(name: str, ws: dict, setup: dict, batched: int | None) -> dict:
    """Engine sizing for a part: workload a's engine also serves the decode-step bench (its
    KV and rows cover both), so `--only steps` measures the same engine as a full run."""
    w = ws["a" if name.startswith("steps") else name]
    d = setup["decode"]
    do_steps = name.startswith("steps") or (name == "a" and "steps" in setup["parts"])
    max_len, seqs = w.max_model_len, w.num_requests
    if do_steps:
        max_len = max(max_len, d["context"] + d["warmup"] + d["steps"] + 16)
        seqs = max(seqs, max(d["batches"]))
    return {"workload": w, "throughput": name in ("a", "b"), "steps": do_steps,
            "max_len": max_len, "seqs": seqs,
            "batched": batched or w.max_num_batched_tokens,
            "kv_bytes": kv_cache_bytes(setup["cfg"], setup["dtype_bytes"], seqs, max_len)}


def sparseserve_part(name: str, model: str, setup: dict, args, ws: dict,
                     deadline: C.Deadline, result: dict, save, batched: int | None = None) -> None:
    """One engine: throughput of workload `name` ("a"/"b") and/or the decode-step bench
    ("steps" on workload a's engine; "steps-eager" the same with enforce_eager=True)."""
    cfg, eager = setup["cfg"], name == "steps-eager"
    plan = _engine_plan(name, ws, setup, batched)
    w = plan["workload"]
    res = result["results"]
    steps_key = "eager" if eager else "default"
    log(deadline, f"sparseserve {name}: loading engine (max_model_len={plan['max_len']}, "
                  f"max_num_seqs={plan['seqs']}, max_num_batched_tokens={plan['batched']}, "
                  f"kv={plan['kv_bytes'] / 2**30:.1f} GiB)")
    llm, retry = None, False
    try:
        try:
            llm, info = make_llm(model, setup, plan["max_len"], plan["seqs"], plan["batched"],
                                 plan["kv_bytes"], eager, args.seed)
            log(deadline, f"  loaded in {info['load_s']:.1f}s; warming up")
            warmup(llm, w, cfg["vocab_size"])
        except Exception as exc:  # noqa: BLE001 - record, go on with the other parts
            _fail(deadline, result, f"sparseserve-{name}-load", exc)
            if plan["throughput"]:
                res[name]["sparseserve"] = C.error_record(exc)
            if plan["steps"]:
                res["decode_steps"][steps_key] = C.error_record(exc)
            return
        if plan["throughput"]:
            rec = {"engine": info}
            try:
                stop_at = time.perf_counter() + max(deadline.remaining() - 20, 5)
                prompts = make_prompts(np.random.default_rng(args.seed), w.num_requests,
                                       w.prompt_len, cfg["vocab_size"])
                with C.peak_memory(rec):
                    rec.update(run_offline(llm.engine, prompts, w.output_len, stop_at,
                                           setup["device"]))
                log(deadline, f"  {name}: {rec['wall_s']:.2f}s, "
                              f"{rec['total_tokens_per_s']:,.0f} tok/s total, "
                              f"{rec['output_tokens_per_s']:,.0f} out tok/s")
            except Exception as exc:  # noqa: BLE001
                _fail(deadline, result, f"sparseserve-{name}", exc)
                rec.update(C.error_record(exc))
                # out of memory in a chunked prefill: retry once, a whole prompt per step
                retry = C.is_oom(exc) and plan["batched"] < w.prompt_len and batched is None
                try:
                    llm.engine.abort_request([f"bench-{i}" for i in range(w.num_requests)])
                except Exception:  # noqa: BLE001
                    pass
            if batched is not None and "sparseserve" in res[name]:  # this is the retry
                res[name]["sparseserve_first_attempt"] = res[name]["sparseserve"]
            res[name]["sparseserve"] = rec
            save()
        if plan["steps"]:
            rec = {"engine": info, "batches": {}}
            res["decode_steps"][steps_key] = rec
            d = setup["decode"]
            for b in d["batches"]:
                try:
                    stop_at = time.perf_counter() + max(deadline.remaining() - 20, 5)
                    r = bench_decode(llm.engine, b, d["context"], d["warmup"], d["steps"],
                                     cfg["vocab_size"], args.seed, stop_at)
                    log(deadline, f"  decode[{steps_key}] batch {b}: "
                                  f"{r['step_ms']['mean']:.2f} ms/step, "
                                  f"host {100 * (r['host_frac'] or 0):.1f}%")
                except Exception as exc:  # noqa: BLE001
                    _fail(deadline, result, f"sparseserve-{name}-batch{b}", exc)
                    r = C.error_record(exc)
                rec["batches"][str(b)] = r
                save()
    finally:
        del llm
        mem = C.free_device_memory()
        if mem:
            result.setdefault("memory_after_free", {})[name] = mem
    if retry and not deadline.expired(60):
        log(deadline, f"  retrying {name} with max_num_batched_tokens={w.prompt_len}")
        sparseserve_part(name, model, setup, args, ws, deadline, result, save, w.prompt_len)


def _fail(deadline: C.Deadline, result: dict, part: str, exc: BaseException) -> None:
    log(deadline, f"  {part} FAILED: {type(exc).__name__}: {str(exc)[:300]}")
    result["errors"].append({"part": part, **C.error_record(exc)})


# ---- Hugging Face transformers --------------------------------------------------------------
def hf_part(cfg: dict, setup: dict, args, ws: dict, deadline: C.Deadline, result: dict,
            save) -> None:
    import transformers

    names = [n for n in ("a", "b") if n in setup["parts"]]
    model = None
    try:
        log(deadline, "transformers: building the model (random init)")
        t0 = time.perf_counter()
        model = C.hf_load(cfg, setup["device"], setup["dtype"],
                          max(ws[n].max_model_len for n in names))
        C.synchronize()
        load_s = time.perf_counter() - t0
        ids = np.random.default_rng(1).integers(0, cfg["vocab_size"], (2, 32))
        C.hf_generate(model, ids, 2, 2, setup["device"], False, 60.0)  # warm-up
    except Exception as exc:  # noqa: BLE001
        log(deadline, f"  transformers load FAILED: {type(exc).__name__}: {exc}")
        result["errors"].append({"part": "hf-load", **C.error_record(exc)})
        for n in names:
            result["results"][n]["hf"] = C.error_record(exc)
        names, load_s = [], None
    for name in names:
        w = ws[name]
        rec = {"load_s": load_s, "transformers": transformers.__version__,
               "settings": {"attn_implementation": "sdpa", "cache_implementation": "static",
                            "do_sample": False, "min_new_tokens": w.output_len,
                            "torch_compile": args.hf_compile}, "attempts": []}
        result["results"][name]["hf"] = rec
        if deadline.expired(30):
            rec["error"] = "skipped: time budget used up"
            continue
        prompts = make_prompts(np.random.default_rng(args.seed), w.num_requests,
                               w.prompt_len, cfg["vocab_size"])
        batch = min(args.hf_batch or w.num_requests, w.num_requests)
        while batch >= 1:
            err = None
            try:
                with C.peak_memory(rec):
                    if args.hf_compile:  # first run compiles; the second is timed
                        first = C.hf_generate(model, prompts, w.output_len, batch, setup["device"],
                                            True, max(deadline.remaining() - 20, 5))
                        rec["first_run_wall_s"] = first["wall_s"]
                    r = C.hf_generate(model, prompts, w.output_len, batch, setup["device"],
                                    args.hf_compile, max(deadline.remaining() - 20, 5))
                rec.update(r, batch_size=batch, truncated_by_time_budget=not r["all_full_length"])
                rec.pop("error", None)
                log(deadline, f"  transformers {name} (batch {batch}): {r['wall_s']:.2f}s, "
                              f"{r['total_tokens_per_s']:,.0f} tok/s total, "
                              f"{r['output_tokens_per_s']:,.0f} out tok/s")
                break
            except Exception as exc:  # noqa: BLE001
                err = C.error_record(exc)
                oom = C.is_oom(exc)
            rec["attempts"].append({"batch_size": batch, "error": err["error"]})
            C.free_device_memory()
            log(deadline, f"  transformers {name} batch {batch} failed: {err['error'][:200]}")
            if not oom or deadline.expired(30):
                rec.update(err)
                result["errors"].append({"part": f"hf-{name}", **err})
                break
            batch //= 2  # out of memory: same requests in smaller batches
        else:
            rec["error"] = "out of memory at every batch size"
        save()
    del model
    C.free_device_memory()


# ---- report ---------------------------------------------------------------------------------
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
        out.append("errors: " + "; ".join(f"{e['part']}: {e['error'][:120]}"
                                          for e in result["errors"]))
    return "\n\n".join(out)


# ---- main -----------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for offline_throughput.json")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, tiny workloads")
    p.add_argument("--only", default=",".join(PARTS), help="comma list of a, b, steps")
    p.add_argument("--skip-hf", action="store_true", help="no transformers comparison")
    p.add_argument("--model", default=None, help="built-in dummy config or HF dir (config only)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present; "
                                                  "cpu with --smoke)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="sparseserve step token budget (default 16384; 128 with --smoke)")
    p.add_argument("--decode-batches", default=None, help="default 1,8,32 (1,2,4 with --smoke)")
    p.add_argument("--decode-context", type=int, default=None, help="default 4096 (48 smoke)")
    p.add_argument("--decode-steps", type=int, default=None, help="timed steps (default 40)")
    p.add_argument("--no-eager", action="store_true", help="skip the enforce_eager decode run")
    p.add_argument("--hf-batch", type=int, default=None, help="HF batch (default: all requests)")
    p.add_argument("--hf-compile", action="store_true",
                   help="let transformers torch.compile decode (timed on a second run)")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="stop starting new work after this (default 480; 300 with --smoke)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    deadline = C.Deadline(args.time_budget_s or (300.0 if args.smoke else 480.0))
    parts = [s.strip() for s in args.only.split(",") if s.strip()]
    bad = [s for s in parts if s not in PARTS]
    if bad or not parts:
        raise SystemExit(f"--only: unknown part(s) {bad}; choose from {','.join(PARTS)}")
    import torch

    device = args.device or ("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = "bfloat16" if device == "cuda" else "float32"
    os.makedirs(args.out, exist_ok=True)
    out_path = os.path.join(args.out, "offline_throughput.json")
    tmpdir = tempfile.mkdtemp(prefix="sparseserve-bench-")
    ws = workloads(args.smoke, args.max_num_batched_tokens)
    decode = {"batches": [int(b) for b in (args.decode_batches or
                                           ("1,2,4" if args.smoke else "1,8,32")).split(",")],
              "context": args.decode_context or (48 if args.smoke else 4096),
              "warmup": 2 if args.smoke else 5,
              "steps": args.decode_steps or (4 if args.smoke else 40)}
    try:
        model, cfg, model_name = C.resolve_model(args, tmpdir, 2048)
        setup = {"device": device, "dtype": dtype, "dtype_bytes": 4 if dtype == "float32" else 2,
                 "parts": parts, "decode": decode, "cfg": cfg}
        result = {
            "benchmark": "offline_throughput", "schema_version": 1, **C.meta(argv),
            "settings": {"smoke": args.smoke, "model": model_name, "model_config": cfg,
                         "device": device, "dtype": dtype, "seed": args.seed, "parts": parts,
                         "skip_hf": args.skip_hf, "decode": decode, "attention": "dense",
                         "time_budget_s": deadline.budget_s},
            "workloads": {k: asdict(w) for k, w in ws.items()},
            "targets": {"ratio_a_min": TARGET_RATIO_A, "host_frac_batch32_max": TARGET_HOST_FRAC},
            "results": {**{n: {} for n in ("a", "b") if n in parts},
                        **({"decode_steps": {}} if "steps" in parts else {})},
            "errors": [], "skipped": [], "complete": False,
        }

        def save() -> None:
            result["elapsed_s"] = deadline.elapsed()
            C.write_json(out_path, result)

        save()
        log(deadline, f"{model_name} on {device} ({result['gpu_name'] or 'no GPU'}), "
                      f"parts {parts}, writing {out_path}")
        plan = [n for n in ("a", "b") if n in parts]
        if "steps" in parts:
            if "a" not in parts:
                plan.insert(0, "steps")  # else it runs on workload a's engine
            if not args.no_eager:
                plan.insert(plan.index("b") if "b" in plan else len(plan), "steps-eager")
        for name in plan:
            if deadline.expired(30):
                result["skipped"].append({"part": name, "reason": "time budget used up"})
                continue
            sparseserve_part(name, model, setup, args, ws, deadline, result, save)
            save()
        if not args.skip_hf and any(n in parts for n in ("a", "b")):
            if deadline.expired(60):
                result["skipped"].append({"part": "hf", "reason": "time budget used up"})
            else:
                hf_part(cfg, setup, args, ws, deadline, result, save)
        finalize(result)
        result["complete"] = True
        save()
        log(deadline, f"wrote {out_path}")
        print("\n" + summary_table(result), flush=True)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
