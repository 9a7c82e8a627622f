"""Two-tier KV cache end to end: prefill with write-through saving, decode with offload.

    python benchmarks/offload.py --out DIR [--smoke] [--only prefill,decode]

Llama-3-8B shape, dummy bf16 weights, arkvale sparse attention (token budget 2048, 1 sink + 2
local pages, page size 32), random prompt token ids (fixed seed), greedy.

prefill  One 32768-token prompt, max_tokens=1: wall time from add_request to the first token
         (the prefill), and until the last save has landed in DRAM ("drained"), with the
         two-tier cache saving through FlashD2H ("flash"), per-page copies ("memcpy"), or
         GPU-direct writes ("gpu-direct"), vs the all-resident sparse engine that saves
         nothing ("nosave": kv_offload=False, same sparse settings). Chunked prefill with
         max_num_batched_tokens=16384 (2 chunks; the second gathers its history from DRAM on
         the offload path), then the layer-segmented mode (max_num_batched_tokens=32768,
         prefill_layers_per_step=4: one chunk, no history) for nosave and flash. One warm-up
         prefill per engine (shorter prompt) before the timed ones; the per-page-copy run is
         stopped between steps after --memcpy-budget-s and extrapolated (recorded as cut).
decode   Batches of B requests: prefill them (chunks of 16384), a few warm-up decode steps,
         then ~20 timed pure-decode steps: ms/step (median), runner host time per step, pages
         loaded per step and the hit rate (get_stats deltas). Device cache ("slots per layer")
         = a fraction of the batch's FULL KV per layer (B x kv_heads x pages of the context;
         1.0 = every page fits), floored at the mandatory selection B x kv_heads x budget pages
         (the least the engine accepts; "min" = that floor). Baselines on the same batch and
         context: the all-resident sparse engine and the dense engine.
         Default batches: 8 x 32k and 32 x 8k. 32 x 32k of Llama-3-8B KV is 128 GiB, more than
         the host's RAM, so batch 32 runs at 8k (or --decode-configs 32x16384: 64 GiB pinned).

Host memory: the engine registers its host tier with CUDA at its exact size (one scratch page
on top, each (request, KV head) in whole chunks of pages); runs that would pin more than the
host allows are skipped and recorded in the JSON ("notes", "pinned_gib").

Writes DIR/offload.json (rewritten after every run, so a run cut short keeps what it measured),
DIR/offload.png, and prints a table last. A wall-clock budget (--time-budget-s) skips runs that
would not finish in it (recorded under "skipped"). `--smoke`: a tiny model on the CPU with tiny
workloads through the same code paths, in well under a minute (used by the tests).
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import shutil
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

import common as C  # noqa: E402
import numpy as np  # noqa: E402
from sparseserve.config import HOST_CHUNK_PAGES  # noqa: E402

GiB = 1 << 30
PARTS = ("prefill", "decode")
PREFILL_METHODS = ("nosave", "flash", "memcpy", "gpu-direct")
TARGET_PREFILL_RATIO = 1.05  # issue 4: FlashD2H prefill <= 1.05x the prefill without saving
STAT_KEYS = ("cache_hits_total", "cache_misses_total", "bytes_loaded_total", "bytes_saved_total")


def log(deadline: C.Deadline, msg: str) -> None:
    print(f"[{deadline.elapsed():7.1f}s] {msg}", flush=True)


# ---- model / shapes -------------------------------------------------------------------------
class Shape:
    """Byte sizes of the model's KV at a page size (the engine's units)."""

    def __init__(self, cfg: dict, dtype_bytes: int, page_size: int) -> None:
        self.layers = int(cfg["num_hidden_layers"])
        self.kv_heads = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
        self.head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
        self.dtype_bytes = dtype_bytes
        self.page_size = page_size
        # one page id covers every layer: what kv_cache_memory_bytes / kv_offloading_size count
        self.page_bytes = 2 * self.layers * page_size * self.head_dim * dtype_bytes
        # K+V of one page in one layer: what a load moves
        self.layer_page_bytes = 2 * page_size * self.head_dim * dtype_bytes
        self.kv_bytes_per_token = 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes
        h, i = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
        d, hq, v = self.head_dim, int(cfg["num_attention_heads"]), int(cfg["vocab_size"])
        layer = h * d * (2 * hq + 2 * self.kv_heads) + 3 * h * i + 2 * h
        head = 0 if cfg.get("tie_word_embeddings") else v * h
        self.weight_bytes = (self.layers * layer + v * h + head + h) * dtype_bytes

    def pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def ids(self, batch: int, tokens: int) -> int:
        """Page ids B requests of `tokens` tokens use (one per KV head and block)."""
        return batch * self.kv_heads * self.pages(tokens)

    def host_ids(self, batch: int, tokens: int) -> int:
        """Host page ids they take: each (request, KV head) in whole chunks of
        HOST_CHUNK_PAGES pages (the two-level page table)."""
        C = HOST_CHUNK_PAGES
        return batch * self.kv_heads * (-(-self.pages(tokens) // C) * C)

    def pinned_bytes(self, num_ids: int) -> int:
        """Host bytes the engine pins for `num_ids` host pages: per layer a K and a V tensor
        of num_ids + 1 (scratch) pages (registered at their exact size: TwoTierCache)."""
        return 2 * self.layers * (num_ids + 1) * self.page_size * self.head_dim * self.dtype_bytes


def meminfo() -> dict:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                if k in ("MemTotal", "MemAvailable"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def host_pinned_stats() -> dict | None:
    import torch

    if not torch.cuda.is_available() or not hasattr(torch.cuda, "host_memory_stats"):
        return None
    try:
        s = torch.cuda.host_memory_stats()
    except Exception:  # noqa: BLE001
        return None
    keep = ("allocated_bytes.current", "allocated_bytes.peak", "num_host_alloc",
            "num_host_free", "host_alloc_time.total", "host_free_time.total")
    return {k: s.get(k) for k in keep if k in s}


def empty_host_cache() -> bool:
    """Return cached pinned blocks to the OS (they stay pinned after an engine is freed)."""
    import torch

    fn = getattr(torch._C, "_host_emptyCache", None)
    if fn is None or not torch.cuda.is_available():
        return False
    try:
        gc.collect()
        torch.cuda.synchronize()
        fn()
        return True
    except Exception:  # noqa: BLE001
        return False


# ---- engines --------------------------------------------------------------------------------
class Bench:
    """State shared by the runs: settings, the result dict, the deadline, estimates."""

    def __init__(self, args, model: str, cfg: dict, device: str, dtype: str,
                 deadline: C.Deadline, result: dict, out_path: str) -> None:
        self.args, self.model, self.cfg = args, model, cfg
        self.device, self.dtype = device, dtype
        self.deadline, self.result, self.out_path = deadline, result, out_path
        self.shape = Shape(cfg, 2 if dtype in ("bfloat16", "float16") else 4, args.page_size)
        self.vocab = int(cfg["vocab_size"])
        # time estimates (generous until measured) for skipping what would not fit
        self.loads: list[float] = []
        self.sec_per_token = 2e-3 if device == "cpu" else 1e-4  # prefill, 32k-token prompt
        self.step_estimate_s = 0.5 if device == "cpu" else 0.25  # one decode step
        self.measured_steps = False
        self.pinned_cache: dict[int, int] = {}  # pinned block layouts freed engines left cached
        mi = meminfo()
        total = mi.get("MemTotal", 0)
        avail = mi.get("MemAvailable", total)
        keep = max(2 * GiB, min(16 * GiB, int(0.15 * total)))  # for the OS and this process
        self.host_limit = args.host_mem_limit_gib * GiB if args.host_mem_limit_gib else \
            max(0, min(int(0.65 * total), avail - keep))

    @property
    def load_s(self) -> float:
        """Engine construction estimate: the slowest of the last three (graph capture varies;
        the first one also pays CUDA and cuBLAS initialisation)."""
        if self.loads:
            return max(self.loads[-3:]) + 1.0
        return 6.0 if self.device == "cpu" else 25.0

    def save(self) -> None:
        self.result["elapsed_s"] = self.deadline.elapsed()
        C.write_json(self.out_path, self.result)

    def fail(self, part: str, exc: BaseException) -> dict:
        rec = C.error_record(exc)
        log(self.deadline, f"  {part} FAILED: {rec['error'][:300]}")
        self.result["errors"].append({"part": part, **rec})
        return rec

    def skip(self, part: str, reason: str) -> None:
        log(self.deadline, f"  skipping {part}: {reason}")
        self.result["skipped"].append({"part": part, "reason": reason})

    def fits(self, part: str, estimate_s: float) -> bool:
        left = self.deadline.remaining() - self.args.reserve_s
        if estimate_s > left:
            self.skip(part, f"time budget: needs ~{estimate_s:.0f} s, {max(left, 0):.0f} s left")
            return False
        return True

    def base_kwargs(self) -> dict:
        a = self.args
        return dict(load_format="dummy", dtype=self.dtype, device=self.device, seed=a.seed,
                    page_size=a.page_size)

    def sparse_kwargs(self) -> dict:
        a = self.args
        return dict(sparse_algorithm=a.sparse_algorithm, token_budget=a.token_budget,
                    sink_pages=a.sink_pages, local_pages=a.local_pages)

    def prepare_pinned(self, part: str, num_ids: int) -> dict | None:
        """Host memory check before an offload engine; frees cached pinned blocks of another
        layout if the two would not fit together. -> record, or None to skip the run."""
        need = self.shape.pinned_bytes(num_ids)
        rec = {"host_pages": num_ids, "requested_gib": num_ids * self.shape.page_bytes / GiB,
               "pinned_gib": need / GiB}
        cached_other = sum(b for k, b in self.pinned_cache.items() if k != need)
        if self.pinned_cache and cached_other + need > self.host_limit:
            rec["emptied_host_cache"] = empty_host_cache()
            self.pinned_cache.clear()
        if need > self.host_limit:
            self.skip(part, f"host memory: the host tier pins {need / GiB:.1f} GiB, limit "
                            f"{self.host_limit / GiB:.1f} GiB (--host-mem-limit-gib)")
            return None
        self.pinned_cache[need] = need
        return rec


class Engine:
    """One LLM for one run; closed (saver drained, memory returned) on exit."""

    def __init__(self, bench: Bench, kwargs: dict) -> None:
        self.bench, self.kwargs, self.llm = bench, kwargs, None

    def __enter__(self) -> "Engine":
        import torch

        from sparseserve import LLM

        mem0 = meminfo().get("MemAvailable")
        t0 = time.perf_counter()
        try:
            self.llm = LLM(self.bench.model, **self.kwargs)
            C.synchronize()
        except BaseException:
            self.llm = None
            C.free_device_memory()
            raise
        load_s = time.perf_counter() - t0
        self.bench.loads.append(load_s)
        eng = self.llm.engine
        graphs = getattr(eng.runner, "graphs", None)
        cc = eng.config.cache
        mem1 = meminfo().get("MemAvailable")
        self.info = {
            "engine_args": dict(self.kwargs), "load_s": load_s,
            "enforce_eager": bool(self.kwargs.get("enforce_eager", False)),
            "cuda_graphs": graphs is not None,
            "cuda_graph_error": getattr(eng.runner, "graph_error", None),
            "cuda_graph_batch_sizes": (list(getattr(graphs, "sizes", None) or [])
                                       if graphs is not None else None),
            "device_pages_or_slots": int(cc.num_pages),
            "host_pages": int(getattr(cc, "num_host_pages", 0) or 0),
            "max_model_len": int(eng.config.scheduler.max_model_len),
            "gpu_allocated_gib": (torch.cuda.memory_allocated() / GiB
                                  if torch.cuda.is_available() else None),
            "host_available_drop_gib": ((mem0 - mem1) / GiB if mem0 and mem1 else None),
        }
        return self

    @property
    def engine(self):
        return self.llm.engine

    @property
    def offload(self):
        return getattr(self.llm.engine.runner, "offload", None)

    def __exit__(self, *exc) -> None:
        try:
            off = self.offload if self.llm is not None else None
            if off is not None:
                off.close()
        except Exception:  # noqa: BLE001
            pass
        self.llm = None
        C.free_device_memory()


def cache_stats(engine) -> dict:
    """get_stats counters plus pages loaded (per layer, K+V of one KV head's page each)."""
    s = engine.get_stats()
    out = {k: int(s.get(k, 0) or 0) for k in STAT_KEYS}
    off = getattr(engine.runner, "offload", None)
    out["pages_loaded_total"] = 0
    if off is not None:
        try:
            out["pages_loaded_total"] = int(off.stats().get("pages_loaded_total"))
        except Exception:  # noqa: BLE001 - derive it from the bytes
            out["pages_loaded_total"] = None
    return out


def stats_delta(a: dict, b: dict, page_bytes: int) -> dict:
    d = {k: b[k] - a[k] for k in STAT_KEYS}
    if a.get("pages_loaded_total") is not None and b.get("pages_loaded_total") is not None:
        d["pages_loaded"] = b["pages_loaded_total"] - a["pages_loaded_total"]
    else:
        d["pages_loaded"] = d["bytes_loaded_total"] // page_bytes
    return d


def hit_rate(d: dict) -> float | None:
    n = d["cache_hits_total"] + d["cache_misses_total"]
    return d["cache_hits_total"] / n if n else None


def prompt_ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(0, vocab, n).tolist()


# ---- prefill part ---------------------------------------------------------------------------
def _tokens_done(engine, rid: str, prompt_len: int, num_layers: int) -> int:
    req = engine.scheduler.requests.get(rid)
    if req is None:
        return prompt_len
    done = req.num_computed_tokens
    seg = getattr(engine.scheduler, "_segment_tokens", {}).get(rid, 0)
    return int(done + seg * getattr(req, "prefill_layer", 0) / num_layers)


def timed_prefill(eng: Engine, ids: list[int], rid: str, stop_at: float) -> dict:
    """Prefill one prompt to its first token; the runner's steps timed one by one."""
    from sparseserve import SamplingParams

    engine = eng.engine
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    s0 = cache_stats(engine)
    step_s, host_s, cut = [], [], False
    done = len(ids)
    C.synchronize()
    t0 = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": ids}, params)
    while engine.has_unfinished_requests():
        if time.perf_counter() > stop_at:
            done = _tokens_done(engine, rid, len(ids), eng.bench.shape.layers)
            engine.abort_request(rid)
            cut = True
            break
        t = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - t)
        host_s.append(engine.last_step_host_time_s)
    C.synchronize()
    first = time.perf_counter() - t0
    if eng.offload is not None:
        eng.offload.saver.wait_all()
    drained = time.perf_counter() - t0
    d = stats_delta(s0, cache_stats(engine), eng.bench.shape.layer_page_bytes)
    rec = {"prompt_len": len(ids), "time_s": first, "drained_s": drained,
           "steps": len(step_s), "step_s": step_s, "host_s_total": float(sum(host_s)),
           "bytes_saved": d["bytes_saved_total"], "bytes_loaded": d["bytes_loaded_total"],
           "cut_by_time_budget": cut, "tokens_done": done}
    if cut:
        rec["extrapolated_time_s"] = first * len(ids) / max(done, 1)
    return rec


def prefill_run(b: Bench, mode: str, method: str) -> None:
    a, sh = b.args, b.shape
    part = f"prefill/{mode}/{method}"
    res = b.result["prefill"]["runs"]
    P = a.prefill_len
    segmented = mode == "segmented"
    batched = P if segmented else a.prefill_chunk
    reps = a.memcpy_reps if method == "memcpy" else a.prefill_reps
    one = P * b.sec_per_token * (4.0 if method == "memcpy" else 1.3)
    if method == "memcpy":
        one = min(one, a.memcpy_budget_s)
    est = b.load_s + one * (reps + 0.6)
    if not b.fits(part, est):
        return
    max_len = P + 1
    kw = {**b.base_kwargs(), **b.sparse_kwargs(), "max_model_len": max_len, "max_num_seqs": 1,
          "max_num_batched_tokens": batched, "enforce_eager": True}
    if segmented:
        kw["prefill_layers_per_step"] = a.segment_layers
    ids_needed = sh.ids(1, max_len)
    pinned = None
    if method == "nosave":
        kw["kv_cache_memory_bytes"] = (ids_needed + 4 * sh.kv_heads) * sh.page_bytes
    else:
        ids_needed = sh.host_ids(1, max_len)
        pinned = b.prepare_pinned(part, ids_needed)
        if pinned is None:
            return
        mandatory = sh.kv_heads * (a.token_budget // a.page_size)
        kw.update(kv_offload=True, kv_offloading_size=(ids_needed + 0.5) * sh.page_bytes / GiB,
                  kv_cache_memory_bytes=2 * mandatory * sh.page_bytes, d2h_method=method,
                  h2d_method=a.h2d_method, eviction=a.eviction)
    log(b.deadline, f"{part}: {P}-token prompt, max_num_batched_tokens={batched}"
                    + (f", prefill_layers_per_step={a.segment_layers}" if segmented else ""))
    rec: dict = {"mode": mode, "method": method, "max_num_batched_tokens": batched,
                 "prefill_layers_per_step": a.segment_layers if segmented else None,
                 "host_tier": pinned, "reps": []}
    res[f"{mode}/{method}"] = rec
    rng = np.random.default_rng(a.seed)
    try:
        with Engine(b, kw) as eng, C.peak_memory(rec):
            rec["engine"] = eng.info
            # warm-up (Triton compiles, cuBLAS/SDPA heuristics): two chunks, the second with
            # history, in chunked mode; one shorter prompt in segmented mode; the slow
            # per-page copies get one short chunk (the kernels compiled in earlier runs)
            warm_len = min(P, batched + batched // 16 if not segmented else max(64, P // 8))
            left = b.deadline.remaining() - a.reserve_s
            if method == "memcpy":
                warm_len, left = min(warm_len, max(64, P // 32)), min(left, a.memcpy_budget_s)
            w = timed_prefill(eng, prompt_ids(rng, warm_len, b.vocab), "warmup",
                              time.perf_counter() + max(left, 1))
            rec["warmup"] = {k: w[k] for k in ("prompt_len", "time_s", "drained_s", "steps",
                                               "cut_by_time_budget")}
            log(b.deadline, f"  warm-up {warm_len} tokens: {w['time_s']:.2f} s")
            ids = prompt_ids(rng, P, b.vocab)
            for i in range(reps):
                left = b.deadline.remaining() - a.reserve_s
                if i and left < 2 * rec["reps"][-1]["drained_s"] + 5:
                    b.skip(f"{part}/rep{i}", "time budget")
                    break
                budget = min(left, a.memcpy_budget_s) if method == "memcpy" else left
                r = timed_prefill(eng, ids, f"prefill-{i}", time.perf_counter() + max(budget, 1))
                rec["reps"].append(r)
                log(b.deadline, f"  rep {i}: {r['time_s']:.3f} s to first token, "
                                f"{r['drained_s']:.3f} s drained, {r['steps']} steps, "
                                f"saved {r['bytes_saved'] / GiB:.2f} GiB"
                    + (f" (CUT after {r['tokens_done']} tokens: ~{r['extrapolated_time_s']:.1f}"
                       " s extrapolated)" if r["cut_by_time_budget"] else ""))
                b.save()
                if r["cut_by_time_budget"]:
                    break
    except Exception as exc:  # noqa: BLE001 - record, go on with the other runs
        rec.update(b.fail(part, exc))
    C.free_device_memory()  # here, not in the except block: its traceback holds the engine
    rec["host_pinned"] = host_pinned_stats()
    _summarize_prefill(b, rec)
    b.save()


def _summarize_prefill(b: Bench, rec: dict) -> None:
    reps = [r for r in rec.get("reps", []) if not r["cut_by_time_budget"]]
    cut = [r for r in rec.get("reps", []) if r["cut_by_time_budget"]]
    rec["cut_by_time_budget"] = bool(cut)
    if reps:
        rec["time_s"] = C.summarize(r["time_s"] for r in reps)
        rec["drained_s"] = C.summarize(r["drained_s"] for r in reps)
        rec["median_s"] = rec["time_s"]["median"]
        rec["median_drained_s"] = rec["drained_s"]["median"]
        rec["prefill_tokens_per_s"] = reps[0]["prompt_len"] / rec["median_s"]
        if rec["method"] == "nosave" and rec["mode"] == "chunked":
            b.sec_per_token = rec["median_s"] / reps[0]["prompt_len"]
    elif cut:
        rec["median_s"] = rec["median_drained_s"] = None
        rec["extrapolated_time_s"] = cut[0]["extrapolated_time_s"]


def prefill_ratios(result: dict) -> dict:
    runs = result["prefill"]["runs"]
    out = {}
    for key, r in runs.items():
        mode, method = key.split("/")
        base = runs.get(f"{mode}/nosave", {})
        t = r.get("median_s") or r.get("extrapolated_time_s")
        td = r.get("median_drained_s") or r.get("extrapolated_time_s")
        if method == "nosave" or not t or not base.get("median_s"):
            continue
        ratio = t / base["median_s"]
        out[key] = {"ratio": ratio, "ratio_drained": td / base["median_s"],
                    "extrapolated": r.get("median_s") is None,
                    "meets_target": ratio <= TARGET_PREFILL_RATIO if method == "flash" else None}
        r["ratio_to_nosave"] = ratio
        r["ratio_drained_to_nosave"] = td / base["median_s"]
    return out


# ---- decode part ----------------------------------------------------------------------------
def parse_decode_configs(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        b, c = item.split("x")
        out.append((int(b), int(c)))
    return out


def parse_fractions(text: str) -> list:
    out = []
    for f in text.split(","):
        f = f.strip().lower()
        if f:
            out.append("min" if f == "min" else float(f))
    return out


def decode_plan(b: Bench, batch: int, context: int) -> dict:
    """Sizes for one batch x context: the prompt length (room for the tokens early requests
    decode while the others prefill, plus warm-up and timed steps), full and mandatory slots."""
    a, sh = b.args, b.shape
    max_len = context
    M = a.decode_chunk
    prefill_steps = -(-batch * max_len // max(1, M - batch)) + 2
    room = prefill_steps + a.decode_warmup + a.decode_steps + 4
    prompt = max_len - room
    if prompt < a.token_budget:
        raise ValueError(f"decode {batch}x{context}: prompt of {prompt} tokens is shorter than "
                         "the token budget; use a longer context")
    full = sh.ids(batch, max_len)  # slots per layer for every page of every request
    mandatory = batch * sh.kv_heads * (a.token_budget // a.page_size)
    return {"batch": batch, "context_nominal": context, "max_model_len": max_len,
            "prompt_len": prompt,
            "decode_room_tokens": room, "max_num_batched_tokens": M,
            "full_slots_per_layer": full, "mandatory_slots_per_layer": mandatory,
            "mandatory_fraction": mandatory / full,
            "full_kv_gib": full * sh.page_bytes / GiB,
            "host_pinned_gib": sh.pinned_bytes(sh.host_ids(batch, max_len)) / GiB}


def _pure_decode(sched, batch: int) -> bool | None:
    try:
        return (not sched.waiting and len(sched.running) == batch and all(
            r.num_tokens - r.num_computed_tokens == 1 and getattr(r, "prefill_layer", 0) == 0
            for r in sched.running))
    except AttributeError:
        return None


def measure_decode(b: Bench, eng: Engine, plan: dict, stop_at: float) -> dict:
    """Prefill the batch, warm up, time pure decode steps with per-step cache counters."""
    from sparseserve import SamplingParams

    a, sh = b.args, b.shape
    engine = eng.engine
    batch, P = plan["batch"], plan["prompt_len"]
    rng = np.random.default_rng(a.seed + batch)
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    rids = [f"dec-{batch}-{i}" for i in range(batch)]
    sched, runner = engine.scheduler, engine.runner
    rec: dict = {}
    exec_s: list[float] = []
    original = runner.execute

    def timed_execute(out):  # instance attribute: the runner's wall time of this step
        t = time.perf_counter()
        r = original(out)
        exec_s.append(time.perf_counter() - t)
        return r

    graphs = getattr(runner, "graphs", None)
    replays = [0]
    graph_run = getattr(graphs, "run", None)

    def counted_run(*args, **kwargs):  # did the timed steps replay a CUDA graph?
        replays[0] += 1
        return graph_run(*args, **kwargs)

    try:
        C.synchronize()
        t0 = time.perf_counter()
        for rid in rids:
            engine.add_request(rid, {"prompt_token_ids": prompt_ids(rng, P, b.vocab)}, params)
        steps, seen = 0, set()
        while not (len(seen) == batch and _pure_decode(sched, batch) is not False):
            if time.perf_counter() > stop_at:
                raise TimeoutError(f"prefill of {batch} x {P} tokens cut by the time budget "
                                   f"after {steps} steps")
            outs = engine.step()
            steps += 1
            if any(o.finished for o in outs):
                raise RuntimeError("a request finished before the batch reached decode; "
                                   "the decode room is too small")
            seen.update(o.request_id for o in outs)
            if steps > 4 * batch * P + 16:
                raise RuntimeError("requests did not all reach decode")
        C.synchronize()
        rec["prefill"] = {"wall_s": time.perf_counter() - t0, "steps": steps,
                          "tokens": batch * P}
        rec["prefill"]["tokens_per_s"] = batch * P / rec["prefill"]["wall_s"]
        s = cache_stats(engine)
        warm = []
        for i in range(a.decode_warmup):
            t = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t
            s2 = cache_stats(engine)
            d = stats_delta(s, s2, sh.layer_page_bytes)
            warm.append({"ms": dt * 1e3, "host_ms": engine.last_step_host_time_s * 1e3,
                         "pages_loaded": d["pages_loaded"], "hits": d["cache_hits_total"],
                         "misses": d["cache_misses_total"]})
            s = s2
        rec["warmup_steps"] = warm
        if warm:  # the first decode step after prefill: the device tier starts empty
            rec["first_step_ms"] = warm[0]["ms"]
            rec["first_step_pages_loaded"] = warm[0]["pages_loaded"]
        ctx0 = [r.num_tokens for r in sched.running]
        rec["context_tokens_at_timing_start"] = {"min": min(ctx0), "max": max(ctx0)}
        per, pure, host = [], [], []
        s_start = s
        runner.execute = timed_execute
        if graph_run is not None:
            graphs.run = counted_run
        for i in range(a.decode_steps):
            if time.perf_counter() > stop_at:
                rec["timed_steps_cut_by_time_budget"] = True
                break
            pure.append(_pure_decode(sched, batch))
            t = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t
            s2 = cache_stats(engine)  # syncs, outside the timed region
            d = stats_delta(s, s2, sh.layer_page_bytes)
            host.append(engine.last_step_host_time_s)
            per.append({"ms": dt * 1e3, "host_ms": host[-1] * 1e3,
                        "pages_loaded": d["pages_loaded"], "hits": d["cache_hits_total"],
                        "misses": d["cache_misses_total"], "bytes_saved": d["bytes_saved_total"]})
            s = s2
    finally:
        runner.__dict__.pop("execute", None)
        if graph_run is not None:
            graphs.__dict__.pop("run", None)
        try:
            engine.abort_request(rids)
        except Exception:  # noqa: BLE001
            pass
    n = len(per)
    step_s = [p["ms"] / 1e3 for p in per]
    tot = stats_delta(s_start, s, sh.layer_page_bytes) if n else None
    rec.update({
        "timed_steps": n, "pure_decode_steps": sum(1 for p in pure if p),
        "pure_decode_verified": None not in pure,
        "cuda_graph_replays": replays[0],
        "cuda_graphs_used": bool(n and replays[0] == n),
        "step_ms": C.summarize(step_s, 1e3), "host_ms": C.summarize(host, 1e3),
        "execute_ms": C.summarize(exec_s, 1e3),
        "engine_overhead_ms": C.summarize([s_ - e for s_, e in zip(step_s, exec_s)], 1e3)
        if len(exec_s) == n else C.summarize([]),
        "per_step": per,
    })
    if n:
        med = rec["step_ms"]["median"]
        rec["ms_per_step"] = med
        rec["host_frac"] = rec["host_ms"]["median"] / med if med else None
        rec["output_tokens_per_s"] = batch / (med / 1e3) if med else None
        rec["pages_loaded_per_step"] = tot["pages_loaded"] / n
        rec["pages_loaded_per_step_per_layer"] = tot["pages_loaded"] / n / sh.layers
        rec["bytes_loaded_per_step"] = tot["bytes_loaded_total"] / n
        rec["load_gb_per_s_of_step"] = (tot["bytes_loaded_total"] / n) / (med / 1e3) / 1e9 \
            if med else None
        rec["hits_per_step"] = tot["cache_hits_total"] / n
        rec["misses_per_step"] = tot["cache_misses_total"] / n
        rec["hit_rate"] = hit_rate(tot)
        rec["bytes_saved_per_step"] = tot["bytes_saved_total"] / n
    return rec


def decode_run(b: Bench, plan: dict, kind: str, fraction=None) -> None:
    import torch

    a, sh = b.args, b.shape
    batch, key = plan["batch"], plan["key"]
    label = kind if kind != "offload" else f"offload-{fraction}"
    part = f"decode/{key}/{label}"
    runs = b.result["decode"]["configs"][key]["runs"]
    prefill_est = plan.get("measured_prefill_s") or \
        plan["batch"] * plan["prompt_len"] * b.sec_per_token * 1.3
    est = b.load_s + 1.2 * prefill_est + (a.decode_warmup + a.decode_steps) * \
        b.step_estimate_s + 3
    kw = {**b.base_kwargs(), "max_model_len": plan["max_model_len"], "max_num_seqs": batch,
          "max_num_batched_tokens": plan["max_num_batched_tokens"],
          "enforce_eager": a.enforce_eager}
    rec: dict = {"kind": kind, "cache_fraction_requested": fraction}
    full, mand = plan["full_slots_per_layer"], plan["mandatory_slots_per_layer"]
    if kind == "dense":
        kw.update(sparse_algorithm="dense", kv_cache_memory_bytes=(full + 4 * sh.kv_heads)
                  * sh.page_bytes)
    elif kind == "resident-sparse":
        kw.update(**b.sparse_kwargs(), kv_cache_memory_bytes=(full + 4 * sh.kv_heads)
                  * sh.page_bytes)
    else:
        slots = mand if fraction == "min" else max(mand, int(math.ceil(fraction * full)))
        rec["floored_to_mandatory"] = fraction != "min" and fraction * full < mand
        rec["capped_by_memory"] = False
        if b.device == "cuda":
            free = torch.cuda.mem_get_info()[0]
            summaries = 2 * (full + 1) * sh.head_dim * sh.dtype_bytes * sh.layers
            room = free - sh.weight_bytes - summaries - a.gpu_reserve_gib * GiB
            if slots * sh.page_bytes > room:
                slots = max(mand, int(room // sh.page_bytes))
                rec["capped_by_memory"] = True
        same = [k for k, r in runs.items() if r.get("slots_per_layer") == slots
                and r.get("kind") == "offload" and r.get("ms_per_step") is not None]
        if same:
            runs[label] = {**rec, "same_as": same[0], "slots_per_layer": slots,
                           "cache_fraction": slots / full}
            b.skip(part, f"same device cache as {same[0]} ({slots} slots per layer)")
            return
        rec["slots_per_layer"] = slots
        rec["cache_fraction"] = slots / full
        rec["device_cache_gib"] = slots * sh.page_bytes / GiB
        kw.update(**b.sparse_kwargs(), kv_offload=True,
                  kv_offloading_size=(sh.host_ids(batch, plan["max_model_len"]) + 0.5)
                  * sh.page_bytes / GiB,
                  kv_cache_memory_bytes=slots * sh.page_bytes, h2d_method=a.h2d_method,
                  d2h_method=a.d2h_method, eviction=a.eviction)
    runs[label] = rec
    if not b.fits(part, est):
        rec["skipped"] = True
        return
    if kind == "offload":
        pinned = b.prepare_pinned(part, sh.host_ids(batch, plan["max_model_len"]))
        if pinned is None:
            rec["skipped"] = True
            return
        rec["host_tier"] = pinned
    log(b.deadline, f"{part}: {batch} x {plan['prompt_len']}-token prompts"
                    + (f", {rec['slots_per_layer']} slots/layer ({100 * rec['cache_fraction']:.1f}%"
                       " of the full KV)" if kind == "offload" else ""))
    attempts = [kw]
    if kind == "offload" and not a.enforce_eager and not a.no_eager_retry:
        attempts.append({**kw, "enforce_eager": True})
    for i, kwi in enumerate(attempts):
        if i:
            if b.deadline.remaining() - a.reserve_s < est:
                break
            log(b.deadline, "  retrying with enforce_eager=True")
            rec["first_attempt"] = {k: rec.pop(k) for k in ("error", "traceback") if k in rec}
            rec["retried_eager"] = True
        try:
            with Engine(b, kwi) as eng, C.peak_memory(rec):
                rec["engine"] = eng.info
                stop_at = time.perf_counter() + b.deadline.remaining() - a.reserve_s
                rec.update(measure_decode(b, eng, plan, stop_at))
            if rec.get("prefill"):
                plan["measured_prefill_s"] = max(plan.get("measured_prefill_s") or 0,
                                                 rec["prefill"]["wall_s"])
            if rec.get("ms_per_step"):
                b.step_estimate_s = max(b.step_estimate_s if b.measured_steps else 0,
                                        2 * rec["step_ms"]["max"] / 1e3)
                b.measured_steps = True
                log(b.deadline, f"  prefill {rec['prefill']['wall_s']:.1f} s; decode "
                                f"{rec['ms_per_step']:.2f} ms/step (median of "
                                f"{rec['timed_steps']}), host {rec['host_ms']['median']:.2f} ms"
                    + (f", {rec['pages_loaded_per_step']:.0f} pages loaded/step, hit rate "
                       f"{100 * (rec['hit_rate'] or 0):.1f}%" if kind == "offload" else "")
                    + f", graphs {'on' if rec['cuda_graphs_used'] else 'off'}")
            break
        except Exception as exc:  # noqa: BLE001
            rec.update(b.fail(part, exc))
            if isinstance(exc, TimeoutError):
                break
        C.free_device_memory()  # outside the except block: its traceback holds the engine
    C.free_device_memory()
    rec["host_pinned"] = host_pinned_stats()
    b.save()


def decode_ratios(result: dict) -> None:
    for key, c in result["decode"]["configs"].items():
        runs = c["runs"]
        res = runs.get("resident-sparse", {}).get("ms_per_step")
        dense = runs.get("dense", {}).get("ms_per_step")
        for label, r in runs.items():
            ms = r.get("ms_per_step")
            if ms is None:
                continue
            r["ratio_to_resident_sparse"] = ms / res if res else None
            r["ratio_to_dense"] = ms / dense if dense else None


# ---- report ---------------------------------------------------------------------------------
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
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


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
        out.append("errors: " + "; ".join(f"{e['part']}: {e['error'][:120]}"
                                          for e in result["errors"]))
    return "\n".join(out)


# ---- main -----------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for offload.json and offload.png")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, tiny workloads")
    p.add_argument("--only", default=",".join(PARTS), help="comma list of prefill, decode")
    p.add_argument("--model", default=None, help="built-in dummy config or HF dir (config only)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present; "
                                                  "cpu with --smoke)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--page-size", type=int, default=None, help="default 32 (8 with --smoke)")
    p.add_argument("--sparse-algorithm", default="arkvale")
    p.add_argument("--token-budget", type=int, default=None, help="default 2048 (32 smoke)")
    p.add_argument("--sink-pages", type=int, default=1)
    p.add_argument("--local-pages", type=int, default=2)
    p.add_argument("--h2d-method", default="flash", choices=["flash", "memcpy"],
                   help="loads in decode (and prefill history)")
    p.add_argument("--d2h-method", default="flash", choices=["flash", "memcpy", "gpu-direct"],
                   help="saving method of the decode runs")
    p.add_argument("--eviction", default="category-lru", choices=["category-lru", "lru"])
    # prefill part
    p.add_argument("--prefill-len", type=int, default=None, help="default 32768 (192 smoke)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="max_num_batched_tokens of the chunked runs (default 16384; 128 smoke)")
    p.add_argument("--prefill-methods", default=",".join(PREFILL_METHODS))
    p.add_argument("--segment-layers", type=int, default=None,
                   help="prefill_layers_per_step of the segmented runs (default 4; 1 smoke; "
                        "0: no segmented runs)")
    p.add_argument("--segmented-methods", default="nosave,flash")
    p.add_argument("--prefill-reps", type=int, default=None,
                   help="timed prefills (default 2; 1 smoke)")
    p.add_argument("--memcpy-reps", type=int, default=1)
    p.add_argument("--memcpy-budget-s", type=float, default=40.0,
                   help="stop a per-page-copy prefill after this and extrapolate")
    # decode part
    p.add_argument("--decode-configs", default=None,
                   help="BATCHxCONTEXT list (default 8x32768,32x8192; 2x128,4x64 smoke)")
    p.add_argument("--cache-fractions", default="0.25,0.5,1.0,min",
                   help="device cache as fractions of the full KV; 'min' = the mandatory "
                        "selection (runs last)")
    p.add_argument("--no-dense", action="store_true", help="skip the dense baseline")
    p.add_argument("--decode-chunk", type=int, default=None,
                   help="max_num_batched_tokens of the decode engines (default 16384; 128 smoke)")
    p.add_argument("--decode-warmup", type=int, default=None, help="default 4 (2 smoke)")
    p.add_argument("--decode-steps", type=int, default=None, help="default 20 (3 smoke)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="decode engines without CUDA graphs (default: the engine's choice)")
    p.add_argument("--no-eager-retry", action="store_true",
                   help="do not retry a failed offload decode run with enforce_eager=True")
    p.add_argument("--gpu-reserve-gib", type=float, default=10.0,
                   help="HBM kept free of the device cache (activations, graphs)")
    p.add_argument("--host-mem-limit-gib", type=float, default=None,
                   help="most pinned host memory at a time (default: min(65%% of RAM, "
                        "available - min(16 GiB, 15%% of RAM)))")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="skip runs that would end after this (default 320; 75 with --smoke)")
    p.add_argument("--reserve-s", type=float, default=None,
                   help="seconds kept for the report (default 12; 3 with --smoke)")
    args = p.parse_args(argv)
    s = args.smoke
    for name, full, smoke in (("page_size", 32, 8), ("token_budget", 2048, 32),
                              ("prefill_len", 32768, 192), ("prefill_chunk", 16384, 128),
                              ("segment_layers", 4, 1), ("prefill_reps", 2, 1),
                              ("decode_configs", "8x32768,32x8192", "2x128,4x64"),
                              ("decode_chunk", 16384, 128), ("decode_warmup", 4, 2),
                              ("decode_steps", 20, 3), ("time_budget_s", 320.0, 75.0),
                              ("reserve_s", 12.0, 3.0)):
        if getattr(args, name) is None:
            setattr(args, name, smoke if s else full)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    deadline = C.Deadline(args.time_budget_s)
    parts = [s.strip() for s in args.only.split(",") if s.strip()]
    bad = [s for s in parts if s not in PARTS]
    if bad or not parts:
        raise SystemExit(f"--only: unknown part(s) {bad}; choose from {','.join(PARTS)}")
    methods = [m.strip() for m in args.prefill_methods.split(",") if m.strip()]
    seg_methods = [m.strip() for m in args.segmented_methods.split(",") if m.strip()] \
        if args.segment_layers else []
    for m in methods + seg_methods:
        if m not in PREFILL_METHODS:
            raise SystemExit(f"unknown prefill method {m!r}; choose from {PREFILL_METHODS}")
    import torch

    device = args.device or ("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if args.smoke and device == "cpu":
        torch.set_num_threads(1)  # tiny ops: threads only add barrier stalls on a busy host
    dtype = "bfloat16" if device == "cuda" else "float32"
    os.makedirs(args.out, exist_ok=True)
    out_path = os.path.join(args.out, "offload.json")
    tmpdir = tempfile.mkdtemp(prefix="sparseserve-offload-")
    try:
        model, cfg, model_name = C.resolve_model(args, tmpdir, 4096)
        decode_cfgs = parse_decode_configs(args.decode_configs)
        fractions = parse_fractions(args.cache_fractions)
        settings = {k: v for k, v in vars(args).items() if k != "out"}
        settings.update(model=model_name, model_config=cfg, device=device, dtype=dtype,
                        parts=parts, prefill_methods=methods, segmented_methods=seg_methods)
        result = {
            "benchmark": "offload", "schema_version": 1, **C.meta(argv),
            "settings": settings,
            "definitions": {
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
            },
            "notes": [],
            "host": {**{k: v / GiB for k, v in meminfo().items()}},
            "prefill": {"runs": {}},
            "decode": {"configs": {}},
            "errors": [], "skipped": [], "complete": False,
        }
        b = Bench(args, model, cfg, device, dtype, deadline, result, out_path)
        sh = b.shape
        result["host"]["pinned_limit_gib"] = b.host_limit / GiB
        result["shape"] = {"layers": sh.layers, "kv_heads": sh.kv_heads,
                           "head_dim": sh.head_dim, "page_bytes_all_layers": sh.page_bytes,
                           "layer_page_bytes": sh.layer_page_bytes,
                           "kv_bytes_per_token": sh.kv_bytes_per_token,
                           "weight_gib": sh.weight_bytes / GiB}
        plans = []
        if "decode" in parts:
            for batch, ctx in decode_cfgs:
                try:
                    plan = decode_plan(b, batch, ctx)
                except ValueError as exc:
                    b.fail(f"decode/b{batch}x{ctx}", exc)
                    continue
                plan["key"] = f"b{batch}_ctx{plan['max_model_len']}"
                result["decode"]["configs"][plan["key"]] = {"plan": plan, "runs": {}}
                plans.append(plan)
                kv = ctx * batch * sh.kv_bytes_per_token
                result["notes"].append(
                    f"batch {batch} x {plan['max_model_len']}: {kv / GiB:.1f} GiB of KV "
                    f"({sh.kv_bytes_per_token // 1024} KiB per token), all of it pinned in the "
                    "host tier of the offload runs and resident in HBM in the baselines")
                if batch >= 32 and ctx < 32768 and not args.smoke:
                    result["notes"].append(
                        f"batch {batch} runs at {ctx} tokens, not 32k: {batch} x 32768 tokens "
                        f"would be {batch * 32768 * sh.kv_bytes_per_token / GiB:.0f} GiB of "
                        "KV, more than the host's RAM (--decode-configs sets the sizes)")
            result["notes"].append(
                "decode cache fractions: slots per layer = max(mandatory, ceil(fraction x "
                "full)); full = batch x kv_heads x pages of max_model_len; 'min' = mandatory. "
                "Prefill writes only to DRAM, so the device tier fills during decode: requests "
                "that finish prefill early already decode in the later (hybrid) prefill steps; "
                "the first pure-decode step (it loads at least the last request's whole "
                "selection) is reported as first_step_ms and is not timed.")
        if "prefill" in parts:
            result["prefill"]["prompt_len"] = args.prefill_len
        b.save()
        log(deadline, f"{model_name} on {device} ({result['gpu_name'] or 'no GPU'}), parts "
                      f"{parts}, budget {args.time_budget_s:.0f} s, pinned limit "
                      f"{b.host_limit / GiB:.1f} GiB, writing {out_path}")

        # run order = priority: the time budget skips what comes last
        schedule = []
        if "prefill" in parts:
            schedule += [("prefill", "chunked", m) for m in methods]
        fr_main = [f for f in fractions if f != "min"]
        for plan in plans:
            schedule.append(("decode", plan, ("resident-sparse", None)))
            schedule += [("decode", plan, ("offload", f)) for f in fr_main]
            if not args.no_dense:
                schedule.append(("decode", plan, ("dense", None)))
        if "prefill" in parts:
            schedule += [("prefill", "segmented", m) for m in seg_methods]
        if "min" in fractions:
            schedule += [("decode", plan, ("offload", "min")) for plan in plans]
        result["settings"]["run_order"] = [
            f"{w}/{x}/{y}" if w == "prefill" else f"{w}/{x['key']}/{y[0]}"
            + (f"-{y[1]}" if y[1] is not None else "") for w, x, y in schedule]
        for what, x, y in schedule:  # each run checks the time budget itself
            try:
                if what == "prefill":
                    prefill_run(b, x, y)
                else:
                    decode_run(b, x, *y)
            except Exception as exc:  # noqa: BLE001 - never lose the other runs
                b.fail(f"{what}/{x if what == 'prefill' else x['key']}/{y}", exc)
                C.free_device_memory()
        empty_host_cache()
        result["host_pinned_final"] = host_pinned_stats()
        finalize(result)
        try:
            result["plot"] = plot(result, os.path.join(args.out, "offload.png"))
        except Exception as exc:  # noqa: BLE001
            b.fail("plot", exc)
        result["complete"] = True
        b.save()
        log(deadline, f"wrote {out_path}")
        print("\n" + summary_table(result), flush=True)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
