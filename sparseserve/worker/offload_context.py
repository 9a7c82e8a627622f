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
from sparseserve.sparse import LayerSummaries
from sparseserve.worker.forward_context import ForwardContext, PrefillSeq
from sparseserve.worker.offload_cache import TwoTierCache


class OffloadForwardContext(ForwardContext):
    def __init__(self, *args, cache: TwoTierCache, save_pages: np.ndarray | None,
                 save_offsets: np.ndarray | None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cache = cache
        # [T, Hkv] host page of each new token and head, [T] offsets: for the saver (CPU
        # side); None in a captured decode step, whose saves are all direct
        self.save_pages = save_pages
        self.save_offsets = save_offsets

    def _plan_index(self, rows: torch.Tensor, positions: torch.Tensor) -> None:
        pass  # pages are indexed through the two tiers (see _index_via_scratch)

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        nd = self.num_decode
        if nd and cache.direct_decode_saves:
            cache.write_through(layer, k[:nd], v[:nd], self.store_pages[:nd],
                                self.store_offsets[:nd])
        first = nd if cache.direct_decode_saves else 0
        if k.shape[0] > first:  # prefill rows (and decode rows for the per-page baseline)
            cache.save(layer, k[first:], v[first:], self.save_pages[first:],
                       self.save_offsets[first:])
        out = torch.empty_like(q)
        summaries = self.sparse.summaries[layer]
        if nd:
            out[:nd] = self._decode(layer, q[:nd], k[:nd], v[:nd], summaries)
        for p in self.prefills:
            out[p.q_start:p.q_end] = self._offload_prefill(layer, p, q, k, v, summaries)
        return out

    def _decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                summaries: LayerSummaries) -> torch.Tensor:
        cache = self.cache
        sel = self.sparse.algorithm.select(q, self.dec_page_table, self.dec_num_pages,
                                           self.dec_last_len, summaries, None)
        if self.on_select is not None:
            self.on_select(layer, q, sel, self)
        slots = cache.retrieve(layer, sel.page_table, sel.num_pages, self.dec_rows,
                               fresh=self._decode_fresh(sel.page_table.shape[2], sel.num_pages))
        # the token's page is the selection's last entry, now resident
        last_slot = slots.gather(2, (sel.num_pages.long() - 1).unsqueeze(-1))[..., 0]  # [B, Hkv]
        dev_k, dev_v = cache.dev_k[layer], cache.dev_v[layer]
        offs = self.store_offsets[:q.shape[0]]
        dev_k[last_slot, offs] = k
        dev_v[last_slot, offs] = v
        self._index_decode_fills(layer, q, last_slot, summaries)
        return paged_decode_attention(q, dev_k, dev_v, slots.to(torch.int32), sel.num_pages,
                                      sel.last_page_len, self.scale)

    def _decode_fresh(self, width: int, num_sel: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, K] bool: the selection's last entry when this token starts a new page
        (nothing to load for it)."""
        starts = ((self.dec_seq_lens - 1) % self.kv.page_size == 0).view(-1, 1, 1)
        last = torch.arange(width, device=num_sel.device).view(1, 1, -1) == (
            num_sel.long() - 1).unsqueeze(-1)
        return last & starts

    def _index_decode_fills(self, layer: int, q: torch.Tensor, last_slot: torch.Tensor,
                            summaries: LayerSummaries) -> None:
        """Pages this decode step filled: summarise from their slot, store at the host id."""
        nd, hkv = last_slot.shape
        fills = ((self.dec_seq_lens % self.kv.page_size) == 0)[:, None].expand(nd, hkv)
        n = nd * hkv
        # gather the n candidate pages, so the scratch table has n + 1 rows, not one per slot
        pages_k = self.cache.dev_k[layer][last_slot.reshape(-1)]  # [n, page_size, D]
        read = torch.where(fills.reshape(-1), torch.arange(n, device=q.device), -1)
        host_ids = torch.where(fills, self.store_pages[:nd], self.cache.scratch_page).reshape(-1)
        queries = q.float().view(nd, hkv, -1, q.shape[-1]).reshape(n, -1, q.shape[-1])
        self._index_via_scratch(pages_k, read.to(torch.int32), host_ids, summaries, queries,
                                n + 1)

    def _index_via_scratch(self, k_pages: torch.Tensor, read_ids: torch.Tensor,
                           host_ids: torch.Tensor, summaries: LayerSummaries,
                           queries: torch.Tensor | None, rows: int) -> None:
        """index() reads and writes the same row ids; here pages are read at `read_ids` of
        k_pages and their summaries belong at `host_ids`, so go through a scratch table."""
        scratch = LayerSummaries({n: torch.zeros((rows, t.shape[1]), dtype=t.dtype,
                                                 device=t.device)
                                  for n, t in summaries.tensors.items()})
        algo = self.sparse.algorithm
        ntok = torch.full_like(read_ids, self.kv.page_size)
        algo.index(k_pages, read_ids, ntok, scratch, queries if algo.uses_queries else None)
        src = torch.where(read_ids >= 0, read_ids.long(), rows - 1)
        for name, t in summaries.tensors.items():
            t[host_ids.long()] = scratch[name][src]
        for t in summaries.tensors.values():
            t[self.cache.scratch_page].zero_()  # in place on a view: capturable

    def _offload_prefill(self, layer: int, p: PrefillSeq, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, summaries: LayerSummaries) -> torch.Tensor:
        """A prefill chunk over the two tiers: every page of the request up to the chunk's end
        is mapped to a device slot (the prefix is normally still resident from the earlier
        chunks: a hit; a page evicted since is loaded back; the chunk's new pages get slots
        without a load), the chunk's K/V is stored there (and saved to DRAM by the saver),
        and attention reads the prefix device-to-device. The slots stay resident, so decode
        starts warm."""
        cache = self.cache
        ps = self.kv.page_size
        n = p.q_end - p.q_start
        total = p.start + n
        nb = -(-total // ps)
        pages = self.pages.row_range(p.row, 0, nb)  # [Hkv, nb] host pages
        hkv = pages.shape[0]
        dev = q.device
        blocks = torch.arange(nb, device=dev)
        fresh = (blocks * ps >= p.start).view(1, 1, nb).expand(1, hkv, nb)  # no data yet
        num = torch.full((1, hkv), nb, dtype=torch.int32, device=dev)
        row = torch.full((1,), p.row, dtype=torch.long, device=dev)
        slots = cache.retrieve(layer, pages.unsqueeze(0), num, row, fresh=fresh,
                               prefill=True)[0]  # [Hkv, nb]
        cache.mark_saved(layer, slots)
        pos = torch.arange(p.start, total, device=dev)
        tok_slots = slots[:, torch.div(pos, ps, rounding_mode="floor")]  # [Hkv, n]
        dev_k, dev_v = cache.dev_k[layer], cache.dev_v[layer]
        dev_k[tok_slots, (pos % ps)[None, :]] = k[p.q_start:p.q_end].transpose(0, 1)
        dev_v[tok_slots, (pos % ps)[None, :]] = v[p.q_start:p.q_end].transpose(0, 1)
        if p.start:
            ks = dev_k[slots].reshape(hkv, nb * ps, -1)[:, :total]
            vs = dev_v[slots].reshape(hkv, nb * ps, -1)[:, :total]
        else:
            ks = k[p.q_start:p.q_end].transpose(0, 1)  # [Hkv, n, D]
            vs = v[p.q_start:p.q_end].transpose(0, 1)
        b0, b1 = p.start // ps, total // ps
        if b1 > b0:  # pages completed by this chunk, summarised from the contiguous K
            nf = b1 - b0
            pages_k = ks[:, b0 * ps:b1 * ps].reshape(hkv * nf, ps, -1).contiguous()
            host_ids = pages[:, b0:b1].reshape(-1)
            fill_pos = torch.arange(b0, b1, device=dev) * ps + ps - 1 - p.start
            qf = q[p.q_start:p.q_end][fill_pos].float()  # [nf, Hq, D]
            queries = qf.view(nf, hkv, -1, qf.shape[-1]).transpose(0, 1).reshape(
                hkv * nf, -1, qf.shape[-1])
            read = torch.arange(hkv * nf, device=dev, dtype=torch.int32)
            self._index_via_scratch(pages_k, read, host_ids, summaries, queries, hkv * nf + 1)
        return self._sdpa(q[p.q_start:p.q_end].transpose(0, 1), ks, vs, p.start)
