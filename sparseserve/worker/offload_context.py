"""Forward context over the two-tier cache: page ids are host page ids; decode attends to
device slots that `retrieve` fills; new K/V is written through to DRAM.

Per layer: save new K/V (FlashD2H) -> decode: select over host pages (summaries stay in HBM)
-> retrieve (hits map to slots, misses are loaded by FlashH2D) -> store the decode token in its
(resident) last page -> index pages that filled -> attend over slots. Prefill chunks map all their
pages to slots (the prefix stays resident between chunks), store their K/V there, attend over
the slots (device to device; no prefix byte crosses PCIe while it is in HBM) and are indexed
from that contiguous K.
"""
from __future__ import annotations

import numpy as np
import torch

from sparseserve.kernels import paged_decode_attention
from sparseserve.kernels.slot_store import store_token_rows
from sparseserve.sparse import LayerSummaries
from sparseserve.worker.forward_context import ForwardContext, PrefillSeq
from sparseserve.worker.host_copy import pack_to_device
from sparseserve.worker.offload_cache import TwoTierCache
from sparseserve.worker.page_index import index_pages


class OffloadForwardContext(ForwardContext):
    reads_kv_after_attention = True  # the savers write k / v to DRAM from a side stream

    def __init__(self, *args, cache: TwoTierCache, save_dest=None, decode_fills: bool = True,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cache = cache
        # False: the host checked that no decode token of this step completes a page, so
        # indexing the filled pages (~19 launches per layer, masked to nothing on such a step)
        # is skipped; True: a token may fill its page (summarised on the device, masked)
        self.decode_fills = decode_fills
        # () -> ([T, Hkv] host page of each new token and head, [T] offsets): for the saver
        # (CPU side), called only where no segment's plan has them; None in a captured decode
        # step, whose saves are all direct
        self.save_dest = save_dest
        self._save_plan = None  # made at the first layer that saves, reused by the others
        self._prefill_plans: dict[int, dict] = {}  # q_start -> _prefill_plan (same reuse)
        self._staged = False  # decode rows staged for their write-through (finish_layers)
        # one prefill alone maps its pages with one retrieve per layer: its residency index
        # rebuild-if-full can wait for finish_layers, as decode's does (fused_retrieve)
        self._defer_prefill_rebuild = not self.num_decode and len(self.prefills) == 1
        # [l0, l1) of begin_layers: a prefill maps its pages in all of them at once
        # (TwoTierCache.map_prefill_layers) where no decode row runs in this context — with
        # decode rows here, each layer's decode retrieve must come before the prefill's
        # mapping of that layer, as the per-layer path orders them
        self._layers: tuple[int, int] | None = None

    def begin_layers(self, l0: int, l1: int) -> None:
        if not self.num_decode and self.cache.maps_layers_at_once():
            self._layers = (l0, l1)

    def finish_layers(self, l0: int, l1: int) -> None:
        """After layers [l0, l1) ran with this context: the decode step's per-step work of
        those layers in one set of launches each (TwoTierCache.finish_decode: the residency
        indexes' rebuild-if-full, and the staged decode rows written through to DRAM) on the
        compute stream, so before any later step reads those tables or loads those pages."""
        if not self.num_decode:
            if self._defer_prefill_rebuild:
                self.cache.rebuild_indexes(l0, l1)
            return
        nd = self.num_decode
        staged = self._staged
        self._staged = False
        self.cache.finish_decode(l0, l1, self.store_pages[:nd] if staged else None,
                                 self.store_offsets[:nd].view(-1) if staged else None)

    def _plan_index(self, rows: torch.Tensor, positions: torch.Tensor) -> None:
        pass  # pages are indexed through the two tiers (see _index_via_scratch)

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        nd = self.num_decode
        if nd and cache.direct_decode_saves:  # written through by _decode's slot store
            cache.count_direct_saves(layer, k[:nd])
        first = nd if cache.direct_decode_saves else 0
        if k.shape[0] > first:  # prefill rows (and decode rows for the per-page baseline)
            if self._save_plan is None:  # the step's destinations: the same at every layer
                self._save_plan = self._step_save_plan(first)
            cache.save(layer, k[first:], v[first:], self._save_plan)
        summaries = self.sparse.summaries[layer]
        if nd and not self.prefills and nd == q.shape[0]:  # decode only: no copy into `out`
            return self._decode(layer, q, k, v, summaries)
        if not nd and len(self.prefills) == 1:  # one chunk or segment alone: no copy either
            return self._offload_prefill(layer, self.prefills[0], q, k, v, summaries)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(layer, q[:nd], k[:nd], v[:nd], summaries)
        for p in self.prefills:
            out[p.q_start:p.q_end] = self._offload_prefill(layer, p, q, k, v, summaries)
        return out

    def _step_save_plan(self, first: int):
        """The SavePlan of rows [first:] (from the runner's page directory: in range by
        construction, not validated). Rows that are one layer-segmented chunk's exactly take
        the plan its earlier segment steps made (PrefillSeq.plans; segment_plans.py)."""
        one = len(self.prefills) == 1 and first == self.num_decode
        shared = self.prefills[0].plans if one else None
        if shared is not None and shared.save_plan is not None:
            return shared.save_plan
        pages, offsets = self.save_dest()
        plan = self.cache.save_plan(pages[first:], offsets[first:], validate=False)
        if shared is not None:  # kept for later steps (every saver only reads a plan)
            shared.save_plan = plan
        return plan

    def _decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                summaries: LayerSummaries) -> torch.Tensor:
        from sparseserve.kernels.slot_store import store_decode_tokens
        cache = self.cache
        sel = self.sparse.algorithm.select(q, self.dec_page_table, self.dec_num_pages,
                                           self.dec_last_len, summaries, None)
        if self.on_select is not None:
            self.on_select(layer, q, sel, self)
        # a token that starts a page: the selection's last entry (its page) has no data yet
        # (the flags are the step's; the kernels find each row's last entry themselves)
        slots = cache.retrieve(layer, sel.page_table, sel.num_pages, self.dec_rows,
                               fresh_last=self._decode_plan()["starts"],
                               defer_rebuild=True)  # finish_layers rebuilds all at once
        dev_k, dev_v = cache.dev_k[layer], cache.dev_v[layer]
        # the token's page is the selection's last entry, now resident: store the token there
        # ... and stage it for its DRAM write-through, one launch for all layers after them
        # (finish_layers)
        stage = None
        if cache.direct_decode_saves:
            stage = cache.decode_stage(layer, k)
            self._staged = True
        last_slot = store_decode_tokens(slots, sel.num_pages, self.store_offsets[:q.shape[0]]
                                        .view(-1), k, v, dev_k, dev_v, stage)  # [B, Hkv]
        if self.decode_fills:
            self._index_decode_fills(layer, q, last_slot, summaries)
        slots = slots.to(torch.int32)
        out = paged_decode_attention(q, dev_k, dev_v, slots, sel.num_pages, sel.last_page_len,
                                     self.scale)
        if self.sparse.algorithm.estimates:  # summaries are in HBM: no page is loaded for it
            out = self._merge_estimate(q, out, sel, dev_k, slots, summaries)
        return out

    def _decode_plan(self) -> dict[str, torch.Tensor]:
        """What the decode rows' bookkeeping needs that depends on positions only: computed
        at the first layer, reused by the others (fewer launches per layer).
        starts [B] int32: 1 where the token starts a page; and for indexing the pages that fill:
        read [B*Hkv] int32 (entry i reads gathered page i, -1: no fill), host_ids [B*Hkv] int64
        (where the summary goes; the scratch page when no fill), ntok [B*Hkv] int32."""
        plan = getattr(self, "_plan", None)
        if plan is None:
            ps = self.kv.page_size
            nd, hkv = self.num_decode, self.pages.num_kv_heads
            n = nd * hkv
            fills = ((self.dec_seq_lens % ps) == 0)[:, None].expand(nd, hkv).reshape(-1)
            plan = self._plan = {
                "starts": ((self.dec_seq_lens - 1) % ps == 0).to(torch.int32),
                "read": torch.where(fills, torch.arange(n, device=fills.device, dtype=torch.int32),
                                    -1),
                "host_ids": torch.where(fills, self.store_pages[:nd].reshape(-1),
                                        self.cache.scratch_page).long(),
                "ntok": torch.full((n,), ps, dtype=torch.int32, device=fills.device),
            }
        return plan

    def _index_decode_fills(self, layer: int, q: torch.Tensor, last_slot: torch.Tensor,
                            summaries: LayerSummaries) -> None:
        """Pages this decode step filled: summarise from their slot, store at the host id."""
        nd, hkv = last_slot.shape
        plan = self._decode_plan()
        # gather the n candidate pages, so the scratch table has n + 1 rows, not one per slot
        pages_k = self.cache.dev_k[layer][last_slot.reshape(-1)]  # [n, page_size, D]
        pages_v = None
        if self.sparse.algorithm.uses_values:
            pages_v = self.cache.dev_v[layer][last_slot.reshape(-1)]
        queries = None
        if self.sparse.algorithm.uses_queries:
            queries = q.float().view(nd, hkv, -1, q.shape[-1]).reshape(nd * hkv, -1, q.shape[-1])
        self._index_via_scratch(pages_k, plan["read"], plan["host_ids"], plan["ntok"],
                                summaries, queries, pages_v)

    def _index_via_scratch(self, k_pages: torch.Tensor, read_ids: torch.Tensor,
                           host_ids: torch.Tensor, ntok: torch.Tensor,
                           summaries: LayerSummaries, queries: torch.Tensor | None,
                           v_pages: torch.Tensor | None = None) -> None:
        """worker/page_index.index_pages with this context's algorithm and scratch page."""
        index_pages(self.sparse.algorithm, self.cache.scratch_page, k_pages, read_ids,
                    host_ids, ntok, summaries, queries, v_pages)

    def _offload_prefill(self, layer: int, p: PrefillSeq, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, summaries: LayerSummaries) -> torch.Tensor:
        """A prefill chunk over the two tiers: every page of the request up to the chunk's end
        is mapped to a device slot (the prefix is normally still resident from the earlier
        chunks: a hit; a page evicted since is loaded back; the chunk's new pages get slots
        without a load), the chunk's K/V is stored there (and saved to DRAM by the saver),
        and attention reads the prefix device-to-device. The slots stay resident, so decode
        starts warm.

        A slot-free chunk (a whole prompt, ScheduledChunk.slot_free) maps only its newest
        `resident_pages` pages per KV head (spare slots the scheduler gave it; often none):
        attention and the summaries read the projection's K/V, the saver writes it to DRAM
        (the cache fences the saves before the first decode step loads any of it)."""
        plan = self._prefill_plan(p)
        if p.slot_free:
            if plan["first"] < plan["nb"]:
                self._map_and_store(layer, p, k, v, plan)
            ks = k[p.q_start:p.q_end].transpose(0, 1)  # [Hkv, n, D]
            vs = v[p.q_start:p.q_end].transpose(0, 1)
            self._index_prefill(p, q, ks, vs, plan, summaries)
            return self._sdpa(q[p.q_start:p.q_end].transpose(0, 1), ks, vs, 0)
        slots = self._map_and_store(layer, p, k, v, plan)
        if p.start and (q.is_cuda or self.paged_prefill_kernel):
            return self._paged_prefill(layer, p, q, slots, plan, summaries)
        if p.start:
            ps, nb, total = self.kv.page_size, plan["nb"], plan["total"]
            hkv = slots.shape[0]
            dev_k, dev_v = self.cache.dev_k[layer], self.cache.dev_v[layer]
            ks = dev_k[slots].reshape(hkv, nb * ps, -1)[:, :total]
            vs = dev_v[slots].reshape(hkv, nb * ps, -1)[:, :total]
        else:
            ks = k[p.q_start:p.q_end].transpose(0, 1)  # [Hkv, n, D]
            vs = v[p.q_start:p.q_end].transpose(0, 1)
        self._index_prefill(p, q, ks, vs, plan, summaries)
        return self._sdpa(q[p.q_start:p.q_end].transpose(0, 1), ks, vs, p.start)

    def _paged_prefill(self, layer: int, p: PrefillSeq, q: torch.Tensor, slots: torch.Tensor,
                       plan: dict, summaries: LayerSummaries) -> torch.Tensor:
        """A chunk continuing a prefix whose pages are all mapped (`slots` [Hkv, nb], int32
        as the fused retrieve gives them: no conversion launch): it
        attends in place from the device slots (kernels/paged_prefill.py, no gathered and
        repeated copy of the prefix) and the pages it completes are indexed from their slots.
        -> [n, Hq, D]."""
        from sparseserve.kernels.paged_prefill import (METADATA, block_tokens,
                                                       paged_prefill_attention, plan_metadata)
        dev_k, dev_v = self.cache.dev_k[layer], self.cache.dev_v[layer]
        b0, b1 = plan["b0"], plan["b1"]
        if b1 > b0:
            ps = self.kv.page_size
            done = slots[:, b0:b1]  # [Hkv, nf] the pages this chunk completes
            pages_v = dev_v[done].reshape(-1, ps, dev_v.shape[-1]) if \
                self.sparse.algorithm.uses_values else None
            self._index_pages(p, q, dev_k[done].reshape(-1, ps, dev_k.shape[-1]), pages_v,
                              plan, summaries)
        qc = q[p.q_start:p.q_end]
        if "paged" not in plan:  # the same at every layer of the step: one small copy
            bm = block_tokens(q.shape[1], slots.shape[0])
            meta = pack_to_device({}, plan_metadata([qc.shape[0]], [p.start], bm), q.device)
            plan["paged"] = (bm, [meta[k] for k in METADATA])
        bm, meta = plan["paged"]
        return paged_prefill_attention(qc, dev_k, dev_v, slots.to(torch.int32)[None], *meta,
                                       self.scale, bm)

    def _prefill_plan(self, p: PrefillSeq) -> dict:
        """What a prefill chunk's mapping, store and indexing need that is the same at every
        layer (its pages, the entries to map, each token's page entry and offset, the pages
        it completes): made at the first layer, reused by the others (fewer launches and
        less host time per layer).
        pages [Hkv, nb] host pages; sel [1, Hkv, nb - first] the pages mapped (first: where
        mapping starts); num / fresh_from [1, Hkv]; row [1]; tok_entry [T'] each stored
        token's entry in sel, tok_off [T'] its offset in the page, rows the slice of the
        chunk's rows stored; b0 / b1 the pages completed, host_ids [Hkv * (b1 - b0)],
        read / ntok [Hkv * (b1 - b0)] int32, fill_pos [b1 - b0] the rows that complete them."""
        plan = self._prefill_plans.get(p.q_start)
        if plan is not None:
            return plan
        shared = p.plans.prefill if p.plans is not None else None
        if shared is None:
            shared = self._chunk_prefill_plan(p)
            if p.plans is not None:  # the chunk's later segment steps take it
                p.plans.prefill = shared
        # a copy for this context: its rows in the step, and what a step adds (layer_slots)
        plan = self._prefill_plans[p.q_start] = dict(shared)
        if "t0" in plan:
            plan["rows"] = slice(p.q_start + plan["t0"] - p.start, p.q_end)
        return plan

    def _chunk_prefill_plan(self, p: PrefillSeq) -> dict:
        """_prefill_plan's part that depends on the chunk alone (not its rows in the step):
        the same at every segment step of a layer-segmented chunk."""
        ps = self.kv.page_size
        total = p.start + (p.q_end - p.q_start)
        nb = -(-total // ps)
        # all of it from the host mirror of the page directory (the saver's destinations come
        # from it too), copied to the device in one launch: no per-tensor arange / full /
        # index ops at the step's first layer
        pages = self.pages.host_pages(np.full(nb, p.row), np.arange(nb)).T  # [Hkv, nb] int64
        hkv = pages.shape[0]
        first = nb - min(p.resident_pages, nb) if p.slot_free else 0
        plan = {"nb": nb, "total": total, "first": first}
        p64: dict[str, np.ndarray] = {}  # int64 tensors
        p32: dict[str, np.ndarray] = {}  # int32 tensors
        if first < nb:
            t0 = max(p.start, first * ps)  # the chunk's first token stored
            pos = np.arange(t0, total, dtype=np.int64)
            p32["sel"] = pages[:, first:].reshape(1, hkv, nb - first)
            p32["num"] = np.full((1, hkv), nb - first)
            # entries from here are pages with no data yet (the chunk starts them)
            fresh_from = max(0, -(-p.start // ps) - first)
            p32["fresh_from"] = np.full((1, hkv), fresh_from)
            plan["loads"] = fresh_from > 0  # else every entry is fresh: nothing to load
            p64["row"] = np.full((1,), p.row)
            p64["tok_entry"] = pos // ps - first
            p64["tok_off"] = pos % ps
            plan["t0"] = t0  # the chunk's rows stored: [q_start + t0 - start, q_end)
        b0, b1 = p.start // ps, total // ps
        plan.update(b0=b0, b1=b1)
        if b1 > b0:
            nf = b1 - b0
            p64["host_ids"] = pages[:, b0:b1].reshape(-1)
            p32["read"] = np.arange(hkv * nf)
            p32["ntok"] = np.full((hkv * nf,), ps)
            p64["fill_pos"] = np.arange(b0, b1) * ps + ps - 1 - p.start
        plan.update(pack_to_device(p64, p32, self.cache.page_of.device))
        return plan

    def _map_and_store(self, layer: int, p: PrefillSeq, k: torch.Tensor, v: torch.Tensor,
                       plan: dict) -> torch.Tensor:
        """Map the request's pages [first, nb) of every KV head to device slots (pages the
        chunk starts get a slot without a load; an earlier page evicted since is loaded back),
        store the chunk's K/V of those pages there and mark them pending their save.
        Returns the slots [Hkv, nb - first] as the retrieve gave them (int32 on the fused
        path; no conversion launch: torch indexes with int32 too)."""
        cache = self.cache
        if self._layers is not None:
            raw = self._mapped_slots(layer, plan)
        else:
            raw = cache.retrieve(layer, plan["sel"], plan["num"], plan["row"],
                                 fresh_from=plan["fresh_from"], prefill=True,
                                 defer_rebuild=self._defer_prefill_rebuild,
                                 mark_pending=True,  # the slots marked pending their save
                                 loads=plan["loads"])[0]
        rows = plan["rows"]
        # token t's slot is raw[h, tok_entry[t]]: gathered in the store kernel
        store_token_rows(raw, plan["tok_off"], k[rows], v[rows], cache.dev_k[layer],
                         cache.dev_v[layer], tok_entry=plan["tok_entry"])
        return raw

    def _mapped_slots(self, layer: int, plan: dict) -> torch.Tensor:
        """This layer's slots of the chunk's pages [Hkv, nb - first] int32, mapped for every
        layer of begin_layers' interval at the first of them (five launches per step instead
        of per layer), its misses loaded now (a prefix page evicted since an earlier chunk)."""
        l0, l1 = self._layers
        assert l0 <= layer < l1, f"layer {layer} outside the context's layers [{l0}, {l1})"
        if plan.get("layer_slots", (None,))[0] != (l0, l1):  # first layer of the interval
            plan["layer_slots"] = ((l0, l1),) + tuple(self.cache.map_prefill_layers(
                l0, l1, plan["sel"], plan["num"], plan["row"], plan["fresh_from"],
                defer_rebuild=self._defer_prefill_rebuild))
        _, slots, src, dst, num = plan["layer_slots"]
        j = layer - l0
        self.cache.load_layer(layer, src[j] if plan["loads"] else None, dst[j], num[j])
        return slots[j, 0]

    def _index_prefill(self, p: PrefillSeq, q: torch.Tensor, ks: torch.Tensor,
                       vs: torch.Tensor, plan: dict, summaries: LayerSummaries) -> None:
        """Summaries of the pages this chunk completes, from the contiguous K (and V) of the
        request up to the chunk's end: ks/vs [Hkv, total, D]."""
        ps = self.kv.page_size
        b0, b1 = plan["b0"], plan["b1"]
        if b1 <= b0:
            return
        hkv, nf = ks.shape[0], b1 - b0
        pages_k = ks[:, b0 * ps:b1 * ps].reshape(hkv * nf, ps, -1).contiguous()
        pages_v = None
        if self.sparse.algorithm.uses_values:
            pages_v = vs[:, b0 * ps:b1 * ps].reshape(hkv * nf, ps, -1).contiguous()
        self._index_pages(p, q, pages_k, pages_v, plan, summaries)

    def _index_pages(self, p: PrefillSeq, q: torch.Tensor, pages_k: torch.Tensor,
                     pages_v: torch.Tensor | None, plan: dict,
                     summaries: LayerSummaries) -> None:
        """Summaries of the pages this chunk completes: pages_k (pages_v) [Hkv * nf, ps, D],
        head-major."""
        b0, b1 = plan["b0"], plan["b1"]
        nf = b1 - b0
        hkv = pages_k.shape[0] // nf
        algo = self.sparse.algorithm
        queries = None
        if algo.uses_queries:  # the query of each completing row, per KV head's group
            qf = q[p.q_start:p.q_end][plan["fill_pos"]].float()  # [nf, Hq, D]
            queries = qf.view(nf, hkv, -1, qf.shape[-1]).transpose(0, 1).reshape(
                hkv * nf, -1, qf.shape[-1])
        self._index_via_scratch(pages_k, plan["read"], plan["host_ids"], plan["ntok"],
                                summaries, queries, pages_v)

