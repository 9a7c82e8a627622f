"""Needle-in-a-haystack prompts, generated offline, and their greedy evaluation.

Haystack: real prose (the Python documentation topics that ``pydoc`` ships, see texts.py).
* single needle: "The secret number is 73914." at one depth; the question asks for it;
* multi-key: five "The secret number for <key> is <value>." sentences at depths 10%..90% of
  one haystack; one question per key (a question's depth = the depth of its key).

Each question ends with the answer's lead-in ("... The secret number is"), so a pass is the
value's digits appearing in the first generated tokens.

Evaluation (``NeedleRunner``), per haystack: the haystack (padded to whole pages) is
prefilled densely once; for each config every question is a request whose page table lists
the haystack's pages plus pages of its own, its question is prefilled as a chunk after the
haystack (dense, as the engine prefills), and then all questions decode greedily together
through the engine's sparse path. That is the engine's computation for the prompt
haystack + question with prefix reuse; ``verify_with_llm`` checks the generated tokens
against ``LLM.generate`` on the same prompts.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch

from sparseserve.bench.fidelity_tail import BASE, GREEDY, Setting, TailHarness
from sparseserve.bench.texts import source_text
from sparseserve.engine.sched_output import NewRow, ScheduledChunk, SchedulerOutput
from sparseserve.kvcache.manager import cdiv

KEYS = ("apple", "river", "violin", "castle", "tiger", "comet", "harbor", "maple")
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


@dataclass
class Question:
    kind: str  # "single" | "multikey"
    depth: float
    answer: str
    token_ids: list[int]  # the question, appended after the haystack


@dataclass
class Haystack:
    name: str
    length: int  # nominal context length (haystack + question + answer fit in it)
    token_ids: list[int]  # a whole number of pages
    questions: list[Question] = field(default_factory=list)


def _encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _filler(tok, n: int, offset: int) -> list[int]:
    _, raw = source_text("docs", offset)
    ids = _encode(tok, raw[:n * 6])
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def _line_starts(tok, ids: list[int]) -> list[int]:
    """Token indexes that start a line (needles go there, not mid-word)."""
    nl = {i for i, t in enumerate(ids) if "\n" in tok.decode([t])}
    return sorted(i + 1 for i in nl)


def _place(tok, filler: list[int], needles: list[tuple[float, list[int]]]) -> list[int]:
    starts = _line_starts(tok, filler) or list(range(len(filler)))
    cuts = []
    for depth, ids in needles:
        target = int(depth * len(filler))
        cuts.append((min(starts, key=lambda s: abs(s - target)), ids))
    out, prev = [], 0
    for cut, ids in sorted(cuts, key=lambda c: c[0]):
        out += filler[prev:cut] + ids
        prev = cut
    return out + filler[prev:]


def make_haystacks(tok, length: int, page_size: int = 32, seed: int = 0,
                   single_depths=(0.1, 0.5, 0.9), multikey_depths=DEPTHS,
                   answer_room: int = 64) -> list[Haystack]:
    """One multi-key haystack and one single-needle haystack per depth in single_depths,
    each padded so haystack + question + answer_room tokens <= length."""
    rng = random.Random(seed * 1000 + length)
    hay_len = (length - answer_room) // page_size * page_size
    out = []
    if multikey_depths:
        keys = rng.sample(KEYS, len(multikey_depths))
        vals = [str(rng.randrange(10000, 99999)) for _ in keys]
        needles = [(d, _encode(tok, f"The secret number for {k} is {v}.\n"))
                   for d, k, v in zip(multikey_depths, keys, vals)]
        fill = _filler(tok, hay_len - sum(len(n) for _, n in needles), offset=3)
        hs = Haystack(f"multikey-{length}", length, _place(tok, fill, needles))
        for d, k, v in zip(multikey_depths, keys, vals):
            q = _encode(tok, f"\n\nQuestion: What is the secret number for {k}?\n"
                             f"Answer: The secret number for {k} is")
            hs.questions.append(Question("multikey", d, v, q))
        out.append(hs)
    for i, d in enumerate(single_depths):
        v = str(rng.randrange(10000, 99999))
        needle = _encode(tok, f"The secret number is {v}.\n")
        fill = _filler(tok, hay_len - len(needle), offset=4 + i)
        hs = Haystack(f"single-{length}-d{int(d * 100)}", length,
                      _place(tok, fill, [(d, needle)]))
        q = _encode(tok, "\n\nQuestion: What is the secret number?\n"
                         "Answer: The secret number is")
        hs.questions.append(Question("single", d, v, q))
        out.append(hs)
    return out


def passed(tok, generated: list[int], answer: str) -> bool:
    return answer in tok.decode(generated).replace(" ", "")


class NeedleRunner:
    """Greedy answers for every question of a haystack under many configs, reusing one dense
    prefill of the haystack (see the module docstring)."""

    def __init__(self, harness: TailHarness, max_tokens: int = 8) -> None:
        self.h = harness
        self.max_tokens = max_tokens

    def prepare(self, hs: Haystack, algorithms):
        return self.h.prefill(hs.token_ids, len(hs.token_ids), base=0, algorithms=algorithms)

    @torch.inference_mode()
    def generate(self, hs: Haystack, prep, setting: Setting) -> list[list[int]]:
        h, runner = self.h, self.h.runner
        ps, hkv, n = h.ps, h.hkv, len(hs.token_ids)
        hay_pages = h.pages(n, prep.base)
        extra = cdiv(max(len(q.token_ids) for q in hs.questions) + self.max_tokens, ps)
        base2 = prep.base + h.num_pages(n)
        rows = range(len(hs.questions))
        tables = []
        for r in rows:  # the haystack's pages, then pages of the question's own
            own = h.pages(extra * ps, base2 + r * extra * hkv)
            tables.append(np.concatenate([hay_pages, own]))
        ids = [h.new_id() for _ in rows]
        with runner.hooked(sparse=h.runtime_for(prep, setting)):
            try:
                chunks = [ScheduledChunk(ids[r], r, hs.questions[r].token_ids, n, 0, h.num_layers,
                                         True, 0, 0, tables[r]) for r in rows]
                res = runner.execute(SchedulerOutput(
                    chunks, new_rows=[NewRow(r, ids[r], GREEDY) for r in rows]))
                out = [[res.token_ids[ids[r]]] for r in rows]
                for step in range(1, self.max_tokens):
                    chunks = [ScheduledChunk(ids[r], r, [out[r][-1]],
                                             n + len(hs.questions[r].token_ids) + step - 1, 0,
                                             h.num_layers, True, step) for r in rows]
                    res = runner.execute(SchedulerOutput(chunks))
                    for r in rows:
                        out[r].append(res.token_ids[ids[r]])
                return out
            finally:
                runner.execute(SchedulerOutput([], freed_rows=list(rows), freed_request_ids=ids))


def verify_with_llm(llm_kwargs: dict, hs: Haystack, setting: Setting, max_tokens: int,
                    questions=None) -> list[list[int]]:
    """Greedy answers through the normal engine (LLM.generate) for the same prompts."""
    from sparseserve import LLM, SamplingParams

    kw = dict(llm_kwargs)
    if setting.algorithm != "dense":
        kw.update(sparse_algorithm=setting.algorithm, token_budget=setting.token_budget,
                  sink_pages=setting.sink_pages, local_pages=setting.local_pages,
                  dense_layers=setting.dense_layers)
    llm = LLM(**kw)
    qs = hs.questions if questions is None else questions
    prompts = [{"prompt_token_ids": hs.token_ids + q.token_ids} for q in qs]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    del llm
    return [list(o.outputs[0].token_ids) for o in outs]


def _parse_key(key: str) -> Setting | None:
    """"arkvale/b1024/s1/l2/d0" -> its Setting; None for anything else."""
    import re

    m = re.fullmatch(r"([\w.-]+)/b(\d+)/s(\d+)/l(\d+)/d(\d+)", key)
    return None if m is None else Setting(m[1], *(int(m[i]) for i in range(2, 6)))


def needle_settings(default: dict | None, algos, budgets, only=None) -> list[Setting]:
    """dense; every algorithm at the base settings at 512 and 2048 tokens (or the largest
    budget); the default at every budget. ``only``: keep just these keys, where 'default' and
    'oracle' name the default and oracle (at the default's knobs) at the largest budget."""
    out = [Setting("dense")]
    some = [b for b in budgets if b in (512, 2048)] or [max(budgets)]
    for a in algos:
        for b in some:
            out.append(Setting(a, b, **BASE))
    knobs = (BASE["sink_pages"], BASE["local_pages"], BASE["dense_layers"])
    if default:
        knobs = (default["sink_pages"], default["local_pages"], default["dense_layers"])
        for b in budgets:
            s = Setting(default["algorithm"], b, *knobs)
            if s not in out:
                out.append(s)
    if not only:
        return out
    alias = {"dense": "dense", "oracle": Setting("oracle", max(budgets), *knobs).key}
    if default:
        alias["default"] = Setting(default["algorithm"], max(budgets), *knobs).key
    keys = [alias.get(k, k) for k in only]
    extra = [Setting("oracle", max(budgets), *knobs)] if "oracle" in only else []
    for k in keys:  # an explicit key of a setting the grid does not hold (another budget)
        s = _parse_key(k)
        if s is not None and s not in out and s not in extra:
            extra.append(s)
    return [s for s in out + [e for e in extra if e not in out] if s.key in keys]


def run_needles(args, harness: TailHarness, tok, default: dict | None, algos, log,
                save=None) -> dict:
    """Pass rates of every setting on every length's haystacks, plus an LLM.generate check
    of the dense and default settings on one prompt per length."""
    import time

    quick = args.quick
    settings = needle_settings(default, algos, [max(args.budgets)] if quick else args.budgets,
                               only=getattr(args, "needle_settings", None))
    runner = NeedleRunner(harness, max_tokens=8)
    from sparseserve.bench.fidelity import _summarised
    summarised = _summarised(["quest", "arkvale", "infllm"] + [s.algorithm for s in settings])
    rows: dict[str, dict] = {}
    checks = []
    for length in sorted(args.lengths):
        single = () if quick else tuple(getattr(args, "needle_depths", None) or (0.1, 0.5, 0.9))
        stacks = make_haystacks(tok, length, single_depths=single,
                                multikey_depths=(0.3, 0.7) if quick else DEPTHS)
        for hs in stacks:
            t0 = time.perf_counter()
            prep = runner.prepare(hs, summarised)
            for s in settings:
                gen = runner.generate(hs, prep, s)
                row = rows.setdefault(s.key, dict(key=s.key, **s.__dict__, results=[]))
                for q, g in zip(hs.questions, gen):
                    row["results"].append(dict(length=length, haystack=hs.name, kind=q.kind,
                                               depth=q.depth, answer=q.answer,
                                               output=tok.decode(g), tokens=g,
                                               passed=passed(tok, g, q.answer)))
            if save is not None:
                save(dict(settings=list(rows.values()), llm_generate_checks=checks))
            first = rows[settings[0].key]["results"][-len(hs.questions):]  # dense when run
            log(f"[needle {length}] {hs.name}: {len(settings)} settings in "
                f"{time.perf_counter() - t0:.1f}s; {settings[0].key} "
                f"{[r['output'] for r in first]}")
            if args.verify_needle and hs is stacks[-1]:
                checks += _verify(args, runner, tok, hs, prep, default, length, log)
    for row in rows.values():
        res = row["results"]
        row["pass_rate"] = sum(r["passed"] for r in res) / len(res)
        for length in args.lengths:
            for kind in ("single", "multikey"):
                sub = [r["passed"] for r in res if r["length"] == length and r["kind"] == kind]
                if sub:
                    row[f"pass_{kind}_{length}"] = sum(sub) / len(sub)
    return dict(settings=list(rows.values()), llm_generate_checks=checks)


def _verify(args, runner: NeedleRunner, tok, hs, prep, default, length, log) -> list[dict]:
    """Greedy tokens of LLM.generate == the shared-prefix runner's, for dense and the
    default at the largest budget, on the first question of the (last) haystack."""
    sets = [Setting("dense")]
    if default:
        sets.append(Setting(default["algorithm"], max(args.budgets), default["sink_pages"],
                            default["local_pages"], default["dense_layers"]))
    out = []
    for s in sets:
        mine = runner.generate(hs, prep, s)[0]
        ref = verify_with_llm(dict(model=args.model, max_model_len=length, max_num_seqs=4,
                                   kv_cache_memory_bytes=(length // 32 + 8) * 3 * 491520),
                              hs, s, runner.max_tokens, questions=hs.questions[:1])[0]
        out.append(dict(length=length, haystack=hs.name, key=s.key, equal=mine == ref,
                        runner=tok.decode(mine), llm_generate=tok.decode(ref)))
        log(f"[needle {length}] LLM.generate check {s.key}: equal={mine == ref} "
            f"({tok.decode(ref)!r})")
    return out
