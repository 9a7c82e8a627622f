"""CUDA graphs of the two-tier cache's layer-segmented prefill: one graph per (layer, token
bucket) holding the whole layer (issue 12, item 2).

A prompt prefilled in layer segments (the sparseserve preset) is a slot-free chunk of its
whole length from position 0 (ScheduledChunk.slot_free) that runs layers [a, c) in a step.
Eagerly each such layer costs ~22 launches and ~2 ms of host time (the GPU-direct save on a
side stream with its events, the store into the mapped slots, the page summaries, cuDNN's
attention with its padding copies, the GEMMs and fused norms), so a 2,048-token step over 32
layers was host-bound (68 % host share on the H100, engine.md, twenty-sixth session). Every
one of those ops depends on the step only through a few index arrays, so here they read them
from static device buffers and the layer is captured once per token bucket:

    norm + qkv + RoPE -> fork: GPU-direct save of k / v to DRAM (side stream, capped grid)
    -> store k / v into the slots the step mapped (tok_entry gathers each token's slot)
    -> summaries of the pages the prompt completes -> causal attention (cuDNN's plan of the
    bucket) -> O projection, norm, MLP -> join the save

Per run (a slot-free prompt's layer segment; a step runs one per such prompt and layer
interval, one after another over the same static buffers) the host stages the plan (save
destinations, each token's page entry and offset, the completed pages' host ids: one
host-to-device copy from a pinned buffer of a ring that never waits, worker/plan_staging.PlanStaging), maps the
prompt's pages in every layer of the segment with the fused retrieve (as the eager path does,
a handful of launches, then one copy of the slots into a static table), replays one graph per
layer, rebuilds the residency indexes and issues one save ticket (an event on the saver's side
stream, after the compute stream: it covers the step's saves and every earlier one, as the
saver's tickets do).

Padding: a step of T tokens runs the bucket b >= T. Rows [T, b) have a zero stream and the
positions T.. (causal attention: no real row sees them), save to no page (page -1), store
into the scratch slot (the static slot table's last column), and complete no page (their
summaries are skipped: read id -1). Their stream and residual stay zero from layer to layer
(each layer writes its outputs in place, then zeroes those rows: two index_fill_ over the
rows t .. t + the largest bucket step, past n the scratch row n; the index set once per run),
so their q / k / v
are those of a zero row (zero without a qkv bias, finite with one): no NaN can reach
attention's P @ V through a padded key (0 * NaN), as the eager path's zero padding ensures.
Buckets are the cuDNN plans' lengths (prefill_attention.bucket_lengths), so the eager path and
the graph attend over the same padded length. The stream enters as x with a zero residual
(x + 0 is x: the same roundings as the eager path's first layer without one).

Without `capture` (CPU, tests) the layers run as plain calls over the same buffers (Triton's
interpreter for the kernels where the test forces them), which exercises everything but the
capture itself.
"""
from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from sparseserve.kernels.slot_store import store_token_rows
from sparseserve.transfer.common import TransferStats
from sparseserve.transfer.gpu_direct import SIDE_STREAM_MAX_PROGRAMS, save_rows
from sparseserve.worker.forward_context import PREFILL_SDPA_BACKENDS
from sparseserve.worker.graph_capture import capture_all, smallest_bucket
from sparseserve.worker.host_copy import pack_to_device
from sparseserve.worker.page_index import index_pages
from sparseserve.worker.plan_staging import PlanStaging

logger = logging.getLogger("sparseserve")

# the largest prompt (tokens) whose segments replay graphs: above it a layer's GEMMs take
# >= ~8 ms on an H100 and the eager host time (~2 ms per layer) is a small share of it, while
# the graphs' static buffers and pool grow with the bucket (engine/memory_plan.py counts them)
MAX_TOKENS = 8192
class TwoTierPrefillGraphs:
    """Per-layer graphs of a slot-free two-tier prefill (module docstring).

    runner: the ModelRunner (model on the fused path, kv, pages, offload cache with GPU-direct
    saves, sparse runtime, prefill attention); buckets: ascending token counts."""

    def __init__(self, runner, buckets: list[int], capture: bool = True) -> None:
        if not buckets:
            raise ValueError("two-tier prefill graphs need at least one token bucket")
        self.model, self.pages = runner.model, runner.pages
        self.cache, self.sparse = runner.offload, runner.sparse
        self.prefill_attn = runner.prefill_attn
        self.scale = runner.scale
        self.layers = self.model.model.layers
        self.num_layers = len(self.layers)
        self.buckets, self.capture_graphs = list(buckets), capture
        attn = self.layers[0].self_attn
        self.hq, self.hkv, self.d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.ps = ps = runner.page_size
        n, hkv = self.buckets[-1], self.hkv
        self.nbmax = nb = -(-n // ps)  # pages a prompt of the largest bucket spans
        w = self.model.model.norm.weight
        dev, dt = w.device, w.dtype
        self.device = dev
        # the static stream and residual: rows 0..n-1, and row n, a scratch row the padding
        # index points past the largest bucket to (each layer writes its outputs in place)
        self.x = torch.zeros(n + 1, self.model.config.hidden_size, dtype=dt, device=dev)
        self.residual = torch.zeros_like(self.x)
        # RoPE factors of positions 0.. (a slot-free prompt starts at 0); rows past the
        # model's table are padding only: position 0's
        table = self.model.rope.full_table(dev)
        m = min(n, table.shape[0])
        self.rope = table[:1].repeat(n, 1, 1).float()  # [n, 2, D]
        self.rope[:m] = table[:m]
        # each layer's slots of the prompt's pages [L, Hkv, nb + 1] int32; the last column is
        # the scratch slot, where tokens whose page is not kept resident (and padding) go
        self.slots = torch.full((self.num_layers, hkv, nb + 1), self.cache.scratch_slot,
                                dtype=torch.int32, device=dev)
        # the step's plan, int64: save pages [n, Hkv], save offsets [n], tok_entry [n],
        # tok_off [n], completed pages' host ids [Hkv * nb] (head-major, nf_b = b // ps per
        # head for bucket b), fill_pos [nb] (the row completing each page); int32: read ids
        # [Hkv * nb] (-1: skipped)
        sizes64 = [n * hkv, n, n, n, hkv * nb, nb]
        self._i64 = torch.zeros(sum(sizes64), dtype=torch.long, device=dev)
        (save_pages, self.save_offs, self.tok_entry, self.tok_off, self.host_ids,
         self.fill_pos) = torch.split(self._i64, sizes64)
        self.save_pages = save_pages.view(n, hkv)
        self.read = torch.zeros(hkv * nb, dtype=torch.int32, device=dev)
        self.ntok = torch.full((hkv * nb,), ps, dtype=torch.int32, device=dev)
        # the run's padding rows t, t + 1, .. (fewer than a bucket step; past the largest
        # bucket: the scratch row n), set once per run: each layer zeroes their stream and
        # residual (module docstring)
        steps = [hi - lo for lo, hi in zip([0] + self.buckets[:-1], self.buckets)]
        self._pad_rows = torch.arange(max(steps), dtype=torch.long, device=dev)
        self.pad_idx = torch.full_like(self._pad_rows, n)
        pin = dev.type == "cuda"
        self.staging = PlanStaging(lambda: (
            torch.zeros(self._i64.shape, dtype=torch.long, pin_memory=pin),
            torch.zeros(self.read.shape, dtype=torch.int32, pin_memory=pin)))
        self._save_stream = torch.cuda.Stream(device=dev) if dev.type == "cuda" else None
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = None

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def bucket(self, n: int) -> int | None:
        return smallest_bucket(self.buckets, n)

    def runs(self, chunk) -> bool:
        """Whether a prefill chunk alone in its layers' context runs here: a slot-free prompt
        (its whole length from position 0) within the largest bucket."""
        return (not chunk.is_decode and chunk.slot_free and chunk.start == 0
                and chunk.num_tokens <= self.max_tokens)

    # ---- the captured layer ----------------------------------------------------------------
    def _layer(self, layer: int, b: int) -> None:
        """Layer `layer` over the static stream's first b rows (module docstring)."""
        lyr, cache = self.layers[layer], self.cache
        hkv, ps, d = self.hkv, self.ps, self.d
        qkv, res = lyr.attention_inputs(self.x[:b], self.residual[:b],
                                        (self.rope[:b, 0:1], self.rope[:b, 1:2]),
                                        res_out=self.residual[:b])  # in place
        q, k, v = lyr.self_attn.split_qkv(qkv)
        side = self._save(layer, k, v, b)
        store_token_rows(self.slots[layer], self.tok_off[:b], k, v, cache.dev_k[layer],
                         cache.dev_v[layer], tok_entry=self.tok_entry[:b])
        nf = b // ps
        if nf:
            algo = self.sparse.algorithm
            pages_k = k.transpose(0, 1)[:, :nf * ps].reshape(hkv * nf, ps, d).contiguous()
            pages_v = v.transpose(0, 1)[:, :nf * ps].reshape(hkv * nf, ps, d).contiguous() \
                if algo.uses_values else None
            queries = None
            if algo.uses_queries:  # the query of each completing row, per KV head's group
                qf = q[self.fill_pos[:nf]].float()  # [nf, Hq, D]
                queries = qf.view(nf, hkv, -1, d).transpose(0, 1).reshape(hkv * nf, -1, d)
            index_pages(algo, cache.scratch_page, pages_k, self.read[:hkv * nf],
                        self.host_ids[:hkv * nf], self.ntok[:hkv * nf],
                        self.sparse.summaries[layer], queries, pages_v)
        out = self._attend(q, k, v).reshape(b, -1)
        # the MLP's output and the stream written in place (two torch.where copies into the
        # static buffers cost 51 us a layer at 2k on the H100: engine.md, twenty-eighth
        # session), then the padding rows back to zero (their next layer's k / v: a zero
        # row's, so no NaN reaches attention's P @ V through a padded key)
        lyr.attention_outputs(out, res, out=self.x[:b], res_out=self.residual[:b])
        self.x.index_fill_(0, self.pad_idx, 0)
        self.residual.index_fill_(0, self.pad_idx, 0)
        if side is not None:  # join the save (k / v stay referenced until here)
            torch.cuda.current_stream(self.device).wait_stream(side)

    def _save(self, layer: int, k: torch.Tensor, v: torch.Tensor, b: int):
        """k / v [b, Hkv, D] written to their DRAM pages (padding rows: page -1, skipped) on
        the side stream on CUDA (-> the stream to join), synchronously otherwise (-> None)."""
        hk, hv = self.cache.host_k[layer], self.cache.host_v[layer]
        pages, offs = self.save_pages[:b], self.save_offs[:b, None].expand(b, self.hkv)
        if self._save_stream is None:
            save_rows(hk, hv, k, v, pages, offs)
            return None
        side = self._save_stream
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            save_rows(hk, hv, k, v, pages, offs, max_programs=SIDE_STREAM_MAX_PROGRAMS)
        return side

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of the bucket's rows from position 0 -> [b, Hq, D]: the eager
        path's (ForwardContext._sdpa at start 0) on the padded rows."""
        if self.prefill_attn is not None:
            out = self.prefill_attn(q, k, v)
            if out is not None:
                return out
        gqa = {"enable_gqa": True} if self.hq != self.hkv else {}
        with sdpa_kernel(PREFILL_SDPA_BACKENDS):
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                is_causal=True, scale=self.scale, **gqa)
        return out[0].transpose(0, 1)

    @torch.inference_mode()
    def capture(self) -> None:
        """Every (layer, bucket) graph, largest bucket first, with the idle plan (no save, no
        completed page, every token stored into the scratch slot). A no-op without
        `capture`."""
        i, (h64, h32) = self.staging.take()
        self._idle(h64, h32)
        self._i64.copy_(h64)
        self.read.copy_(h32)
        self.staging.issued(i, None)  # a blocking copy: complete
        self.pad_idx.fill_(self.max_tokens)
        if not self.capture_graphs:
            return
        keys = [(layer, b) for b in reversed(self.buckets) for layer in range(self.num_layers)]
        try:
            self.graphs, _, self.pool = capture_all(keys, lambda key: self._layer(*key))
        except torch.OutOfMemoryError:
            raise  # no other attention kernel would fit either (capture_two_tier_graphs)
        except RuntimeError as e:
            if self.prefill_attn is None:
                raise
            # taken for cuDNN's attention not capturing: flash's does (the graphs then attend
            # with another kernel than the eager path: equal to rounding); the error is logged
            # whole, in case it was something else that the retry hits again (then it raises)
            logger.warning("two-tier prefill graphs: capture with cuDNN attention failed "
                           "(%s: %s); capturing with flash", type(e).__name__, e)
            torch.cuda.synchronize()
            self.prefill_attn = None
            self.graphs, _, self.pool = capture_all(keys, lambda key: self._layer(*key))
        logger.info("two-tier prefill graphs: %d captured (%d layers x buckets %s)",
                    len(self.graphs), self.num_layers, self.buckets)
        self.x.zero_()
        self.residual.zero_()

    def _idle(self, h64: torch.Tensor, h32: torch.Tensor) -> None:
        n, hkv, nb = self.max_tokens, self.hkv, self.nbmax
        h64.zero_()
        h64[:n * hkv] = -1  # save pages: none
        h64[n * hkv + n:n * hkv + 2 * n] = nb  # tok_entry: the scratch column
        h64[n * hkv + 3 * n:n * hkv + 3 * n + hkv * nb] = self.cache.scratch_page  # host ids
        h32.fill_(-1)  # read ids: skipped

    # ---- a step -----------------------------------------------------------------------------
    def run(self, h: torch.Tensor, chunk, a: int, c: int) -> torch.Tensor:
        """Layers [a, c) of a slot-free prompt chunk (`runs`) over its stream h [T, hidden]
        -> the stream after them (a new tensor)."""
        t = h.shape[0]
        b = self.bucket(t)
        if b is None or not self.runs(chunk) or t != chunk.num_tokens:
            raise ValueError(f"a chunk of {t} tokens does not run in the two-tier prefill "
                             f"graphs ({self.max_tokens} tokens, slot-free prompts only)")
        cache = self.cache
        pages, first = self._stage(chunk, t, b)
        nb = pages.shape[1]
        if first < nb:  # map the kept pages in every layer of the segment (as eagerly)
            self._map(chunk, pages, first, a, c)
        torch.add(self._pad_rows, t, out=self.pad_idx)  # padding rows t .. b - 1 (and on)
        self.pad_idx.clamp_(max=self.max_tokens)
        self.x[:t].copy_(h)
        if b > t:
            self.x[t:b].zero_()
        self.residual[:b].zero_()
        for layer in range(a, c):
            g = self.graphs.get((layer, b))
            if g is not None:
                g.replay()
            else:
                self._layer(layer, b)
        out = self.residual[:t] + self.x[:t]
        cache.rebuild_indexes(a, c)  # the retrieves deferred it, as a lone prefill's do
        self._issue_ticket(t, nb, c - a)
        return out

    def _stage(self, chunk, t: int, b: int) -> tuple[np.ndarray, int]:
        """The step's plan into the static buffers (one host-to-device copy) -> (the prompt's
        host pages [Hkv, nb], the first page kept resident)."""
        n, hkv, ps, nbmax = self.max_tokens, self.hkv, self.ps, self.nbmax
        nb = -(-t // ps)
        pages = self.pages.host_pages(np.full(nb, chunk.row), np.arange(nb)).T  # [Hkv, nb]
        first = nb - min(chunk.resident_pages, nb)
        turn, (h64, h32) = self.staging.take()  # no copy reads it any more: no wait
        self._idle(h64, h32)
        a64 = h64.numpy()
        pos = np.arange(t)
        blk = pos // ps
        a64[:t * hkv] = pages[:, blk].T.reshape(-1)  # save pages [t, Hkv]
        o = n * hkv
        a64[o:o + t] = pos % ps  # save offsets
        entry = blk - first
        a64[o + n:o + n + t] = np.where(entry >= 0, entry, nbmax)  # tok_entry
        a64[o + 2 * n:o + 2 * n + t] = pos % ps  # tok_off
        nf, nfb = t // ps, b // ps
        if nf:  # the pages the prompt completes, head-major with nf_b pages per head
            ids = a64[o + 3 * n:o + 3 * n + hkv * nfb].reshape(hkv, nfb)
            ids[:, :nf] = pages[:, :nf]
            rd = h32.numpy()[:hkv * nfb].reshape(hkv, nfb)
            rd[:, :nf] = np.arange(hkv * nfb).reshape(hkv, nfb)[:, :nf]
            f0 = o + 3 * n + hkv * nbmax
            a64[f0:f0 + nf] = np.arange(nf) * ps + ps - 1
        self._i64.copy_(h64, non_blocking=True)
        self.read.copy_(h32, non_blocking=True)
        self.staging.issued(turn, self._copy_event())
        return pages, first

    def _copy_event(self):
        """An event completing with the copies just issued (None off CUDA: they have)."""
        if not self._i64.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _map(self, chunk, pages: np.ndarray, first: int, a: int, c: int) -> None:
        """The prompt's pages [first, nb) of every KV head mapped to slots in layers [a, c)
        (all fresh: nothing loads), marked pending their save, into the static slot table."""
        cache, hkv = self.cache, self.hkv
        k = pages.shape[1] - first
        plan = pack_to_device({"row": np.full((1,), chunk.row)},
                              {"sel": pages[:, first:].reshape(1, hkv, k),
                               "num": np.full((1, hkv), k), "fresh": np.zeros((1, hkv))},
                              self.device)
        if cache.maps_layers_at_once():
            slots = cache.map_prefill_layers(a, c, plan["sel"], plan["num"], plan["row"],
                                             plan["fresh"], defer_rebuild=True)[0]
            self.slots[a:c, :, :k].copy_(slots[:, 0])
            cache.load_layer(a, None, None, None)  # the loader's counter, as eagerly
            return
        for layer in range(a, c):
            raw = cache.retrieve(layer, plan["sel"], plan["num"], plan["row"],
                                 fresh_from=plan["fresh"], prefill=True, defer_rebuild=True,
                                 mark_pending=True, loads=False)
            self.slots[layer, :, :k].copy_(raw[0])

    def _issue_ticket(self, t: int, nb: int, layers: int) -> None:
        """One save ticket for the segment's saves (each graph joined its own)."""
        rows = t * self.hkv * layers
        stats = TransferStats(layers, nb * self.hkv * layers, rows,
                              2 * rows * self.d * self.x.element_size())
        self.cache.issue_saves(self.device, stats)


def capture_two_tier_graphs(runner):
    """The runner's two-tier prefill graphs where its config asks for them
    (memory_plan.captures_two_tier_graphs), captured; None otherwise or after a failed
    capture (a warning: those segments run eagerly, correct and slower)."""
    from sparseserve.engine.two_tier_graph_plan import (captures_two_tier_graphs,
                                                        two_tier_graph_buckets)
    cfg = runner.cfg
    if not captures_two_tier_graphs(cfg) or runner.offload is None or runner.sparse is None:
        return None
    try:
        graphs = TwoTierPrefillGraphs(runner, two_tier_graph_buckets(cfg))
        graphs.capture()
        return graphs
    except Exception as e:  # noqa: BLE001
        logger.warning("two-tier prefill graph capture failed, layer segments run eagerly: "
                       "%s: %s", type(e).__name__, e)
        torch.cuda.synchronize()
        return None
