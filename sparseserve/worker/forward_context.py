"""The forward context: one per group of layers in a step, entered explicitly.

It tells attention where each new token's K/V goes (per-KV-head pages) and how to attend:
decode tokens (first `num_decode` rows) through the paged-decode kernel, prefill chunks
through SDPA over the request's own KV. Everything decode needs is derived on the device
from (rows, positions), so a decode-only step can be captured in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from sparseserve.kernels import paged_decode_attention
from sparseserve.kernels.paged_decode_cpu import decode_planned, plan_decode
from sparseserve.kernels.ref import merge_attention, paged_decode_lse
from sparseserve.worker.host_copy import pack_to_device
from sparseserve.worker.sparse_runtime import SparseRuntime
from sparseserve.worker.page_directory import PageDirectory


# Prefill attention backends of the chunks that continue a prefix (and of whole prompts beyond
# the cuDNN plans built at start-up, worker/prefill_attention.py), in priority order. Not cuDNN
# here: it builds an execution plan per new shape (42-75 ms of host time on the H200, torch
# 2.11), and every chunk's prefix length is new. Flash (GQA through enable_gqa), then
# memory-efficient, then math (fp32, CPU).
PREFILL_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                         SDPBackend.MATH]


@dataclass
class PrefillSeq:
    q_start: int  # first row of this chunk in the context's token batch
    q_end: int
    start: int  # tokens already in the KV cache before the chunk (its first position)
    row: int  # batch row of the request (index into the page table)
    slot_free: bool = False  # two-tier cache: a whole prompt that maps no slot (ScheduledChunk)
    resident_pages: int = 0  # ... except its newest pages per KV head (ScheduledChunk)
    # two-tier cache: the chunk's plans shared by its layer-segment steps
    # (worker/segment_plans.ChunkPlans), or None
    plans: Any = None


class KVCacheTensors:
    """Device K/V storage: per layer [num_pages, page_size, head_dim] each (owned by the worker)."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_pages, page_size, head_dim)
        # CPU: empty, not zeros -- zeroing commits every page of the cache at start-up (4 s of
        # a busy 2-core machine for the default 2 GiB); untouched memory costs nothing until a
        # token lands there, and no reader looks at a slot before it is written (attention
        # masks unwritten slots; the kernel tests fill caches with NaN)
        alloc = torch.empty if torch.device(device).type == "cpu" else torch.zeros
        self.k = [alloc(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [alloc(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.page_size = page_size


class ForwardContext:
    """Attention over paged KV for one token batch.

    pages:      the device page table of every running request (a chunk directory).
    rows:       [T] int64  batch row of each token's request
    positions:  [T] int64  absolute position of each token
    Rows [0, num_decode) are decode tokens (one per request, attending to positions <= own).
    """

    # whether attention's k / v may still be read after it returns (a side-stream saver):
    # callers that reuse those buffers for the next layer (piecewise graphs) pass copies
    reads_kv_after_attention = False
    # chunks continuing a prefix attend through kernels/paged_prefill.py: None = on the GPU
    # (Triton compiled); True also on CPU tensors (tests run it under Triton's interpreter)
    paged_prefill_kernel: bool | None = None

    def __init__(self, kv: KVCacheTensors, pages: PageDirectory, rows: torch.Tensor,
                 positions: torch.Tensor, num_decode: int, prefills: list[PrefillSeq],
                 scale: float, decode_width: int | None = None,
                 sparse: SparseRuntime | None = None, prefill_attention=None) -> None:
        self.kv = kv
        self.sparse = sparse
        # whole-prompt causal attention on prebuilt cuDNN plans (worker/prefill_attention.py):
        # f(q [n, Hq, D], k, v [n, Hkv, D]) -> [n, Hq, D] or None (declined: use SDPA here)
        self.prefill_attention = prefill_attention
        # evaluation hooks (set through ModelRunner.hooked): f(layer, q, selection, ctx) after
        # every sparse decode selection, and the decode attention (paged_decode_attention's
        # contract; this class's decode rows only, not the two-tier cache's; an ``lse``
        # attribute on it, paged_decode_lse's contract, replaces that too where an estimating
        # algorithm's merge needs the exact part's log-sum-exp)
        self.on_select = None
        self.decode_attention = paged_decode_attention
        self.pages = pages
        self.num_decode = num_decode
        self.prefills = prefills
        self.scale = scale
        self._dec_plan = None  # the CPU decode path's per-step plan (_dense_decode)
        self._prefix_pages: dict[int, torch.Tensor] = {}  # q_start -> a chunk's pages (_prefill)
        self._paged = False  # not planned yet (_paged_prefill_plan)
        self._paged_block_m = 0
        ps = kv.page_size
        hkv = pages.num_kv_heads
        # where each token's K/V lands: page [T, Hkv] and offset [T, 1] within it
        self.store_pages = pages.pages_at(rows, torch.div(positions, ps, rounding_mode="floor"))
        self.store_offsets = (positions % ps)[:, None]
        # the same as rows of a cache viewed [P * ps, D]: one index_copy_ per layer (7x faster
        # than a two-index index_put_ on the CPU, measured: 7 vs 49 us for 16 tokens x 3 heads)
        self.store_rows = (self.store_pages * ps + self.store_offsets).reshape(-1)
        if num_decode:
            drows = rows[:num_decode]
            seq_lens = positions[:num_decode] + 1
            self.dec_rows, self.dec_seq_lens = drows, seq_lens
            width = decode_width or pages.max_blocks
            self.dec_page_table = pages.table(drows, width)  # [Bd, Hkv, W]
            n_pages = torch.div(seq_lens + ps - 1, ps, rounding_mode="floor")
            self.dec_num_pages = n_pages[:, None].expand(-1, hkv).to(torch.int32).contiguous()
            self.dec_last_len = (seq_lens - (n_pages - 1) * ps).to(torch.int32)
        if sparse is not None:
            self._plan_index(rows, positions)

    def _plan_index(self, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """Pages that fill in this batch, for the algorithm's index().

        Entries: one per decode token (its page, masked to -1 unless this token fills it),
        then one per full page completed inside each prefill chunk; x Hkv heads each.
        `tok_entry` [T] maps the token that fills each page to its entry (-1: none); its
        queries are what query-aware algorithms (InfLLM) index with."""
        ps = self.kv.page_size
        dev = positions.device
        nd = self.num_decode
        ids = []
        tok_entry = torch.full_like(positions, -1)
        if nd:
            fills = ((positions[:nd] + 1) % ps == 0)[:, None]
            ids.append(torch.where(fills, self.store_pages[:nd], -1))
            tok_entry[:nd] = torch.arange(nd, device=dev)
        entries = nd
        for p in self.prefills:
            b0, b1 = p.start // ps, (p.start + p.q_end - p.q_start) // ps
            if b1 <= b0:
                continue
            ids.append(self.pages.row_range(p.row, b0, b1).t().long())  # [nb, Hkv]
            pos = positions[p.q_start:p.q_end]
            # the query of the token that fills the page (its last), as in decode, so the
            # summary does not depend on how the prompt was chunked
            blk = torch.div(pos, ps, rounding_mode="floor") - b0
            fills = (pos % ps == ps - 1) & (blk < b1 - b0)
            tok_entry[p.q_start:p.q_end] = torch.where(fills, entries + blk, -1)
            entries += b1 - b0
        self.num_fill_entries = entries
        self.fill_ids = torch.cat(ids).reshape(-1).to(torch.int32) if ids else None  # [E*Hkv]
        self.fill_tokens = torch.full_like(self.fill_ids, ps) if ids else None
        self.tok_entry = tok_entry

    def begin_layers(self, l0: int, l1: int) -> None:
        """Called before layers [l0, l1) run with this context (the two-tier cache maps a
        prefill's pages in all of them at once); nothing to do with every page in HBM."""

    def finish_layers(self, l0: int, l1: int) -> None:
        """Called after layers [l0, l1) ran with this context (the two-tier cache writes its
        staged decode rows through to DRAM here); nothing to do with every page in HBM."""

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> torch.Tensor:
        # q [T, Hq, D]; k, v [T, Hkv, D]
        k_cache, v_cache = self.kv.k[layer], self.kv.v[layer]
        d = k.shape[-1]
        k_cache.view(-1, d).index_copy_(0, self.store_rows, k.reshape(-1, d))
        v_cache.view(-1, d).index_copy_(0, self.store_rows, v.reshape(-1, d))
        sparse = self.sparse is not None and self.sparse.is_sparse(layer)
        if sparse and self.fill_ids is not None:
            self._index(layer, q, k_cache)
        nd = self.num_decode
        if nd and not sparse and not self.prefills:
            return self._dense_decode(q, k_cache, v_cache)  # a decode-only batch: no copy
        paged = self._paged_prefill_plan(q)
        if not nd and len(self.prefills) == 1 and paged is None:  # one chunk alone: no copy
            return self._prefill(self.prefills[0], q, k, v, k_cache, v_cache)
        out = torch.empty_like(q)
        if nd and sparse:
            sel = self.sparse.algorithm.select(q[:nd], self.dec_page_table, self.dec_num_pages,
                                               self.dec_last_len, self.sparse.summaries[layer],
                                               k_cache)
            if self.on_select is not None:
                self.on_select(layer, q[:nd], sel, self)
            out[:nd] = self.decode_attention(q[:nd], k_cache, v_cache, sel.page_table,
                                             sel.num_pages, sel.last_page_len, self.scale)
            if self.sparse.algorithm.estimates:
                lse = getattr(self.decode_attention, "lse", paged_decode_lse)
                out[:nd] = self._merge_estimate(q[:nd], out[:nd], sel, k_cache, sel.page_table,
                                                self.sparse.summaries[layer], lse)
        elif nd:
            # the Triton kernel on GPU, its torch reference on CPU
            out[:nd] = self._dense_decode(q[:nd], k_cache, v_cache)
        for p in self.prefills:
            if paged is None or p.start == 0:
                out[p.q_start:p.q_end] = self._prefill(p, q, k, v, k_cache, v_cache)
        if paged is not None:  # every chunk that continues a prefix, in one launch
            from sparseserve.kernels.paged_prefill import paged_prefill_attention
            paged_prefill_attention(q, k_cache, v_cache, *paged, self.scale,
                                    self._paged_block_m, out=out)
        return out

    def _paged_prefill_plan(self, q: torch.Tensor) -> tuple | None:
        """On the GPU (see `paged_prefill_kernel`) the chunks continuing a prefix attend in
        place from their pages (kernels/paged_prefill.py: no gathered or repeated copy of the
        prefix) -> (page table [S, Hkv, W], metadata...) planned once per step (every layer
        reuses it), or None."""
        if self._paged is not False:
            return self._paged
        chunks = [p for p in self.prefills if p.start > 0]
        self._paged = None
        if chunks and (q.is_cuda or self.paged_prefill_kernel):
            from sparseserve.kernels.paged_prefill import METADATA, block_tokens, plan_metadata
            ps = self.kv.page_size
            self._paged_block_m = block_tokens(q.shape[1], self.pages.num_kv_heads)
            meta = plan_metadata([p.q_end - p.q_start for p in chunks], [p.start for p in chunks],
                                 self._paged_block_m, [p.q_start for p in chunks])
            width = max(-(-(p.start + p.q_end - p.q_start) // ps) for p in chunks)
            dev = pack_to_device({"rows": np.asarray([p.row for p in chunks])}, meta, q.device)
            table = self.pages.table(dev["rows"], width).contiguous()
            self._paged = (table, *(dev[k] for k in METADATA))
        return self._paged

    def _dense_decode(self, q: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor) -> torch.Tensor:
        """Dense decode attention of the decode rows q [nd, Hq, D]. On the CPU path
        (kernels/paged_decode_cpu.py, no hook) the layer-independent part (which cache rows
        are attended) is planned once per step and reused by every layer."""
        if self.decode_attention is not paged_decode_attention or q.is_cuda:
            return self.decode_attention(q, k_cache, v_cache, self.dec_page_table,
                                         self.dec_num_pages, self.dec_last_len, self.scale)
        if self._dec_plan is None:
            self._dec_plan = plan_decode(self.dec_page_table, self.dec_num_pages,
                                         self.dec_last_len, self.kv.page_size,
                                         q.shape[1] // self.dec_page_table.shape[1])
        return decode_planned(q, k_cache, v_cache, self._dec_plan, self.scale)

    def _merge_estimate(self, q: torch.Tensor, o_sel: torch.Tensor, sel, k_cache: torch.Tensor,
                        attended: torch.Tensor, summaries, lse_fn=paged_decode_lse) -> torch.Tensor:
        """The exact attention over the selection ``o_sel`` [B, Hq, D] merged by log-sum-exp
        with the algorithm's estimate of the unselected tokens (``SparseAlgorithm.estimate``):
        ``attended`` [B, Hkv, W'] is the table attend read ``k_cache`` through (the selection's
        pages here, device slots under offload). Fixed shapes, no host sync."""
        est = self.sparse.algorithm.estimate(q, sel, self.dec_page_table, self.dec_num_pages,
                                             summaries, self.scale)
        if est is None:
            return o_sel
        lse_sel = lse_fn(q, k_cache, attended, sel.num_pages, sel.last_page_len, self.scale)
        return merge_attention(o_sel, lse_sel, est[0], est[1])

    def _index(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor) -> None:
        queries = None
        if self.sparse.needs_queries:
            hkv = self.pages.num_kv_heads
            t, hq, d = q.shape
            e = self.num_fill_entries
            # tokens without an entry add into a dropped extra row (no boolean mask: no sync)
            target = torch.where(self.tok_entry >= 0, self.tok_entry, e)
            acc = torch.zeros((e + 1, hq, d), dtype=torch.float32, device=q.device)
            acc.index_add_(0, target, q.float())
            queries = acc[:e].view(e, hkv, hq // hkv, d).reshape(-1, hq // hkv, d)  # [E*Hkv, G, D]
        algo = self.sparse.algorithm
        values = {"v_cache": self.kv.v[layer]} if algo.uses_values else {}
        algo.index(k_cache, self.fill_ids, self.fill_tokens, self.sparse.summaries[layer],
                   queries, **values)

    def _prefill(self, p: PrefillSeq, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        n = p.q_end - p.q_start
        qs = q[p.q_start:p.q_end].transpose(0, 1)  # [Hq, n, D]
        if p.start == 0:
            ks = k[p.q_start:p.q_end].transpose(0, 1)  # [Hkv, n, D]
            vs = v[p.q_start:p.q_end].transpose(0, 1)
        else:
            total = p.start + n
            ps = self.kv.page_size
            pages = self._prefix_pages.get(p.q_start)  # the same at every layer of the step
            if pages is None:
                pages = self._prefix_pages[p.q_start] = self.pages.row_range(
                    p.row, 0, (total + ps - 1) // ps).long()  # [Hkv, nb]
            hkv, nb = pages.shape
            ks = k_cache[pages].reshape(hkv, nb * ps, -1)[:, :total]
            vs = v_cache[pages].reshape(hkv, nb * ps, -1)[:, :total]
        return self._sdpa(qs, ks, vs, p.start)

    def _sdpa(self, qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
              start: int) -> torch.Tensor:
        """Causal attention of a chunk: qs [Hq, n, D] at positions [start, start + n) over
        ks/vs [Hkv, start + n, D] -> [n, Hq, D]. A whole prompt (start 0) goes to the prebuilt
        cuDNN plans when there is one for its length (worker/prefill_attention.py)."""
        n, total = qs.shape[1], ks.shape[1]
        if start == 0 and self.prefill_attention is not None:
            out = self.prefill_attention(qs.transpose(0, 1), ks.transpose(0, 1),
                                         vs.transpose(0, 1))
            if out is not None:
                return out
        if start == 0:
            mask, causal = None, True
        else:
            # causal aligned to the bottom right (query i sees keys <= start + i), which keeps
            # SDPA on its fused kernels instead of materialising a [n, total] mask
            mask, causal = causal_lower_right(n, total), False
            if qs.shape[0] != ks.shape[0]:  # the lower-right bias path has no GQA flag
                g = qs.shape[0] // ks.shape[0]
                ks, vs = ks.repeat_interleave(g, 0), vs.repeat_interleave(g, 0)
        gqa = {"enable_gqa": True} if qs.shape[0] != ks.shape[0] else {}
        with sdpa_kernel(PREFILL_SDPA_BACKENDS):
            out = F.scaled_dot_product_attention(qs.unsqueeze(0), ks.unsqueeze(0),
                                                 vs.unsqueeze(0), attn_mask=mask,
                                                 is_causal=causal, scale=self.scale, **gqa)
        return out[0].transpose(0, 1)  # [n, Hq, D]
