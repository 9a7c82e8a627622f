"""TwoTierCache's retrieve (a mixin of worker/offload_cache.py): map a selection of host pages
to device slots, pick victims for the misses and load them — the fused kernels on a GPU
(kernels/retrieve.py), torch ops on the CPU (also the reference)."""
from __future__ import annotations

import functools

import torch

from sparseserve.kernels import residency_hash
from sparseserve.kvcache.eviction import NUM_BUCKETS, victim_order


class CacheRetrieve:
    def retrieve(self, layer: int, pages: torch.Tensor, num_sel: torch.Tensor,
                 rows: torch.Tensor, fresh_from: torch.Tensor | None = None,
                 prefill: bool = False, fresh_last: torch.Tensor | None = None,
                 defer_rebuild: bool = False, mark_pending: bool = False,
                 loads: bool = True) -> torch.Tensor:
        """Map selected host pages to device slots, loading the misses.

        pages [B, Hkv, K] host page ids; num_sel [B, Hkv] int (valid entries of each row of
        the selection); rows [B] batch rows. Returns slots [B, Hkv, K] int (int32 on the
        fused path; the scratch slot where not valid). `fresh_from` [B, Hkv] int: entries
        k >= fresh_from[b, h] are pages that hold no data yet (a page this step starts) — a
        miss gets a slot but nothing is loaded for it, and it is not counted as a miss.
        `fresh_last` [B] int32 (instead): where nonzero, the last valid entry of row b's
        selections (k = num_sel[b, h] - 1) is such a page (decode: the token starts it).
        `prefill`: count hits and misses apart from decode's (a prefill mapping its own pages)
        and stamp no working set. `defer_rebuild`: leave the residency index's rebuild-if-full
        to finish_decode, which the caller runs after the step's layers (one call per layer
        and step in between: see fused_retrieve). `mark_pending`: the mapped slots are
        then marked pending their save (mark_saved; on the fused path written by the retrieve's
        own kernels instead of the step, no launch of its own). `loads=False`: the caller
        knows nothing can be loaded (every entry is fresh: fresh_from all 0), so the fused
        path launches no loader (it would find no live load). On a GPU the bookkeeping (stamps included) is fused
        (kernels/retrieve.py); the torch version below is the CPU path and the reference."""
        counter = self.prefill_hit_miss if prefill else self.hit_miss
        if self.fused:  # the fused kernels take num_sel and stamp themselves
            stamps = None if prefill else (self.stamps.last_selected[layer], self.stamps.step)
            touch = self._pending_touch() if mark_pending else None
            return self._retrieve_fused(layer, pages, num_sel, rows, fresh_from, counter,
                                        fresh_last=fresh_last, stamps=stamps,
                                        defer_rebuild=defer_rebuild, touch=touch,
                                        loads=loads)
        K = pages.shape[2]
        k = torch.arange(K, device=pages.device).view(1, 1, K)
        valid = k < num_sel.unsqueeze(-1)  # [B, Hkv, K]
        if not prefill:
            self.stamps.stamp(layer, pages, valid)
        fresh = None
        if fresh_from is not None:
            fresh = k >= fresh_from.unsqueeze(-1)
        elif fresh_last is not None:
            fresh = (k >= (num_sel.long() - 1).unsqueeze(-1)) & (fresh_last != 0).view(-1, 1, 1)
        slots = self._retrieve_torch(layer, pages, valid, rows, fresh, counter)
        if mark_pending:
            self.mark_saved(layer, slots.long())
        return slots

    def maps_layers_at_once(self) -> bool:
        """Whether map_prefill_layers can run (the fused kernels with their fused category
        LRU); else a prefill maps its pages one layer at a time through retrieve."""
        return self.fused and self.policy == "category-lru"

    def map_prefill_layers(self, l0: int, l1: int, pages: torch.Tensor, num_sel: torch.Tensor,
                           rows: torch.Tensor, fresh_from: torch.Tensor,
                           defer_rebuild: bool) -> tuple[torch.Tensor, ...]:
        """A prefill chunk's pages mapped to slots in every layer of [l0, l1) at once: what
        `retrieve(layer, pages, num_sel, rows, fresh_from=..., prefill=True, mark_pending=True)`
        does per layer, in one set of fused launches for all of them (the pages are the same in
        every layer; each layer's slots, victims and index are its own). Only where
        maps_layers_at_once(). Nothing is loaded here: load_layer(layer, ...) loads one layer's
        misses before that layer reads its slots. The caller runs no decode retrieve of these
        layers in between (a decode step's rows are mapped before, by their own graph or
        context), so the victims are those the per-layer calls would choose.
        -> slots [L', B, Hkv, K] int32, load_src / load_dst [L', N] int64, num_loads [L', 1]."""
        from sparseserve.kernels.retrieve import fused_retrieve
        return fused_retrieve(
            pages, num_sel, rows, self.res_table[l0:l1], self.page_of[l0:l1],
            self.last_access[l0:l1], self.owner[l0:l1], self.row_quota, self.step,
            self.prefill_hit_miss, self.res_fill[l0:l1], self.scratch_page, self.scratch_slot,
            NUM_BUCKETS, fresh_from, lru_scratch=self._lru_scratch[l0:l1],
            rebuild=not defer_rebuild, touch=self._pending_touch())

    def _pending_touch(self) -> torch.Tensor:
        """The pending-save mark of this host step ([] int64 on the device), which the fused
        retrieve writes into the slots it maps (no mark launch); the step is remembered so
        begin_step ages its marks."""
        self._marked_steps.add(self._host_step)
        return self._pending_marks[self._host_step % 2]

    def load_layer(self, layer: int, load_src: torch.Tensor | None, load_dst: torch.Tensor,
                   num_loads: torch.Tensor) -> None:
        """Load one layer's misses of map_prefill_layers (its row of load_src / load_dst /
        num_loads); load_src None: nothing can miss (every page fresh), no loader launch."""
        if load_src is None:  # its device counter made as a load would (a decode step may be
            self.loader.counter(self.dev_k[layer].device)  # captured next)
            return
        self.loader.load(self.host_k[layer], self.host_v[layer], self.dev_k[layer],
                         self.dev_v[layer], load_src, load_dst, num_live=num_loads)

    def _retrieve_fused(self, layer: int, pages: torch.Tensor, num_sel: torch.Tensor,
                        rows: torch.Tensor, fresh_from: torch.Tensor | None,
                        counter: torch.Tensor, fresh_last: torch.Tensor | None = None,
                        stamps: tuple[torch.Tensor, torch.Tensor] | None = None,
                        defer_rebuild: bool = False,
                        touch: torch.Tensor | None = None,
                        loads: bool = True) -> torch.Tensor:
        """retrieve with the fused kernels (GPU; CPU tensors run them in the interpreter).
        stamps: (last_selected row of the layer, stamp step) for a decode selection; touch:
        fused_retrieve's."""
        from sparseserve.kernels.retrieve import fused_retrieve
        # category LRU is fused into the kernels; other policies give their own order
        order = None if self.policy == "category-lru" else functools.partial(
            victim_order, policy=self.policy)
        slots, load_src, load_dst, num_loads = fused_retrieve(
            pages, num_sel, rows, self.res_table[layer], self.page_of[layer],
            self.last_access[layer], self.owner[layer], self.row_quota, self.step,
            counter, self.res_fill[layer], self.scratch_page, self.scratch_slot,
            NUM_BUCKETS, fresh_from, victim_order=order, fresh_last=fresh_last,
            stamps=stamps, lru_scratch=self._lru_scratch[layer],
            rebuild=not defer_rebuild, touch=touch)
        self.load_layer(layer, load_src if loads else None, load_dst, num_loads)
        return slots

    def _retrieve_torch(self, layer: int, pages: torch.Tensor, valid: torch.Tensor,
                        rows: torch.Tensor, fresh: torch.Tensor | None,
                        counter: torch.Tensor) -> torch.Tensor:
        """retrieve with torch ops; valid [B, Hkv, K] bool."""
        shape = pages.shape
        pages = torch.where(valid, pages.long(), self.scratch_page).reshape(-1)
        valid = valid.reshape(-1)
        owner = rows.long()[:, None, None].expand(shape).reshape(-1)
        page_of = self.page_of[layer]
        last, own = self.last_access[layer], self.owner[layer]
        slots = self.slot_of(layer, pages)
        hit = valid & (slots >= 0)
        miss = valid & (slots < 0)
        # a page that starts now is no miss: nothing to load
        load = miss if fresh is None else miss & ~fresh.reshape(-1)
        counter.add_(torch.stack([(hit & (pages != self.scratch_page)).sum(), load.sum()]))
        # touch hits first so they cannot become victims
        last.index_put_((torch.where(hit, slots, self.scratch_slot),), self.step.expand(
            slots.shape))
        order = victim_order(last[:-1], own[:-1], self.row_quota, self.step, self.policy)
        rank = (torch.cumsum(miss.long(), 0) - 1).clamp(min=0)
        n = order.shape[0]
        victim = torch.where(miss, order[rank.clamp(max=n - 1)], self.scratch_slot)
        # the victims now hold the missing pages (what they held is unmapped with it)
        page_of.index_put_((victim,), torch.where(miss, pages, -1))
        last.index_put_((victim,), torch.where(miss, self.step, -1))
        own.index_put_((victim,), torch.where(miss, owner, self.scratch_row))
        # fill_ on a view, not `x[i] = v` (that copies a CPU scalar tensor: not capturable)
        page_of[self.scratch_slot].fill_(-1)
        residency_hash.rebuild(self.res_table[layer], page_of, self.res_fill[layer])
        self.loader.load(self.host_k[layer], self.host_v[layer], self.dev_k[layer],
                         self.dev_v[layer], torch.where(load, pages, -1), victim)
        return torch.where(hit, slots, victim).reshape(shape)
