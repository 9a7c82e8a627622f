"""The two-tier KV cache on the worker side (DESIGN.md §5).

Host tier: every page of every request, per layer `[num_host_pages + 1, page_size, D]` in
pinned DRAM (the extra page is scratch). Page ids the scheduler allocates are host page ids.
Device tier: per layer a pool of slots `[num_slots + 1, page_size, D]` (the extra slot is
scratch) with a reverse map slot -> page, each slot's last access step and owning batch row,
and a residency index page -> slot (kernels/residency_hash.py: a hash table sized by the
slots, so device metadata grows with the cache, not with the host tier). All of it lives on
the device and is updated there with fixed shapes: `retrieve` maps a selection to slots, picks
victims for misses (category LRU or LRU) and loads the missing pages with FlashH2D (or
per-page copies), with no host sync.

New KV is written through to the host tier by the saver (FlashD2H) every step; the runner
waits for the previous step's saves before it starts a step, so no page is loaded from DRAM
before its save completed.
"""
from __future__ import annotations

import weakref

import numpy as np
import torch

from sparseserve.config import CacheConfig
from sparseserve.kernels import residency_hash
from sparseserve.kvcache.eviction import victim_order
from sparseserve.transfer import PageLoader, make_saver


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def _alloc_pinned(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """Host memory, page-locked when `pin`. torch's pinned allocator rounds each allocation up
    to a power of two (a 32 GiB tier plus one scratch page would lock 64 GiB), so allocate
    pageable memory of the exact size and register it with CUDA instead."""
    t = torch.empty(shape, dtype=dtype)
    if not pin:
        return t
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(getattr(rc, "value", rc)) == 0 and t.is_pinned():
        return t
    return t.pin_memory()  # registration unavailable: fall back to the caching allocator


class TwoTierCache:
    def __init__(self, cache: CacheConfig, num_layers: int, head_dim: int, num_rows: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_layers = num_layers
        self.page_size = ps = cache.page_size
        self.num_host_pages = cache.num_host_pages
        self.num_slots = cache.num_pages
        self.policy = cache.eviction
        self.d2h_method = cache.d2h_method
        hp = cache.num_host_pages + 1
        # one tensor for all layers, K and V: [2, L, pages + 1, page_size, D], pinned exactly
        self._host = _alloc_pinned((2, num_layers, hp, ps, head_dim), dtype,
                                   device.type == "cuda")
        self.host_k = list(self._host[0])
        self.host_v = list(self._host[1])
        if self._host.is_pinned() and device.type == "cuda":
            # unregister before the memory goes back to the OS (no-op for pin_memory tensors)
            weakref.finalize(self, _unregister, self._host.data_ptr())
        s1 = self.num_slots + 1
        self.scratch_slot = self.num_slots
        self.scratch_page = self.num_host_pages
        self.scratch_row = num_rows
        # reverse map [L, num_slots + 1]: page or -1; residency index [L, H] (page -> slot)
        self.page_of = torch.full((num_layers, s1), -1, dtype=torch.long, device=device)
        self.res_table = torch.full((num_layers, residency_hash.table_size(s1)), -1,
                                    dtype=torch.int32, device=device)
        self.last_access = torch.full((num_layers, s1), -1, dtype=torch.long, device=device)
        self.owner = torch.full((num_layers, s1), num_rows, dtype=torch.long, device=device)
        # elastic buffer: per-row quota of resident slots per layer (scheduler-settable)
        self.row_quota = torch.full((num_rows + 1,), self.num_slots, dtype=torch.long,
                                    device=device)
        self.step = torch.zeros((), dtype=torch.long, device=device)
        self.hit_miss = torch.zeros(2, dtype=torch.long, device=device)  # [hits, misses]
        self.loader = PageLoader(cache.h2d_method)
        self.saver = make_saver(cache.d2h_method, self.host_k, self.host_v)
        self._last_ticket = 0
        # bytes of decode write-through (GPU-direct); the saver counts the rest
        self.direct_bytes_saved = torch.zeros((), dtype=torch.long, device=device)

    # ---- per step -------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Fence: the previous step's saves have landed in DRAM before anything is loaded."""
        if self._last_ticket:
            self.saver.wait_all()
            self._last_ticket = 0
        self.step += 1

    def free_pages(self, pages: np.ndarray) -> None:
        """Pages returned to the host pool: drop their residency (their ids will be reused)."""
        if pages.size == 0:
            return
        idx = torch.as_tensor(pages, dtype=torch.long).to(self.page_of.device)
        for layer in range(self.num_layers):
            slots = self.slot_of(layer, idx)
            slots = torch.where(slots >= 0, slots, self.scratch_slot)
            self.page_of[layer, slots] = -1
            self.last_access[layer, slots] = -1
            self.owner[layer, slots] = self.scratch_row
            residency_hash.rebuild(self.res_table[layer], self.page_of[layer])

    def slot_of(self, layer: int, pages: torch.Tensor) -> torch.Tensor:
        """Slot holding each host page [N] (-1: not resident); the scratch page always maps
        to the scratch slot, so padding lanes and masked entries never take a real slot."""
        slots = residency_hash.lookup(self.res_table[layer], self.page_of[layer], pages)
        return torch.where(pages == self.scratch_page, self.scratch_slot, slots)

    def set_row_quota(self, row: int, quota_slots: int) -> None:
        """Elastic buffer: slots (per layer) `row` may keep resident before its pages are
        evicted ahead of other requests' (its mandatory selection is never evicted)."""
        self.row_quota[row] = quota_slots

    def share_evenly(self, num_active: int, mandatory: int) -> None:
        """Default quota: an even share of the pool per running request, never below what
        one decode step of a request selects (its mandatory pages)."""
        self.row_quota.fill_(max(mandatory, self.num_slots // max(1, num_active)))

    def save(self, layer: int, k: torch.Tensor, v: torch.Tensor, host_pages: np.ndarray,
             offsets: np.ndarray) -> None:
        """Write new K/V [T, Hkv, D] through to DRAM with the configured saver (async)."""
        self._last_ticket = self.saver.save(layer, k, v, host_pages, offsets)

    @property
    def direct_decode_saves(self) -> bool:
        """Decode tokens are written to DRAM by a GPU-direct write on the compute stream (one
        row per request and head: too small for staging + threads to pay off, and it keeps
        the decode step capturable); only the per-page-copy baseline goes through its saver."""
        return self.d2h_method != "memcpy"

    def write_through(self, layer: int, k: torch.Tensor, v: torch.Tensor, pages: torch.Tensor,
                      offsets: torch.Tensor) -> None:
        """host[pages[t, h], offsets[t]] = k/v[t, h] on the device's stream. k/v [T, Hkv, D];
        pages [T, Hkv] host ids; offsets [T, 1]."""
        hk, hv = self.host_k[layer], self.host_v[layer]
        # a device counter, so replays of a captured step count too
        self.direct_bytes_saved += 2 * k.numel() * k.element_size()
        if k.is_cuda:
            from sparseserve.transfer.gpu_direct import gpu_direct_save
            gpu_direct_save(hk, hv, k, v, pages, offsets.expand(pages.shape))
        else:
            hk[pages, offsets] = k
            hv[pages, offsets] = v

    # ---- retrieve -------------------------------------------------------------------------
    def retrieve(self, layer: int, pages: torch.Tensor, num_sel: torch.Tensor,
                 rows: torch.Tensor) -> torch.Tensor:
        """Map selected host pages to device slots, loading the misses.

        pages [B, Hkv, K] host page ids; num_sel [B, Hkv] int (valid entries of each row of
        the selection); rows [B] batch rows. Returns slots [B, Hkv, K] (scratch slot where
        not valid). On a GPU the bookkeeping is fused (kernels/retrieve.py); the torch
        version below is the CPU path and the reference."""
        if pages.is_cuda:
            return self._retrieve_fused(layer, pages, num_sel, rows)
        K = pages.shape[2]
        valid = torch.arange(K, device=pages.device).view(1, 1, K) < num_sel.unsqueeze(-1)
        return self._retrieve_torch(layer, pages, valid, rows)

    def _retrieve_fused(self, layer: int, pages: torch.Tensor, num_sel: torch.Tensor,
                        rows: torch.Tensor) -> torch.Tensor:
        """retrieve with the fused kernels (GPU; CPU tensors run them in the interpreter)."""
        from sparseserve.kernels.retrieve import fused_retrieve
        from sparseserve.kvcache.eviction import NUM_BUCKETS
        slots, load_src = fused_retrieve(
            pages, num_sel, rows, self.res_table[layer], self.page_of[layer],
            self.last_access[layer], self.owner[layer], self.row_quota, self.step,
            self.hit_miss, self.scratch_page, self.scratch_slot, self.policy, NUM_BUCKETS)
        # Triton also on CPU tensors (the interpreter, in tests)
        residency_hash.rebuild(self.res_table[layer], self.page_of[layer], backend="triton")
        self.loader.load(self.host_k[layer], self.host_v[layer], self.dev_k[layer],
                         self.dev_v[layer], load_src, slots.view(-1))
        return slots

    def _retrieve_torch(self, layer: int, pages: torch.Tensor, valid: torch.Tensor,
                        rows: torch.Tensor) -> torch.Tensor:
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
        self.hit_miss.add_(torch.stack([(hit & (pages != self.scratch_page)).sum(),
                                        miss.sum()]))
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
        residency_hash.rebuild(self.res_table[layer], page_of)
        self.loader.load(self.host_k[layer], self.host_v[layer], self.dev_k[layer],
                         self.dev_v[layer], torch.where(miss, pages, -1), victim)
        return torch.where(hit, slots, victim).reshape(shape)

    def attach_device_tier(self, dev_k: list[torch.Tensor], dev_v: list[torch.Tensor]) -> None:
        self.dev_k, self.dev_v = dev_k, dev_v

    # ---- prefill history ------------------------------------------------------------------
    def gather_host(self, layer: int, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of host pages [n] -> device tensors [n, page_size, D] (prefill history)."""
        n = pages.shape[0]
        dev = self.page_of.device
        k = torch.empty((n,) + self.host_k[layer].shape[1:], dtype=self.host_k[layer].dtype,
                        device=dev)
        v = torch.empty_like(k)
        self.loader.load(self.host_k[layer], self.host_v[layer], k, v, pages.long(),
                         torch.arange(n, device=dev))
        return k, v

    # ---- introspection --------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Counters (reads device values: call when collecting metrics, not per layer)."""
        saved = self.saver.stats()
        loaded = self.loader.stats()
        hits, misses = self.hit_miss.tolist()
        return {"cache_hits_total": hits, "cache_misses_total": misses,
                "bytes_loaded_total": loaded.bytes,
                "bytes_saved_total": saved.bytes + int(self.direct_bytes_saved),
                "pages_loaded_total": loaded.pages,
                "resident_slots": int((self.page_of[:, :-1] >= 0).sum())}

    def check_invariants(self) -> None:
        """The residency index and the reverse map agree (tests; reads the device): every
        mapped slot is found from its page, no page is mapped twice, the scratch slot holds
        nothing, and the index has exactly one entry per mapped slot."""
        for layer in range(self.num_layers):
            page_of = self.page_of[layer]
            assert int(page_of[self.scratch_slot]) == -1, "scratch slot mapped"
            mapped = torch.nonzero(page_of >= 0).flatten()
            pages = page_of[mapped]
            assert pages.unique().numel() == pages.numel(), "page mapped to two slots"
            found = self.slot_of(layer, pages)
            assert torch.equal(found, mapped), "residency index disagrees with page_of"
            assert int((self.res_table[layer] >= 0).sum()) == mapped.numel()

    def close(self) -> None:
        self.saver.wait_all()
        self.saver.close()
