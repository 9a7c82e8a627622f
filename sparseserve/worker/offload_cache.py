"""The two-tier KV cache on the worker side (DESIGN.md §5).

Host tier: every page of every request, per layer `[num_host_pages + 1, page_size, D]` in
pinned DRAM (the extra page is scratch). Page ids the scheduler allocates are host page ids.
Device tier: per layer a pool of slots `[num_slots + 1, page_size, D]` (the extra slot is
scratch) with a reverse map slot -> page, each slot's last access step and owning batch row,
and a residency index page -> slot (kernels/residency_hash.py: a hash table sized by the
slots, so device metadata grows with the cache, not with the host tier). All of it lives on
the device and is updated there with fixed shapes: `retrieve` (offload_retrieve.py) maps a
selection to slots, picks victims for misses (category LRU or LRU) and loads the missing pages
with FlashH2D (or per-page copies), with no host sync.

New KV is written through to the host tier every step: decode tokens by a GPU-direct write on
the compute stream, prefill chunks by the saver (FlashD2H: a D2H copy, then CPU threads
scatter it). A page must not be loaded from DRAM before its save landed. A prefill's pages are
resident in slots when they are saved, so the hazard is only eviction + reload before the
scatter finished; the cache closes it without stalling the next step: slots whose pages were
saved in step s carry a pending-save mark (never a victim) until the fence at the start of
step s + 2 has waited for step s's saves, and only then become ordinary (aged) slots. The
CPU scatter of one step thus overlaps the whole next step.
"""
from __future__ import annotations

import time
import weakref

import numpy as np
import torch

from sparseserve.config import CacheConfig
from sparseserve.kernels import residency_hash
from sparseserve.kernels.category_lru import lru_scratch_size
from sparseserve.kvcache.eviction import NUM_BUCKETS
from sparseserve.transfer import PageLoader, SavePlan, make_save_plan, make_saver
from sparseserve.worker.decode_write_through import DecodeWriteThrough
from sparseserve.worker.host_copy import to_device
from sparseserve.worker.lagged_counters import LaggedCounters
from sparseserve.worker.offload_introspection import CacheIntrospection
from sparseserve.worker.offload_retrieve import CacheRetrieve
from sparseserve.worker.pinned_host import alloc_pinned, staging_ring_bytes, unregister_pinned
from sparseserve.worker.selection_stamps import SelectionStamps

# last_access of a slot whose page has a save in flight (+ the step's parity): in the future,
# so its age is 0 and it is never a victim; outside every working-set window
PENDING_SAVE = 1 << 60


class TwoTierCache(CacheRetrieve, CacheIntrospection):
    def __init__(self, cache: CacheConfig, num_layers: int, head_dim: int, num_rows: int,
                 dtype: torch.dtype, device: torch.device, working_set_window: int = 12,
                 step_save_bytes: int = 0, num_kv_heads: int | None = None) -> None:
        """num_kv_heads: sizes the decode rows' DRAM write-through stage (decode_stage); None
        (unit tests of the cache alone): allocated at its first use.
        step_save_bytes: the most prefill K + V one step can save (its prompt tokens x
        layers x KV heads x head_dim x 2 x element size); sizes FlashD2H's staging ring."""
        self.window = working_set_window
        self.num_layers = num_layers
        self.page_size = ps = cache.page_size
        self.num_host_pages = cache.num_host_pages
        self.num_slots = cache.num_pages
        self.policy = cache.eviction
        self.d2h_method = cache.d2h_method
        hp = cache.num_host_pages + 1
        # one tensor for all layers, K and V: [2, L, pages + 1, page_size, D], pinned exactly
        self._host = alloc_pinned((2, num_layers, hp, ps, head_dim), dtype,
                                   device.type == "cuda")
        self.host_k = list(self._host[0])
        self.host_v = list(self._host[1])
        if self._host.is_pinned() and device.type == "cuda":
            # unregister before the memory goes back to the OS (no-op for pin_memory tensors)
            weakref.finalize(self, unregister_pinned, self._host.data_ptr())
        s1 = self.num_slots + 1
        self.scratch_slot = self.num_slots
        self.scratch_page = self.num_host_pages
        self.scratch_row = num_rows
        # reverse map [L, num_slots + 1]: page or -1; residency index [L, H] (page -> slot)
        self.page_of = torch.full((num_layers, s1), -1, dtype=torch.long, device=device)
        self.res_table = torch.full((num_layers, residency_hash.table_size(s1)), -1,
                                    dtype=torch.int32, device=device)
        # entries (live + stale) of each layer's index, and a rebuild's count: [L, 2]
        self.res_fill = torch.zeros((num_layers, 2), dtype=torch.long, device=device)
        self.last_access = torch.full((num_layers, s1), -1, dtype=torch.long, device=device)
        self.owner = torch.full((num_layers, s1), num_rows, dtype=torch.long, device=device)
        # [L, 1] first flat index of each layer's row in those [L, num_slots + 1] maps
        self._layer_base = torch.arange(num_layers, dtype=torch.long, device=device)[:, None] * s1
        # elastic buffer: per-row quota of resident slots per layer (scheduler-settable)
        self.row_quota = torch.full((num_rows + 1,), self.num_slots, dtype=torch.long,
                                    device=device)
        # category LRU's histograms per layer, zeroed; the fused retrieve leaves them zeroed
        # (no fill launch per layer)
        self._lru_scratch = torch.zeros((num_layers, lru_scratch_size(num_rows + 1,
                                                                      NUM_BUCKETS)),
                                        dtype=torch.int32, device=device)
        self.step = torch.zeros((), dtype=torch.long, device=device)
        self.hit_miss = torch.zeros(2, dtype=torch.long, device=device)  # [hits, misses]
        # prefill's own retrieves (its pages into slots): counted apart from decode's hit rate
        self.prefill_hit_miss = torch.zeros(2, dtype=torch.long, device=device)
        self.num_rows = num_rows
        # working sets by selection (worker/selection_stamps.py)
        self.stamps = SelectionStamps(num_layers, cache.num_host_pages, cache.chunk_pages,
                                      num_rows, device)
        # working set per row (pages per layer, max over layers), read one step late; two
        # buffers used in turn: with async scheduling a step's copy is read after the next
        # step's has started
        self._ws_host = [torch.zeros(num_rows + 1, dtype=torch.long,
                                     pin_memory=device.type == "cuda") for _ in range(2)]
        self._ws_turn = 0
        self.loader = PageLoader(cache.h2d_method)
        # retrieve through the fused Triton kernels (GPU); tests set it on CPU tensors too,
        # which runs them in Triton's interpreter
        self.fused = device.type == "cuda"
        kw = {}
        if cache.d2h_method == "flash" and device.type == "cuda":
            # two steps of prefill saves in flight (the fence lags one step), 8 scatter
            # threads. A ring smaller than that stalls the step on the scatter: an MHA model
            # (LWM-7B: 32 KV heads) saves ~1.07 GB in one 65,536 token-layer step, more than
            # the 1 GiB ring that suits Llama-3-8B's 8 KV heads (268 MB)
            kw = dict(staging_bytes=staging_ring_bytes(step_save_bytes), num_threads=8)
        self.saver = make_saver(cache.d2h_method, self.host_k, self.host_v, **kw)
        # decode rows' new K / V per layer, written through to DRAM once per step
        # (worker/decode_write_through.py); its stage is not allocated for the per-page baseline
        self.write_through = DecodeWriteThrough(self._host, num_rows)
        if self.direct_decode_saves and num_kv_heads is not None:
            self.write_through.allocate(num_kv_heads, head_dim, dtype, device)
        # stats(fresh=False): device counters copied asynchronously, read a step late, and
        # such a copy started at most every 50 ms (the server reads after every step; a
        # metrics scrape needs nothing fresher)
        self.counters = LaggedCounters(min_interval_s=0.05)
        self._host_step = 0
        # host steps whose prefill marked slots pending (begin_step ages them two steps on;
        # decode-only steps mark none, and their begin_step skips the pass over every slot)
        self._marked_steps: set[int] = set()
        # the pending-save marks of either parity, on the device (retrieve's mark_pending
        # writes them from its kernels: no mark launch per layer)
        self._pending_marks = torch.tensor([PENDING_SAVE, PENDING_SAVE + 1], dtype=torch.long,
                                           device=device)
        self._step_tickets: dict[int, int] = {}  # step -> its last save ticket
        # bytes of decode write-through (GPU-direct); the saver counts the rest
        self.direct_bytes_saved = torch.zeros((), dtype=torch.long, device=device)
        # seconds the host spent blocked on saves (the step fence, free_pages): a host wait
        # on the hot path, reported so it is seen
        self.save_wait_s = 0.0
        self._device_fence = False  # begin_step: make the stream wait for the saves so far
        # saves complete in stream order (GPU-direct, per-page copies): fenced on the device
        self.saves_ordered = cache.saves_ordered_on_device

    # ---- per step -------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Fence, one step behind: the saves of step s - 2 land before step s runs; the slots
        they marked pending become ordinary slots aged out of the working-set window (step
        s - 1's stay pending, so nothing saved then can be evicted and reloaded)."""
        self.step += 1
        self.stamps.advance()
        self._host_step += 1
        if self._device_fence:
            self.saver.device_fence()
            self._device_fence = False
        s = self._host_step
        ticket = self._step_tickets.pop(s - 2, None)
        if ticket:
            t0 = time.perf_counter()
            self.saver.wait(ticket)
            self.save_wait_s += time.perf_counter() - t0
        if s - 2 in self._marked_steps:  # else nothing is pending with this parity: no pass
            self._marked_steps.discard(s - 2)
            last = self.last_access
            aged = (self.step - self.window).clamp(min=0)
            last.copy_(torch.where(last == PENDING_SAVE + s % 2, aged, last))

    def fence_saves_next_step(self) -> None:
        """Order every save issued up to the end of this step before the next step's device
        work (a stream wait, the host does not block): slot-free prefills' pages are loaded
        from DRAM by their first decode step. Only savers that complete in stream order."""
        if not self.saves_ordered:
            raise RuntimeError(f"{type(self.saver).__name__} completes on the host: slot-free "
                               "prefill needs saves ordered on the device (d2h gpu-direct)")
        self._device_fence = True

    def wait_saves(self) -> None:
        """Every save issued so far has landed in DRAM."""
        t0 = time.perf_counter()
        self.saver.wait_all()
        self.save_wait_s += time.perf_counter() - t0
        self._step_tickets.clear()

    def free_pages(self, pages: np.ndarray) -> None:
        """Pages returned to the host pool: drop their residency (their ids will be reused)."""
        if pages.size == 0:
            return
        # a save still in flight must not land in a page after its next owner's data: saves
        # ordered on the device (GPU-direct, per-page copies) are fenced on the stream — the
        # next owner's writes are queued after it, the host does not wait; FlashD2H's CPU
        # scatter completes only on the host, so there the host waits
        if self.saves_ordered:
            self.saver.device_fence()
        else:
            self.wait_saves()
        idx = to_device(pages, torch.long, self.page_of.device)
        self.stamps.forget(idx)
        # every layer at once (a handful of launches, not ~9 per layer: 10 ms of host time
        # per finished request on a 32-layer model, H200 trace): slots [L, N] -> flat indices
        # into the [L, num_slots + 1] maps; pages not resident in a layer hit its scratch slot
        slots = residency_hash.lookup_layers(self.res_table, self.page_of, idx)
        slots = torch.where(slots >= 0, slots, self.scratch_slot)
        flat = (slots + self._layer_base).view(-1)
        # index_fill_ takes the value as a kernel argument; `t[slots] = -1` would copy a CPU
        # scalar to the device synchronously
        self.page_of.view(-1).index_fill_(0, flat, -1)
        self.last_access.view(-1).index_fill_(0, flat, -1)
        self.owner.view(-1).index_fill_(0, flat, self.scratch_row)
        residency_hash.rebuild(self.res_table, self.page_of, self.res_fill)

    def slot_of(self, layer: int, pages: torch.Tensor) -> torch.Tensor:
        """Slot holding each host page [N] (-1: not resident); the scratch page always maps
        to the scratch slot, so padding lanes and masked entries never take a real slot."""
        slots = residency_hash.lookup(self.res_table[layer], self.page_of[layer], pages)
        return torch.where(pages == self.scratch_page, self.scratch_slot, slots)

    def set_row_quota(self, row: int, quota_slots: int) -> None:
        """Elastic buffer: slots (per layer) `row` may keep resident before its pages are
        evicted ahead of other requests' (its mandatory selection is never evicted)."""
        self.row_quota[row] = quota_slots

    def set_quotas(self, quotas: torch.Tensor) -> None:
        """Elastic buffers for every row at once: quotas [num_rows + 1] int64 on the host
        (the scheduler's sizing; 0 for rows that wait this step, so their slots go first)."""
        dev = self.row_quota.device
        src = quotas.pin_memory() if dev.type == "cuda" else quotas
        self.row_quota.copy_(src, non_blocking=True)

    def count_working_sets(self) -> torch.Tensor:
        """Start counting each row's working set: the pages it selected in the last `window`
        decode steps (resident or not), max over layers -> a pinned host buffer [num_rows + 1]
        int64 (returned), copied without a sync: valid once the step's token copy has
        synchronised (`working_sets`), until the call after next overwrites it."""
        self._ws_turn ^= 1
        buf = self._ws_host[self._ws_turn]
        buf.copy_(self.stamps.counts(self.window).amax(0), non_blocking=True)
        return buf

    def working_sets(self) -> np.ndarray:
        """[num_rows + 1] int64 per-row working sets of the last `count_working_sets` call."""
        return self._ws_host[self._ws_turn].numpy().copy()

    def mark_saved(self, layer: int, slots: torch.Tensor) -> None:
        """Slots a prefill wrote this step (their pages are being saved): pending until the
        save landed (never a victim), then aged out of the working-set window — they stay
        resident (decode starts warm, the next chunk finds its prefix) but count in no
        working set and go before any page a decode step used within the window."""
        last = self.last_access[layer]
        last.index_fill_(0, slots.reshape(-1), PENDING_SAVE + self._host_step % 2)
        self._marked_steps.add(self._host_step)
        last[self.scratch_slot].fill_(-1)

    def save_plan(self, host_pages: np.ndarray, offsets: np.ndarray,
                  validate: bool = True) -> SavePlan:
        """The step's save destinations, validated once: host_pages [T, Hkv], offsets [T] or
        [T, Hkv]; pass the plan to every layer's `save`. ``validate`` False: ids from the
        page directory (below the scratch page by construction) and offsets ``pos %
        page_size``, the runner's, skip the range checks (~1 ms at 32k tokens)."""
        return make_save_plan(host_pages, offsets, self.num_host_pages + 1, self.page_size,
                              validate=validate, shape=np.shape(host_pages))

    def save(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan: SavePlan) -> None:
        """Write new K/V [T, Hkv, D] through to DRAM with the configured saver (async)."""
        self._step_tickets[self._host_step] = self.saver.save(layer, k, v, plan)

    def issue_saves(self, device, stats) -> None:
        """This step's ticket for saves written outside `save` by the compute stream's work so
        far on `device` (the captured prefill layers, worker/two_tier_graphs.py; GPU-direct
        saver only): it covers them and every earlier save (EventTicketSaver.issue)."""
        self._step_tickets[self._host_step] = self.saver.issue(device, stats)

    @property
    def direct_decode_saves(self) -> bool:
        """Decode tokens are written to DRAM by a GPU-direct write on the compute stream (one
        row per request and head: too small for staging + threads to pay off, and it keeps
        the decode step capturable); only the per-page-copy baseline goes through its saver."""
        return self.d2h_method != "memcpy"

    def count_direct_saves(self, layer: int, k: torch.Tensor) -> None:
        """Count a GPU-direct write-through of k [T, Hkv, D] (and as much V) at every layer:
        a device counter, so replays of a captured step count too; once per step (every
        layer writes the same rows). The decode step's rows are staged by its slot store
        (kernels/slot_store.py) and written by finish_decode."""
        if layer == 0:
            self.direct_bytes_saved += 2 * k.numel() * k.element_size() * self.num_layers

    def decode_stage(self, layer: int, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where a decode step's slot store copies the new K / V of `layer` (k [n, Hkv, D]):
        DecodeWriteThrough.stage; finish_decode writes them to DRAM."""
        return self.write_through.stage(layer, k)

    def finish_decode(self, l0: int, l1: int, pages: torch.Tensor | None,
                      offsets: torch.Tensor | None) -> None:
        """After a decode step's layers [l0, l1): their residency indexes' rebuild-if-full in
        one set of launches (the fused retrieve left it out), and their staged decode rows
        written through to DRAM (DecodeWriteThrough.flush; pages None: nothing staged)."""
        self.rebuild_indexes(l0, l1)
        if pages is not None:
            self.write_through.flush(l0, l1, pages, offsets)

    def rebuild_indexes(self, l0: int, l1: int) -> None:
        """The residency indexes' rebuild-if-full of layers [l0, l1) in one set of launches,
        for retrieves that deferred it (`defer_rebuild`: at most one per layer since the last)."""
        if self.fused:
            residency_hash.rebuild_if_full(self.res_table[l0:l1], self.page_of[l0:l1],
                                           self.res_fill[l0:l1], backend="triton")

    def attach_device_tier(self, dev_k: list[torch.Tensor], dev_v: list[torch.Tensor]) -> None:
        self.dev_k, self.dev_v = dev_k, dev_v

    def close(self) -> None:
        self.wait_saves()
        self.saver.close()
