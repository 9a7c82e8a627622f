"""Teacher-forced sparse decoding of a text's tail in one batched pass per chunk of rows.

Exact method (no approximation): the first ``P = len - tail`` tokens are prefilled densely
once (prefill is dense in the engine too). The tail tokens then run as decode rows of one
``ModelRunner.execute`` call per chunk: row ``t`` is a virtual request whose page-table row
lists the text's own physical pages, at position ``P + t``. Within each layer every row first
stores its new K/V, then pages that filled are indexed, then each row selects and attends
over positions ``<= P + t`` only (its own page is its last page, masked to its valid length).
So row ``t`` sees exactly the K/V that sequential teacher-forced sparse decoding produces.
Chunks run in order, so a later chunk reads the earlier chunks' K/V of the same config; the
tail's K/V of an earlier config is always overwritten before it is read.

Per text, the algorithms' summaries of the prefix pages are built once after the prefill
(InfLLM's with the queries of the dense prefill, as the engine does) and copied into a fresh
``SparseRuntime`` for each config; tail pages are indexed by the pass itself.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from sparseserve.bench.fidelity_shared import (RecallMeter, SharedOracle, SharedText,
                                                fast_decode_attention,
                                               shared_bounds_class, shared_codes_class,
                                               shared_shortlist_class)
from sparseserve.bench.fidelity_variants import CLASSES, VARIANTS
from sparseserve.config import SparseConfig
from sparseserve.engine.sched_output import NewRow, ScheduledChunk, SchedulerOutput
from sparseserve.kvcache.manager import cdiv
from sparseserve.request import SamplingParams
from sparseserve.sparse import get_algorithm_class
from sparseserve.sparse.algorithms import Oracle, Quest
from sparseserve.sparse.keycode_shortlist import KeyCodeShortlist
from sparseserve.sparse.keycodes import KeyCodes

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)
_D = SparseConfig()
# the evaluation's base knobs: the engine's defaults
BASE = dict(sink_pages=_D.sink_pages, local_pages=_D.local_pages, dense_layers=_D.dense_layers)
INDEX_ONLY = ("quest", "arkvale")  # summaries computed from the keys alone


@dataclass(frozen=True)
class Setting:
    """One evaluated configuration (the engine's sparse knobs; the evaluation passes all of
    them, the defaults here are small-budget ones for tests)."""

    algorithm: str
    token_budget: int = 2048
    sink_pages: int = 1
    local_pages: int = 2
    dense_layers: int = 0

    @property
    def key(self) -> str:
        if self.algorithm == "dense":
            return "dense"
        return (f"{self.algorithm}/b{self.token_budget}/s{self.sink_pages}"
                f"/l{self.local_pages}/d{self.dense_layers}")

    def sparse_config(self) -> SparseConfig | None:
        if self.algorithm == "dense":
            return None
        return SparseConfig(self.algorithm, self.token_budget, self.sink_pages,
                            self.local_pages, self.dense_layers)


@dataclass
class TailResult:
    logits: torch.Tensor  # [tail, vocab] fp32
    recall: dict | None  # RecallMeter.summary() (None for dense)


@dataclass
class Prepared:
    """A text whose prefix is prefilled: its pages are [base, base + cdiv(len, ps) * Hkv),
    page id = base + block * Hkv + head."""

    tokens: list[int]
    prefix_len: int
    base: int
    summaries: dict[str, list[dict[str, torch.Tensor]]]  # algorithm -> per layer -> name


class TailHarness:
    """Drives a ModelRunner directly (its LLM's scheduler must stay idle meanwhile): rows
    [0, chunk_rows) of the batch, and the pages of each prepared text."""

    def __init__(self, runner, chunk_rows: int = 64, prefill_chunk: int = 8192) -> None:
        self.runner = runner
        self.ps = runner.page_size
        self.hkv = runner.num_kv_heads
        self.num_layers = runner.num_layers
        if chunk_rows > runner.cfg.scheduler.max_num_seqs:
            raise ValueError("chunk_rows exceeds the engine's max_num_seqs")
        self.chunk_rows = chunk_rows
        self.prefill_chunk = prefill_chunk
        self._rid = 0
        runner.keep_logits = True

    def pages(self, num_tokens: int, base: int = 0) -> np.ndarray:
        """[num_blocks, Hkv] physical pages of a text at `base` (block-major)."""
        nb = cdiv(num_tokens, self.ps)
        if base + nb * self.hkv > self.runner.cfg.cache.num_pages:
            raise ValueError("KV cache too small for the texts; raise kv_cache_memory_bytes")
        return base + np.arange(nb * self.hkv, dtype=np.int32).reshape(nb, self.hkv)

    def num_pages(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.ps) * self.hkv

    def new_id(self) -> str:
        self._rid += 1
        return f"fidelity-{self._rid}"

    def _runtime(self, cfg: SparseConfig):
        return self.runner.new_sparse_runtime(cfg)

    @torch.inference_mode()
    def prefill(self, tokens: list[int], prefix_len: int, base: int = 0,
                algorithms=("quest", "arkvale", "infllm")) -> Prepared:
        """Dense prefill of tokens[:prefix_len] (row 0, pages at `base`), then the prefix
        summaries of each summarised algorithm in `algorithms`."""
        runner = self.runner
        pages = self.pages(len(tokens), base)
        algos = [a for a in algorithms if get_algorithm_class(a).summary_names]
        query_algo = next((a for a in algos if get_algorithm_class(a).uses_queries), None)
        # a runtime of a query-aware algorithm (if any) indexes the prefix during prefill,
        # with the prefill's own queries, exactly as the engine's prefill does
        summaries = {}
        with runner.hooked(sparse=self._runtime(SparseConfig(query_algo)) if query_algo else None):
            rid = self.new_id()
            for s in range(0, prefix_len, self.prefill_chunk):
                e = min(prefix_len, s + self.prefill_chunk)
                chunk = ScheduledChunk(rid, 0, tokens[s:e], s, 0, self.num_layers,
                                       e == prefix_len, 0, 0, pages)
                runner.execute(SchedulerOutput(
                    [chunk], new_rows=[NewRow(0, rid, GREEDY)] if s == 0 else []))
            runner.execute(SchedulerOutput([], freed_rows=[0], freed_request_ids=[rid]))
            if query_algo:
                summaries[query_algo] = [dict(s.tensors) for s in runner.sparse.summaries]
        ids = torch.as_tensor(pages[:prefix_len // self.ps].reshape(-1), device=runner.device)
        ntok = torch.full_like(ids, self.ps)
        for a in algos:
            if a != query_algo:
                rt = self._runtime(SparseConfig(a))
                for layer in range(self.num_layers):
                    values = {"v_cache": runner.kv.v[layer]} if rt.algorithm.uses_values else {}
                    rt.algorithm.index(runner.kv.k[layer], ids, ntok, rt.summaries[layer], None,
                                       **values)
                summaries[a] = [dict(s.tensors) for s in rt.summaries]
        return Prepared(list(tokens), prefix_len, base, summaries)

    def runtime_for(self, prep: Prepared, setting: Setting):
        """A fresh SparseRuntime for `setting` holding the text's prefix summaries."""
        cfg = setting.sparse_config()
        if cfg is None:
            return None
        variant = VARIANTS.get(cfg.algorithm)
        if variant is not None:  # a proposed scoring over a registered algorithm's summaries
            cfg = dataclasses.replace(cfg, algorithm=variant)
        rt = self._runtime(cfg)
        if variant is not None:
            a = rt.algorithm
            rt.algorithm = CLASSES[setting.algorithm](a.page_size, a.budget_pages,
                                                      a.sink_pages, a.local_pages)
        saved = prep.summaries.get(cfg.algorithm)
        if rt.algorithm.summary_names and saved is None:
            raise ValueError(f"no prefix summaries for {cfg.algorithm}; pass it to prefill()")
        for layer, s in enumerate(rt.summaries):
            if s is not None:
                for name, t in s.tensors.items():
                    t.copy_(saved[layer][name])
        return rt

    # ---- the batched tail -------------------------------------------------------------------
    @torch.inference_mode()
    def run_tail(self, prep: Prepared, setting: Setting, fast: bool = True,
                 measure_recall: bool = True) -> TailResult:
        """Teacher-forced logits [tail, vocab] fp32 (row t predicts the token after position
        P + t) under `setting`, and the selections' recall vs the exact top-k.

        fast: evaluate decode attention (and oracle scores) from one shared q·K product per
        layer (fidelity_shared) instead of the CPU reference kernels' per-row gathers; the
        same math, tested equal to the engine kernels."""
        runner = self.runner
        rt = self.runtime_for(prep, setting)
        shared = SharedText(runner.kv, self.hkv, len(prep.tokens), runner.scale, prep.base)
        if rt is not None and fast:
            rt.algorithm = _fast_algorithm(rt.algorithm, shared)
        meter = None
        if rt is not None and measure_recall:
            a = rt.algorithm
            meter = RecallMeter(shared, self.ps, a.budget_pages, a.sink_pages, a.local_pages)
        attend = fast_decode_attention(shared) if fast else None
        with runner.hooked(sparse=rt, on_select=meter, decode_attention=attend):
            pages = self.pages(len(prep.tokens), prep.base)
            P, n = prep.prefix_len, len(prep.tokens) - prep.prefix_len
            out = []
            for t0 in range(0, n, self.chunk_rows):
                rows = range(min(self.chunk_rows, n - t0))
                ids = [self.new_id() for _ in rows]
                chunks = [ScheduledChunk(ids[r], r, [prep.tokens[P + t0 + r]], P + t0 + r, 0,
                                         self.num_layers, True, 0, 0, pages) for r in rows]
                shared.set_rows(torch.arange(P + t0 + 1, P + t0 + 1 + len(rows)))
                res = runner.execute(SchedulerOutput(
                    chunks, new_rows=[NewRow(r, ids[r], GREEDY) for r in rows]))
                runner.execute(SchedulerOutput([], freed_rows=list(rows), freed_request_ids=ids))
                out.append(res.logits)
            return TailResult(torch.cat(out), meter.summary() if meter else None)

    @torch.inference_mode()
    def run_sequential(self, prep: Prepared, setting: Setting, steps: int) -> torch.Tensor:
        """Reference: the first `steps` tail tokens decoded one step at a time (one decode row
        per step, as the engine decodes), engine kernels. -> [steps, vocab]."""
        runner = self.runner
        with runner.hooked(sparse=self.runtime_for(prep, setting)):
            pages = self.pages(len(prep.tokens), prep.base)
            rid = self.new_id()
            out = []
            for t in range(steps):
                pos = prep.prefix_len + t
                chunk = ScheduledChunk(rid, 0, [prep.tokens[pos]], pos, 0, self.num_layers,
                                       True, t, 0, pages)
                res = runner.execute(SchedulerOutput(
                    [chunk], new_rows=[NewRow(0, rid, GREEDY)] if t == 0 else []))
                out.append(res.logits)
            runner.execute(SchedulerOutput([], freed_rows=[0], freed_request_ids=[rid]))
            return torch.cat(out)


# algorithm base class -> f(the algorithm's class) -> its shared-text twin; evaluation scripts
# add theirs with register_fast (benchmarks/fidelity_shadowkv.py, fidelity_retroinfer.py)
_FAST_TWINS: list[tuple[type, object]] = []


def register_fast(base: type, make_twin) -> None:
    """Score `base` algorithms (and subclasses) from the shared text: make_twin(cls) -> a
    subclass of cls reading `self.shared` (checked against the generic path by its author)."""
    _FAST_TWINS.append((base, make_twin))


def _fast_algorithm(a, shared: SharedText):
    """The same selection, scored from the shared text (fidelity_shared), where one exists."""
    if isinstance(a, Oracle):
        cls = SharedOracle
    elif isinstance(a, Quest):  # quest, arkvale, their sub-page boxes and scoring variants
        cls = shared_bounds_class(type(a))
    elif isinstance(a, KeyCodeShortlist):  # before KeyCodes: its score is the shortlist's
        cls = shared_shortlist_class(type(a))
    elif isinstance(a, KeyCodes):
        cls = shared_codes_class(type(a))
    else:
        make = next((m for base, m in _FAST_TWINS if isinstance(a, base)), None)
        if make is None:
            return a
        cls = make(type(a))
    fast = cls(a.page_size, a.budget_pages, a.sink_pages, a.local_pages)
    fast.shared = shared
    return fast
