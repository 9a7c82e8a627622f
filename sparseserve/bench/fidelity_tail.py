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

from dataclasses import dataclass

import numpy as np
import torch

from sparseserve.config import SparseConfig
from sparseserve.engine.sched_output import NewRow, ScheduledChunk, SchedulerOutput
from sparseserve.kvcache.manager import cdiv
from sparseserve.request import SamplingParams
from sparseserve.sparse import get_algorithm_class
from sparseserve.worker.sparse_runtime import SparseRuntime

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)
INDEX_ONLY = ("quest", "arkvale")  # summaries computed from the keys alone


@dataclass(frozen=True)
class Setting:
    """One evaluated configuration (the engine's sparse knobs)."""

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


class TailHarness:
    """Drives a ModelRunner directly (its LLM's scheduler must stay idle meanwhile).

    Uses batch rows [0, chunk_rows) and physical pages [0, cdiv(len, ps) * Hkv)."""

    def __init__(self, runner, chunk_rows: int = 64, prefill_chunk: int = 2048) -> None:
        self.runner = runner
        self.ps = runner.page_size
        self.hkv = runner.num_kv_heads
        self.num_layers = runner.num_layers
        if chunk_rows > runner.cfg.scheduler.max_num_seqs:
            raise ValueError("chunk_rows exceeds the engine's max_num_seqs")
        self.chunk_rows = chunk_rows
        self.prefill_chunk = prefill_chunk
        self._rid = 0
        self.tokens: list[int] = []
        self.prefix_len = 0
        self.prefix_summaries: dict[str, list[dict[str, torch.Tensor]]] = {}
        self.on_select = None  # f(layer, q, selection, ctx) for every sparse decode selection
        runner.keep_logits = True
        self._install_hook()

    # ---- setup ------------------------------------------------------------------------------
    def _install_hook(self) -> None:
        runner, orig = self.runner, self.runner._context

        def context(*a, **k):
            ctx = orig(*a, **k)
            if self.on_select is not None:
                ctx.on_select = self.on_select
            return ctx

        runner._context = context

    def pages(self, num_tokens: int) -> np.ndarray:
        """[num_blocks, Hkv] physical pages of the text (block-major)."""
        nb = cdiv(num_tokens, self.ps)
        if nb * self.hkv > self.runner.cfg.cache.num_pages:
            raise ValueError("KV cache too small for the text")
        return np.arange(nb * self.hkv, dtype=np.int32).reshape(nb, self.hkv)

    def _new_id(self) -> str:
        self._rid += 1
        return f"fidelity-{self._rid}"

    @torch.inference_mode()
    def prefill(self, tokens: list[int], prefix_len: int, algorithms=("quest", "arkvale",
                                                                        "infllm")) -> None:
        """Dense prefill of tokens[:prefix_len] at row 0; then the prefix summaries of each
        summarised algorithm in `algorithms`."""
        runner = self.runner
        self.tokens, self.prefix_len = list(tokens), prefix_len
        pages = self.pages(len(tokens))
        algos = [a for a in algorithms if get_algorithm_class(a).summary_names]
        query_algo = next((a for a in algos if get_algorithm_class(a).uses_queries), None)
        saved = runner.sparse
        # a runtime of a query-aware algorithm (if any) indexes the prefix during prefill
        runner.sparse = self._runtime(SparseConfig(query_algo)) if query_algo else None
        try:
            rid = self._new_id()
            for s in range(0, prefix_len, self.prefill_chunk):
                e = min(prefix_len, s + self.prefill_chunk)
                chunk = ScheduledChunk(rid, 0, tokens[s:e], s, 0, self.num_layers,
                                       e == prefix_len, 0, 0, pages)
                runner.execute(SchedulerOutput(
                    [chunk], new_rows=[NewRow(0, rid, GREEDY)] if s == 0 else []))
            runner.execute(SchedulerOutput([], freed_rows=[0], freed_request_ids=[rid]))
            self.prefix_summaries = {}
            if query_algo:
                self.prefix_summaries[query_algo] = [
                    {n: t.clone() for n, t in s.tensors.items()} for s in runner.sparse.summaries]
        finally:
            runner.sparse = saved
        full = pages[:prefix_len // self.ps].reshape(-1)
        ids = torch.as_tensor(full, device=runner.device)
        ntok = torch.full_like(ids, self.ps)
        for a in algos:
            if a == query_algo:
                continue
            rt = self._runtime(SparseConfig(a))
            for layer in range(self.num_layers):
                rt.algorithm.index(runner.kv.k[layer], ids, ntok, rt.summaries[layer], None)
            self.prefix_summaries[a] = [dict(s.tensors) for s in rt.summaries]

    def _runtime(self, cfg: SparseConfig) -> SparseRuntime:
        r = self.runner
        return SparseRuntime(cfg, self.num_layers, r.cfg.cache.num_pages, self.ps,
                             r.cfg.model.head_dim, r.dtype, r.device)

    def runtime_for(self, setting: Setting) -> SparseRuntime | None:
        cfg = setting.sparse_config()
        if cfg is None:
            return None
        rt = self._runtime(cfg)
        saved = self.prefix_summaries.get(cfg.algorithm)
        if rt.algorithm.summary_names and saved is None:
            raise ValueError(f"no prefix summaries for {cfg.algorithm}; pass it to prefill()")
        for layer, s in enumerate(rt.summaries):
            if s is not None:
                for name, t in s.tensors.items():
                    t.copy_(saved[layer][name])
        return rt

    # ---- the batched tail -------------------------------------------------------------------
    @torch.inference_mode()
    def run_tail(self, setting: Setting) -> torch.Tensor:
        """Teacher-forced logits [tail, vocab] fp32 for tokens P+1 .. len (row t predicts the
        token after position P + t) under `setting`."""
        runner = self.runner
        saved = runner.sparse
        runner.sparse = self.runtime_for(setting)
        try:
            pages = self.pages(len(self.tokens))
            P, n = self.prefix_len, len(self.tokens) - self.prefix_len
            out = []
            for t0 in range(0, n, self.chunk_rows):
                rows = range(min(self.chunk_rows, n - t0))
                ids = [self._new_id() for _ in rows]
                chunks = [ScheduledChunk(ids[r], r, [self.tokens[P + t0 + r]], P + t0 + r, 0,
                                         self.num_layers, True, 0, 0, pages) for r in rows]
                res = runner.execute(SchedulerOutput(
                    chunks, new_rows=[NewRow(r, ids[r], GREEDY) for r in rows]))
                runner.execute(SchedulerOutput([], freed_rows=list(rows), freed_request_ids=ids))
                out.append(res.logits)
            return torch.cat(out)
        finally:
            runner.sparse = saved

    @torch.inference_mode()
    def run_sequential(self, setting: Setting, steps: int) -> torch.Tensor:
        """Reference: the first `steps` tail tokens decoded one step at a time (one decode
        row per step, as the engine does). Call right after prefill(). -> [steps, vocab]."""
        runner = self.runner
        saved = runner.sparse
        runner.sparse = self.runtime_for(setting)
        try:
            pages = self.pages(len(self.tokens))
            rid = self._new_id()
            out = []
            for t in range(steps):
                pos = self.prefix_len + t
                chunk = ScheduledChunk(rid, 0, [self.tokens[pos]], pos, 0, self.num_layers,
                                       True, t, 0, pages)
                res = runner.execute(SchedulerOutput(
                    [chunk], new_rows=[NewRow(0, rid, GREEDY)] if t == 0 else []))
                out.append(res.logits)
            runner.execute(SchedulerOutput([], freed_rows=[0], freed_request_ids=[rid]))
            return torch.cat(out)
        finally:
            runner.sparse = saved
