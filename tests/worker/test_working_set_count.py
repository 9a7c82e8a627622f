"""Working sets counted by selection (worker/selection_stamps.py, fed by
worker/offload_cache.py; SparseServe's definition): the pages a row selected in its last
`window` decode steps, per layer, max over layers — resident or not. Checked against an explicit Python union over a run of decode retrieves on a device
tier far too small for the selections (so most selected pages are evicted again), with
chunks owned by different rows, a padding lane, odd selection lengths, and freed pages."""
import numpy as np
import torch

from sparseserve.config import HOST_CHUNK_PAGES, CacheConfig
from sparseserve.worker.offload_cache import TwoTierCache

L, D, PS, SLOTS, HOST, ROWS, HKV, WINDOW = 2, 4, 2, 7, 16 * HOST_CHUNK_PAGES - 1, 3, 2, 5


def make_cache() -> TwoTierCache:
    cfg = CacheConfig(page_size=PS, num_pages=SLOTS, kv_offload=True, num_host_pages=HOST,
                      d2h_method="gpu-direct")
    c = TwoTierCache(cfg, L, D, ROWS, torch.float32, torch.device("cpu"),
                     working_set_window=WINDOW)
    c.attach_device_tier([torch.zeros(SLOTS + 1, PS, D) for _ in range(L)],
                         [torch.zeros(SLOTS + 1, PS, D) for _ in range(L)])
    return c


def test_working_set_is_the_union_of_recent_selections_even_when_evicted():
    c = make_cache()
    C = HOST_CHUNK_PAGES
    # row 0 owns chunks 0-1, row 2 owns chunk 5 (its pages 80..95), row 1 nothing yet
    owned = {0: [0, 1], 2: [5]}
    for row, chunks in owned.items():
        c.stamps.assign(torch.tensor([row] * len(chunks)), torch.tensor(chunks))
    rng = np.random.default_rng(3)
    history = []  # (step, layer, row, set of pages)
    for step in range(1, 14):
        c.begin_step()
        for layer in range(L):
            K = 5
            pages = torch.full((3, HKV, K), c.scratch_page, dtype=torch.int32)
            num = torch.zeros((3, HKV), dtype=torch.int32)
            for b, row in enumerate((0, 2)):
                base = owned[row]
                pool = np.concatenate([np.arange(ch * C, ch * C + C) for ch in base])
                for h in range(HKV):
                    n = int(rng.integers(1, K + 1))  # odd lengths, 1..5
                    pick = rng.choice(pool, n, replace=False)
                    pages[b, h, :n] = torch.from_numpy(pick.astype(np.int32))
                    num[b, h] = n
                    history.append((step, layer, row, set(pick.tolist())))
            # lane 2 pads (scratch row, scratch page, a nonzero count: must not be stamped)
            num[2] = K
            rows = torch.tensor([0, 2, ROWS])
            c.retrieve(layer, pages, num, rows)
        c.count_working_sets()
        got = c.working_sets()
        for row in range(ROWS + 1):
            per_layer = []
            for layer in range(L):
                union = set()
                for s, ly, r, pick in history:
                    if r == row and ly == layer and s > step - WINDOW:
                        union |= pick
                per_layer.append(len(union))
            assert got[row] == max(per_layer), (step, row)
    # the selections cannot all be resident (7 slots per layer): the count is not residency
    assert got[0] > SLOTS and got[2] > 0 and got[1] == 0
    # freeing row 0's pages drops them from every count (their ids are reused)
    c.free_pages(np.arange(0, 2 * C))
    c.count_working_sets()
    got = c.working_sets()
    assert got[0] == 0 and got[2] > 0
    assert int((c.stamps.last_selected[:, :2 * C] >= 0).sum()) == 0
    assert int(c.stamps.last_selected[:, c.scratch_page].max()) == -1
