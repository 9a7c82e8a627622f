"""Fused retrieve (kernels/retrieve.py: compiled on CUDA, interpreted on CPU) vs the torch
retrieve of TwoTierCache on the same cache state, both on the test device (host tier pinned
there on a GPU): same hits, same number of misses, victims of the same
eviction keys, every selected page mapped to a slot that holds it (and its data loaded), hits
never evicted, counters equal — for both eviction policies, odd selection lengths, a padding
row that selects the scratch page."""
import inspect

import pytest
import torch

from sparseserve.config import CacheConfig
from sparseserve.kernels import residency_hash
from sparseserve.worker.offload_cache import TwoTierCache

from tests.conftest import DEVICE

L, D, PS, SLOTS, HOST, ROWS = 1, 4, 2, 48, 300, 5
B, HKV, K = 4, 2, 9


def make_cache(policy, seed):
    """A TwoTierCache on DEVICE with 36 of 48 slots resident (random pages, ages, owners), the
    device tier holding those pages' data, and a selection [B, Hkv, K] (half resident pages,
    half not), num_sel [B, Hkv] and batch rows [B] (the last a padding lane), on DEVICE."""
    cfg = CacheConfig(page_size=PS, num_pages=SLOTS, kv_offload=True, num_host_pages=HOST,
                      eviction=policy, d2h_method="gpu-direct")
    c = TwoTierCache(cfg, L, D, ROWS, torch.float32, DEVICE)
    g = torch.Generator().manual_seed(seed)
    dk = [torch.zeros(SLOTS + 1, PS, D, device=DEVICE)]
    dv = [torch.zeros(SLOTS + 1, PS, D, device=DEVICE)]
    c.attach_device_tier(dk, dv)
    c.host_k[0].copy_(torch.randn(HOST + 1, PS, D, generator=g))
    c.host_v[0].copy_(torch.randn(HOST + 1, PS, D, generator=g))
    mapped = torch.randperm(SLOTS, generator=g)[:36]
    resident = torch.randperm(HOST, generator=g)[:36]
    c.page_of[0, mapped.to(DEVICE)] = resident.to(DEVICE)
    c.last_access[0, mapped.to(DEVICE)] = torch.randint(0, 90, (36,), generator=g).to(DEVICE)
    c.owner[0, mapped.to(DEVICE)] = torch.randint(0, ROWS, (36,), generator=g).to(DEVICE)
    c.row_quota.fill_(6)
    c.step.fill_(100)
    residency_hash.rebuild(c.res_table[0], c.page_of[0], c.res_fill[0])
    for s, p in zip(mapped.tolist(), resident.tolist()):  # resident data equals the host page
        dk[0][s] = c.host_k[0][p].to(DEVICE)
        dv[0][s] = c.host_v[0][p].to(DEVICE)
    # selection: per (row, head) distinct pages, half resident, half not
    fresh = torch.tensor([p for p in torch.randperm(HOST, generator=g).tolist()
                          if p not in set(resident.tolist())])
    pages = torch.empty(B, HKV, K, dtype=torch.int32)
    pool_r, pool_f = resident.tolist(), fresh.tolist()
    for b in range(B):
        for h in range(HKV):
            row = [pool_r.pop() if j % 2 else pool_f.pop() for j in range(K)]
            pages[b, h] = torch.tensor(row)
    num_sel = torch.tensor([[9, 1], [4, 7], [2, 5], [1, 1]], dtype=torch.int32)
    pages[3] = c.scratch_page  # a padding lane (scratch row) selects the scratch page
    rows = torch.tensor([0, 3, 1, ROWS], dtype=torch.long)
    return c, pages.to(DEVICE), num_sel.to(DEVICE), rows.to(DEVICE)


def _extra(method, c):
    """Arguments past (layer, pages, valid | num_sel, rows) of TwoTierCache's private retrieve
    paths: none, or (fresh=None, counter=the decode hit/miss counter) where it takes them."""
    params = inspect.signature(method).parameters
    extra = {"counter": c.hit_miss} if "counter" in params else {}
    extra.update({name: None for name in ("fresh", "fresh_from") if name in params})
    return extra


def keys_of(c, slots):
    """category-LRU key of each slot before the step (kvcache/eviction.py layout)."""
    from sparseserve.kvcache.eviction import victim_order  # noqa: F401 (same definition)
    last, own = c.last_access[0, :-1], c.owner[0, :-1]
    age = (c.step - last).clamp(min=0)
    res = torch.zeros(ROWS + 1, dtype=torch.long, device=last.device).scatter_add_(
        0, own, (last >= 0).long())
    over = (res > c.row_quota)[own] & (last >= 0)
    key = torch.where(last < 0, 129, 1 + age.clamp(max=63) + 64 * over.long())
    return key[slots]


@pytest.mark.parametrize("policy", ["category-lru", "lru"])
@pytest.mark.parametrize("seed", [0, 1])
def test_fused_retrieve_matches_torch(policy, seed):
    a, pages, num_sel, rows = make_cache(policy, seed)
    b = make_cache(policy, seed)[0]  # the same state, built twice
    before = a.page_of[0].clone()
    valid = torch.arange(K, device=DEVICE).view(1, 1, K) < num_sel.unsqueeze(-1)
    ref = a._retrieve_torch(0, pages, valid, rows, **_extra(a._retrieve_torch, a))
    got = b._retrieve_fused(0, pages, num_sel, rows, **_extra(b._retrieve_fused, b))
    assert ref.device.type == got.device.type == DEVICE.type
    assert torch.equal(a.hit_miss, b.hit_miss)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    for c, slots in ((a, ref), (b, got)):
        for bi in range(B):
            for h in range(HKV):
                for j in range(K):
                    s = int(slots[bi, h, j])
                    if j >= num_sel[bi, h] or bi == 3:
                        assert s == c.scratch_slot
                        continue
                    p = int(pages[bi, h, j])
                    assert int(c.page_of[0, s]) == p
                    assert torch.equal(c.dev_k[0][s].cpu(), c.host_k[0][p])
                    if (before == p).any():  # a hit keeps its slot
                        assert s == int((before == p).nonzero()[0])
                    else:
                        assert int(c.owner[0, s]) == int(rows[bi])
        c.check_invariants()
    # victims: the same multiset of eviction keys (ties within a key may differ)
    new_a = ((a.page_of[0, :-1] != before[:-1]) & (a.page_of[0, :-1] >= 0)).nonzero().flatten()
    new_b = ((b.page_of[0, :-1] != before[:-1]) & (b.page_of[0, :-1] >= 0)).nonzero().flatten()
    assert new_a.numel() == new_b.numel() == int(a.hit_miss[1])
    if policy == "category-lru":
        fresh = make_cache(policy, seed)[0]
        assert sorted(keys_of(fresh, new_a).tolist()) == sorted(keys_of(fresh, new_b).tolist())
    # touched this step: the hits and the victims (which victim within a key is arbitrary
    # on a GPU, so the untouched slots' ages may differ)
    assert int((a.last_access[0] == a.step).sum()) == int((b.last_access[0] == b.step).sum())
    a.close()
    b.close()



def random_slots(S: int, rows: int, seed: int):
    """Slot state on DEVICE for victim-order tests: last_access [S] (-1 = free), owner [S]
    (free slots owned by the last row), quota [rows], step [] (199)."""
    g = torch.Generator().manual_seed(seed)
    last = torch.randint(-1, 200, (S,), generator=g)
    owner = torch.where(last >= 0, torch.randint(0, rows - 1, (S,), generator=g), rows - 1)
    quota = torch.randint(0, S // 4 + 2, (rows,), generator=g)
    return last.to(DEVICE), owner.to(DEVICE), quota.to(DEVICE), torch.tensor(199, device=DEVICE)


def category_keys(last, owner, quota, step, rows: int):
    """The category-LRU key of every slot (kvcache/eviction.py's layout, 64 age buckets)."""
    age = (step - last).clamp(min=0)
    res = torch.zeros(rows, dtype=torch.long, device=last.device).scatter_add_(
        0, owner, (last >= 0).long())
    over = (res > quota)[owner] & (last >= 0)
    key = torch.where(last < 0, 129, 1 + age.clamp(max=63) + 64 * over.long())
    return torch.where((age == 0) & (last >= 0), 0, key)


@pytest.mark.parametrize("S", [1, 17, 97, 4097])
def test_category_lru_order_is_a_key_sort(S):
    """The fused victim order is a permutation with non-increasing category-LRU keys."""
    from sparseserve.kernels.category_lru import category_lru_order
    rows = 7
    last, owner, quota, step = random_slots(S, rows, seed=S)
    order = category_lru_order(last, owner, quota, step, 64)
    assert order.device.type == DEVICE.type
    assert torch.equal(order.sort().values, torch.arange(S, device=DEVICE))
    key = category_keys(last, owner, quota, step, rows)
    k = key[order]
    assert torch.all(k[:-1] >= k[1:])


@pytest.mark.parametrize("seed", [0, 1])
def test_fused_retrieve_fresh_pages_match_torch(seed):
    """Pages with no data yet (k >= fresh_from): a slot, no load, not counted as a miss — the
    fused path and the torch path agree, and a fresh page's slot keeps its old bytes."""
    a, pages, num_sel, rows = make_cache("category-lru", seed)
    b = make_cache("category-lru", seed)[0]
    fresh_from = torch.tensor([[7, 0], [2, 9], [1, 5], [0, 0]], dtype=torch.int32, device=DEVICE)
    k = torch.arange(K, device=DEVICE).view(1, 1, K)
    valid = k < num_sel.unsqueeze(-1)
    ref = a._retrieve_torch(0, pages, valid, rows, k >= fresh_from.unsqueeze(-1), a.hit_miss)
    dev_before = b.dev_k[0].clone()
    got = b._retrieve_fused(0, pages, num_sel, rows, fresh_from, b.hit_miss)
    assert torch.equal(a.hit_miss, b.hit_miss)
    loaded = b.loader.stats().pages
    assert loaded == int(b.hit_miss[1]) == a.loader.stats().pages
    for bi in range(3):
        for h in range(HKV):
            for j in range(int(num_sel[bi, h])):
                s, p = int(got[bi, h, j]), int(pages[bi, h, j])
                assert int(b.page_of[0, s]) == p and int(a.page_of[0, int(ref[bi, h, j])]) == p
                if j >= int(fresh_from[bi, h]) and not torch.equal(
                        dev_before[s].cpu(), b.host_k[0][p]):
                    assert torch.equal(b.dev_k[0][s].cpu(), dev_before[s].cpu())  # not loaded
    b.check_invariants()
    a.close()
    b.close()


def test_residency_index_stays_exact_across_many_remaps():
    """Stale entries of remapped slots never answer a lookup, the index rebuilds itself once
    its entries pass half the table, and every step's selection finds exactly its slots."""
    c, _, _, _ = make_cache("category-lru", 3)
    g = torch.Generator().manual_seed(7)
    H = c.res_table.shape[1]
    rebuilt = False
    prev = int(c.res_fill[0, 0])
    for step in range(60):
        c.step += 1
        # distinct pages, 40 of the 48 slots' worth per step (the rest of each row is padding)
        sel = torch.randperm(HOST, generator=g)[:B * HKV * K]
        pages = sel.view(B, HKV, K).to(torch.int32).to(DEVICE)
        num_sel = torch.full((B, HKV), 5, dtype=torch.int32, device=DEVICE)
        rows = torch.arange(B, device=DEVICE)
        slots = c._retrieve_fused(0, pages, num_sel, rows, None, c.hit_miss)
        assert torch.equal(c.page_of[0][slots[..., :5].long()].cpu(),
                           pages[..., :5].long().cpu())
        fill = int(c.res_fill[0, 0])
        rebuilt |= fill < prev
        prev = fill
        c.check_invariants()
        # a page that is not resident is not found (stale entries fail the key check)
        gone = torch.tensor([p for p in range(HOST) if p not in set(c.page_of[0].tolist())],
                            device=DEVICE)
        assert bool((c.slot_of(0, gone) < 0).all())
    assert rebuilt and prev <= H // 2
    c.close()


@pytest.mark.parametrize("S,need", [(17, 1), (97, 40), (4097, 300), (4097, 0)])
def test_category_lru_order_up_to_need(S, need):
    """With `need`, the first need entries are the full order's keys (ties aside): distinct
    slots whose key multiset equals the full sort's first need keys."""
    from sparseserve.kernels.category_lru import category_lru_order
    rows = 7
    last, owner, quota, step = random_slots(S, rows, seed=S + need)
    full = category_lru_order(last, owner, quota, step, 64)
    part = category_lru_order(last, owner, quota, step, 64,
                              need=torch.tensor([need], dtype=torch.int32, device=DEVICE))
    head = part[:need]
    assert head.unique().numel() == need and bool(((head >= 0) & (head < S)).all())
    key = category_keys(last, owner, quota, step, rows)
    assert sorted(key[head].tolist()) == sorted(key[full[:need]].tolist())
