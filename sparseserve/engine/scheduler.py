"""Continuous-batching FCFS scheduler with chunked prefill, hybrid batches, layer-segmented
prefill, working-set-aware batch control and preemption (CPU only).

Every request's `num_computed_tokens` catches up with its tokens: a step gives each running
request what it is missing (1 token when decoding, a chunk or a layer segment when
prefilling), then admits waiting requests while the token budget, `max_num_seqs` and free
pages allow. With the two-tier cache the page pool is the host tier, and a request also needs
device slots for its step (engine/slot_budget.py): a running request whose slots do not fit
waits this step (it keeps its DRAM pages; nothing is recomputed), and a waiting one is not
admitted. Preemption by recompute happens only when the page pool itself (HBM without offload,
the host tier with it) is full.

Layer-segmented prefill (`max_inject_tokens`): a prompt is not chunked; each step it runs as
many of its next layers as the step's injection budget (prompt tokens x layers) allows, at
least one; a prompt whose single layer exceeds the budget is chunked to the budget. Whole
layers rarely fill the budget exactly (a 10k-token prompt wastes up to 10k of 65k), so what a
step could not use because the next layer did not fit carries over to the next step, up to a
quarter of the budget (INJECT_CREDIT_FRACTION): the budget holds on average, and no step
injects more than 1.25x it.
"""
from __future__ import annotations

import time
from collections import deque

import numpy as np

from sparseserve.config import (INJECT_CREDIT_FRACTION, CacheConfig, SchedulerConfig,
                                SparseConfig)
from sparseserve.engine.sched_output import NewRow, ScheduledChunk, SchedulerOutput
from sparseserve.engine.slot_budget import SlotBudget
from sparseserve.kvcache.manager import KVCacheManager, cdiv
from sparseserve.request import Request, RequestStatus


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, cache: CacheConfig, num_layers: int,
                 num_kv_heads: int, sparse: SparseConfig | None = None) -> None:
        self.cfg = cfg
        self.num_layers = num_layers
        self.slots = None
        if cache.kv_offload:
            budget = (sparse or SparseConfig()).token_budget // cache.page_size
            self.slots = SlotBudget(cache.num_pages, num_kv_heads, cache.page_size, budget,
                                    cfg.max_num_seqs, cfg.working_set_control)
        # whole prompts of layer-segmented prefill take no device slot when saves complete in
        # stream order (ScheduledChunk.slot_free); they are charged their decode need instead
        self.slot_free_prefill = (cache.kv_offload and cache.saves_ordered_on_device
                                  and cfg.max_inject_tokens is not None)
        # with the two-tier cache the pool is the host tier; device slots are the worker's
        pool_pages = cache.num_host_pages if cache.kv_offload else cache.num_pages
        self.kv = KVCacheManager(pool_pages, cache.page_size, num_kv_heads,
                                 cache.chunk_pages)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._free_rows = list(range(cfg.max_num_seqs - 1, -1, -1))
        self._rows: dict[str, int] = {}
        self._freed_rows: list[int] = []
        self._freed_ids: list[str] = []
        self._freed_pages: list = []
        # layer-segmented prefill: tokens of the chunk a request is running layer by layer
        self._segment_tokens: dict[str, int] = {}
        self._inject_credit = 0  # injection budget the last step left because a layer did not fit
        self._inject_short = False  # this step: a segment was cut short by the injection budget
        self.num_preemptions_total = 0

    # ---- queue management -----------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Finish or abort a request and return its pages and row."""
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        self.requests.pop(req.request_id, None)

    def _release(self, req: Request) -> None:
        pages = self.kv.page_table(req.request_id)
        if pages.size:
            self._freed_pages.append(pages.reshape(-1).copy())
        self.kv.free(req.request_id)
        self._segment_tokens.pop(req.request_id, None)
        if self.slots is not None:
            self.slots.forget(req.request_id)
        row = self._rows.pop(req.request_id, None)
        if row is not None:
            self._free_rows.append(row)
            self._freed_rows.append(row)
            self._freed_ids.append(req.request_id)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.prefill_layer = 0
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(req)

    # ---- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.cfg.max_num_batched_tokens
        limit = self.cfg.max_inject_tokens or 0
        inject = limit + self._inject_credit
        self._inject_short = False
        chunks: list[ScheduledChunk] = []
        new_rows: list[NewRow] = []
        preempted = False
        slots = self.slots
        if slots is not None:
            slots.start_step()

        for req in list(self.running):
            if budget <= 0:
                break
            if req not in self.running:  # preempted earlier in this loop
                continue
            if req.num_pending and len(req.output_token_ids) + req.num_pending >= req.max_tokens:
                continue  # async scheduling: its pending token is its last (it finishes)
            chunk = self._plan_chunk(req, budget, inject)
            if chunk is None:
                continue
            n_tokens, cost, inject_cost, l0, l1 = chunk
            slot_free = self._is_slot_free(req, n_tokens, inject_cost)
            if slots is not None and not self._take_slots(self._rows[req.request_id], req,
                                                          n_tokens, slot_free):
                continue  # waits for device slots this step; its DRAM pages stay
            while not self.kv.can_allocate(req.request_id, req.num_computed_tokens + n_tokens):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status == RequestStatus.PREEMPTED:
                break
            chunks.append(self._make_chunk(req, n_tokens, l0, l1, slot_free))
            budget -= cost
            inject -= inject_cost

        while (self.waiting and not preempted and budget > 0
               and len(self.running) < self.cfg.max_num_seqs):
            req = self.waiting[0]
            chunk = self._plan_chunk(req, budget, inject)
            if chunk is None:
                break
            n_tokens, cost, inject_cost, l0, l1 = chunk
            if not self.kv.can_allocate(req.request_id, req.num_computed_tokens + n_tokens):
                break
            row = self._free_rows[-1]
            slot_free = self._is_slot_free(req, n_tokens, inject_cost)
            if slots is not None and not self._take_slots(row, req, n_tokens, slot_free):
                break
            self.waiting.popleft()
            self._free_rows.pop()
            self._rows[req.request_id] = row
            new_rows.append(NewRow(row, req.request_id, req.sampling_params,
                                   req.min_tokens_stop_ids))
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chunks.append(self._make_chunk(req, n_tokens, l0, l1, slot_free))
            budget -= cost
            inject -= inject_cost

        # carry only a shortfall of granularity (a layer that did not fit), not idle budget
        self._inject_credit = (min(inject, int(limit * INJECT_CREDIT_FRACTION))
                               if self._inject_short else 0)
        quotas = None
        if slots is not None:
            self._keep_prompt_pages_resident(chunks)
            quotas = slots.quotas([c.row for c in chunks if c.is_decode])
        freed, freed_ids, freed_pages = self.take_freed()
        return SchedulerOutput(chunks=chunks, new_rows=new_rows, freed_rows=freed,
                               freed_request_ids=freed_ids, freed_pages=freed_pages,
                               num_layers=self.num_layers, row_quotas=quotas)

    def _is_slot_free(self, req: Request, n_tokens: int, inject_cost: int) -> bool:
        """A layer segment of the request's whole prompt (from position 0 to its last token)
        whose saves complete in stream order: it maps no device slot (ScheduledChunk)."""
        return (self.slot_free_prefill and inject_cost > 0 and req.num_computed_tokens == 0
                and n_tokens == req.num_tokens)

    def _keep_prompt_pages_resident(self, chunks: list[ScheduledChunk]) -> None:
        """Slot-free prompts of this step keep their newest pages resident in slots the step's
        reservations left spare — up to half of them, the rest buffers the decode rows — pinned
        as a mapped prefill's are. A lightly loaded cache so starts their decode warm (as the
        mapped prefill did, without charging anyone for it); under pressure nothing is kept and
        the first decode step loads what it selects (ScheduledChunk.resident_pages)."""
        slots = self.slots
        hkv = slots.hkv
        for c in chunks:
            if not c.slot_free:
                continue
            per_head = min(cdiv(c.start + c.num_tokens, slots.page_size), slots.left // 2 // hkv)
            if per_head > 0 and slots.extend(c.row, c.request_id, per_head * hkv):
                c.resident_pages = per_head

    def _take_slots(self, row: int, req: Request, n_tokens: int,
                    slot_free: bool = False) -> bool:
        """Reserve the device slots per layer `req` needs for its next `n_tokens` tokens. A
        slot-free prefill reserves what its first decode step will select (SparseServe's
        estimate for a new request: its token budget), unpinned: it holds no slot itself."""
        end = req.num_computed_tokens + n_tokens
        if slot_free:
            return self.slots.try_take(row, req.request_id,
                                       self.slots.decode_need(req.request_id, end), False)
        if n_tokens == 1 and req.prefill_layer == 0 and req.num_computed_tokens > 0 \
                and end == req.num_tokens:
            return self.slots.try_take(row, req.request_id,
                                       self.slots.decode_need(req.request_id, end), False)
        return self.slots.try_take(row, req.request_id, self.slots.prefill_need(end), True)

    def take_freed(self) -> tuple[list[int], list[str], np.ndarray]:
        """Rows, request ids and pages released since the last call (for the worker)."""
        rows, self._freed_rows = self._freed_rows, []
        ids, self._freed_ids = self._freed_ids, []
        pages = np.concatenate(self._freed_pages) if self._freed_pages else np.empty(0, np.int32)
        self._freed_pages = []
        return rows, ids, pages

    def _plan_chunk(self, req: Request, budget: int,
                    inject: int) -> tuple[int, int, int, int, int] | None:
        """-> (tokens, token-budget cost, injection cost, layer_start, layer_end), or None if
        it does not fit this step. Layer-segmented prefill is charged to the injection budget
        (prompt tokens x layers run), everything else to the token budget."""
        remaining = req.num_tokens - req.num_computed_tokens
        is_prefill = remaining > 1 or req.prefill_layer > 0
        limit = self.cfg.max_inject_tokens
        if limit is None or not is_prefill:
            n = min(remaining, budget) if self.cfg.enable_chunked_prefill else remaining
            if n <= 0 or n > budget:
                return None
            return n, n, 0, 0, self.num_layers
        n = self._segment_tokens.get(req.request_id)
        if n is None:
            # not chunked, unless one layer of the prompt is more than a step may inject
            n = min(remaining, limit)
        l0 = req.prefill_layer
        fit = inject // n
        layers = min(self.num_layers - l0, fit)
        if fit < self.num_layers - l0:
            self._inject_short = True  # the budget, not the prompt's layers, ended it
        if n <= 0 or layers < 1:
            return None
        self._segment_tokens[req.request_id] = n
        return n, 0, n * layers, l0, l0 + layers

    def _make_chunk(self, req: Request, n_tokens: int, l0: int, l1: int,
                    slot_free: bool = False) -> ScheduledChunk:
        start = req.num_computed_tokens
        first_chunk, new_chunks = self.kv.allocate(req.request_id, start + n_tokens)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.time()
        return ScheduledChunk(
            request_id=req.request_id,
            row=self._rows[req.request_id],
            token_ids=req.token_slice(start, start + n_tokens),
            start=start,
            layer_start=l0,
            layer_end=l1,
            sample=(l1 == self.num_layers and start + n_tokens == req.num_tokens),
            num_output_tokens=len(req.output_token_ids) + req.num_pending,
            slot_free=slot_free,
            first_new_chunk=first_chunk,
            new_chunks=new_chunks,
        )

    def update_after_step(self, out: SchedulerOutput,
                          working_sets: np.ndarray | None = None) -> None:
        """Advance each scheduled request's progress (before sampled tokens are appended).
        working_sets [max_num_seqs + 1]: per-row working sets the worker counted this step
        (two-tier cache; None when the step did not count them)."""
        self.record_working_sets(out, working_sets)
        for c in out.chunks:
            req = self.requests.get(c.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue
            if c.layer_end < self.num_layers:
                req.prefill_layer = c.layer_end
            else:
                req.prefill_layer = 0
                req.num_computed_tokens += c.num_tokens
                self._segment_tokens.pop(req.request_id, None)

    def record_working_sets(self, out: SchedulerOutput,
                            working_sets: np.ndarray | None) -> None:
        """The working sets the worker counted in step `out` (see update_after_step), for its
        decode requests still here (async scheduling records them a step later)."""
        if working_sets is None or self.slots is None:
            return
        for c in out.chunks:
            if c.is_decode and c.request_id in self.requests:
                self.slots.record(c.request_id, working_sets[c.row])

    @property
    def num_waiting_for_slots(self) -> int:
        """Requests that could not run in the last step for lack of device slots."""
        return 0 if self.slots is None else self.slots.num_waiting_for_slots

    @property
    def waiting_for_pinned_slots(self) -> bool:
        """The last schedule was held back by slots a prefill pinned the step before."""
        return self.slots is not None and bool(self.slots.pinned)

    @property
    def estimated_working_set(self) -> int:
        """Device slots per layer the last step's requests were estimated to need."""
        return 0 if self.slots is None else self.slots.estimated_working_set

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        assert len(self._rows) == len(self.running), "row leaked"
        assert len(self._free_rows) + len(self._rows) == self.cfg.max_num_seqs
