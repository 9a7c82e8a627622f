"""Device-slot budget of one step under the two-tier cache (SparseServe Algorithm 1 and Spin's
elastic buffer; policy only, plain Python).

Each layer has `num_slots` device slots. A step may only run requests whose pages fit:
* a decode request needs its working set: the union of pages it selected over its last `w`
  decode steps, resident or not, counted on the GPU (per-page selection stamps, max over
  layers; worker/offload_cache.py) and read back one step late; until the first count
  arrives, its mandatory selection (the token budget, or every page of a shorter context);
* a prefill chunk needs, exactly, every page of its request up to the chunk's end (they are all
  mapped to slots while the chunk runs; under layer-segmented prefill that is one layer's pages
  in each pool it runs) — except a whole prompt prefilled slot-free, which needs its first
  decode selection, plus the newest pages it keeps in the step's spare slots.

A prefill's slots cannot be evicted until its save has landed in DRAM, which the worker
guarantees one step later (worker/offload_cache.py): so the pages a prefill chunk used in the
previous step stay charged this step, whether or not the request runs again.

With working-set control the scheduler admits requests in order while the sum of these
estimates fits `M_avl` (the slots minus a reserve); without it (the vLLM-SO baseline) only the
hard bound holds: what one step selects must fit the slots, so a request's estimate is its
mandatory selection. The per-row quotas the worker evicts by (mandatory + buffering slots) are
sized from the same estimates: admitted rows get their estimate plus an even share of what is
left; rows that wait this step get 0, so their slots are the first victims.
"""
from __future__ import annotations

import numpy as np

from sparseserve.kvcache.manager import cdiv


class SlotBudget:
    def __init__(self, num_slots: int, num_kv_heads: int, page_size: int, budget_pages: int,
                 num_rows: int, working_set_control: bool) -> None:
        self.num_slots = num_slots
        self.hkv = num_kv_heads
        self.page_size = page_size
        self.budget_pages = budget_pages
        self.num_rows = num_rows
        self.control = working_set_control
        # a small reserve keeps the estimate's error from becoming evictions of this step's
        # own pages (a step never needs more victims than there are slots it did not use)
        self.reserve = max(num_kv_heads, num_slots // 64) if working_set_control else 0
        self.counted: dict[str, int] = {}  # request id -> working set counted on the GPU
        # this step's plan
        self.left = 0
        self.needs: dict[int, int] = {}  # row -> slots reserved this step
        self.num_waiting_for_slots = 0
        # request id -> slots its prefill used in the last step / in this step (pinned until
        # their saves land)
        self.pinned: dict[str, int] = {}
        self.prefill_now: dict[str, int] = {}

    # ---- estimates ------------------------------------------------------------------------
    def mandatory(self, context_tokens: int) -> int:
        """Slots one decode step of a request with `context_tokens` tokens selects."""
        return min(self.budget_pages, cdiv(context_tokens, self.page_size)) * self.hkv

    def decode_need(self, request_id: str, context_tokens: int) -> int:
        need = self.mandatory(context_tokens)
        if self.control:
            need = max(need, self.counted.get(request_id, 0))
        return need

    def prefill_need(self, end_tokens: int) -> int:
        return cdiv(end_tokens, self.page_size) * self.hkv

    def record(self, request_id: str, working_set: int) -> None:
        self.counted[request_id] = int(working_set)

    def forget(self, request_id: str) -> None:
        """A request left (finished, aborted, preempted): the worker frees its slots."""
        self.counted.pop(request_id, None)
        self.pinned.pop(request_id, None)
        self.prefill_now.pop(request_id, None)

    # ---- one step -------------------------------------------------------------------------
    def start_step(self) -> None:
        self.pinned, self.prefill_now = self.prefill_now, {}
        self.left = self.num_slots - self.reserve - sum(self.pinned.values())
        self.needs = {}
        self.num_waiting_for_slots = 0

    def try_take(self, row: int, request_id: str, need: int, prefill: bool) -> bool:
        """Reserve `need` slots per layer for `row` this step if they fit. What the request
        pinned last step is already charged (its pages there are what it needs now)."""
        charge = max(0, need - self.pinned.get(request_id, 0))
        if charge > self.left:
            self.num_waiting_for_slots += 1
            return False
        self.left -= charge
        self.needs[row] = self.needs.get(row, 0) + need
        if prefill:
            self.prefill_now[request_id] = need
        return True

    def extend(self, row: int, request_id: str, extra: int) -> bool:
        """Grow `row`'s reservation of this step by `extra` slots per layer, pinned next step
        like a prefill's (a slot-free prompt's resident pages). Charged once against what the
        request pinned last step: the growth of the total need over the pinned slots — not a
        second discount (two separate try_take calls would subtract the pinned slots twice)."""
        before = self.needs.get(row, 0)
        pinned = self.pinned.get(request_id, 0)
        charge = max(0, before + extra - pinned) - max(0, before - pinned)
        if charge > self.left:
            return False
        self.left -= charge
        self.needs[row] = before + extra
        self.prefill_now[request_id] = extra
        return True

    @property
    def estimated_working_set(self) -> int:
        """Slots per layer the admitted requests of this step are estimated to need."""
        return sum(self.needs.values())

    def quotas(self, decode_rows: list[int]) -> np.ndarray:
        """[num_rows + 1] int64 per-row quotas: the step's reservation, plus an even share of
        the unreserved slots for the decode rows (their buffering slots); 0 elsewhere."""
        q = np.zeros(self.num_rows + 1, dtype=np.int64)
        for row, need in self.needs.items():
            q[row] = need
        spare = self.num_slots - self.estimated_working_set - sum(self.pinned.values())
        if decode_rows and spare > 0:
            q[decode_rows] += spare // len(decode_rows)
        return q
