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
    residency_hash.rebuild(c.res_table[0], c.page_of[0])
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
    return {"fresh": None, "counter": c.hit_miss} if "counter" in params else {}


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
    assert torch.equal(a.last_access[0].sort().values, b.last_access[0].sort().values)
    a.close()
    b.close()


@pytest.mark.parametrize("S", [1, 17, 97, 4097])
def test_category_lru_order_is_a_key_sort(S):
    """The fused victim order is a permutation with non-increasing category-LRU keys."""
    from sparseserve.kernels.retrieve import category_lru_order
    g = torch.Generator().manual_seed(S)
    rows = 7
    last = torch.randint(-1, 200, (S,), generator=g)
    owner = torch.where(last >= 0, torch.randint(0, rows - 1, (S,), generator=g), rows - 1)
    quota = torch.randint(0, S // 4 + 2, (rows,), generator=g)
    last, owner, quota = last.to(DEVICE), owner.to(DEVICE), quota.to(DEVICE)
    step = torch.tensor(199, device=DEVICE)
    order = category_lru_order(last, owner, quota, step, 64)
    assert order.device.type == DEVICE.type
    assert torch.equal(order.sort().values, torch.arange(S, device=DEVICE))
    age = (step - last).clamp(min=0)
    res = torch.zeros(rows, dtype=torch.long, device=DEVICE).scatter_add_(
        0, owner, (last >= 0).long())
    over = (res > quota)[owner] & (last >= 0)
    key = torch.where(last < 0, 129, 1 + age.clamp(max=63) + 64 * over.long())
    key = torch.where((age == 0) & (last >= 0), 0, key)
    k = key[order]
    assert torch.all(k[:-1] >= k[1:])
