"""TwoTierCache's introspection (a mixin of worker/offload_cache.py): the counters the
server reads after every step (`stats`) and the residency invariants tests check."""
from __future__ import annotations

import torch


class CacheIntrospection:
    def stats(self, fresh: bool = True) -> dict[str, int]:
        """Counters. The device counters are read with one copy, not one per counter: the
        server reads them after every step; fresh=False does not wait for the device
        (LaggedCounters: up to ~50 ms and a step late, exact after a fresh read)."""
        saved = self.saver.stats()
        dev = self.hit_miss.device

        def parts():  # built only when a copy starts (LaggedCounters)
            return [self.hit_miss, self.prefill_hit_miss, self.direct_bytes_saved.view(1),
                    (self.page_of[:, :-1] >= 0).sum().view(1), self.loader.counter(dev)]
        hits, misses, p_hits, p_misses, direct, resident, pages, nbytes = \
            self.counters.read(parts, dev, fresh)
        return {"cache_hits_total": hits, "cache_misses_total": misses,
                "prefill_cache_hits_total": p_hits, "prefill_cache_misses_total": p_misses,
                "bytes_loaded_total": nbytes, "bytes_saved_total": saved.bytes + direct,
                "pages_loaded_total": pages, "resident_slots": resident,
                # fences and free_pages, plus FlashD2H saves waiting for staging space
                "save_wait_seconds_total": self.save_wait_s + getattr(self.saver,
                                                                       "ring_stall_s", 0.0)}

    def check_invariants(self) -> None:
        """The residency index and the reverse map agree (tests; reads the device): every
        mapped slot is found from its page, no page is mapped twice, the scratch slot holds
        nothing, and the index's entry count (live + stale) is what `res_fill` says, at least
        one per mapped slot and at most half the table."""
        for layer in range(self.num_layers):
            page_of = self.page_of[layer]
            assert int(page_of[self.scratch_slot]) == -1, "scratch slot mapped"
            mapped = torch.nonzero(page_of >= 0).flatten()
            pages = page_of[mapped]
            assert pages.unique().numel() == pages.numel(), "page mapped to two slots"
            found = self.slot_of(layer, pages)
            assert torch.equal(found, mapped), "residency index disagrees with page_of"
            entries = int((self.res_table[layer] >= 0).sum())
            assert entries == int(self.res_fill[layer, 0]), "index entry count drifted"
            assert mapped.numel() <= entries <= self.res_table.shape[1] // 2
