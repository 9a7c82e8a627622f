"""What the fused retrieve took over from per-layer torch launches (kernels/retrieve.py):
working-set stamps and the decode's fresh-page flags in the probe, the miss ranks and the
victim order's offsets from per-program counts (no scan launch), the victim order's scratch
left zeroed by assign (no fill launch). Each against its torch reference (TwoTierCache's torch
retrieve, SelectionStamps.stamp, a full-length victim order) at odd sizes."""
import pytest
import torch

from sparseserve.config import CacheConfig
from sparseserve.kernels import residency_hash
from sparseserve.kernels.category_lru import category_lru_order, lru_scratch_size
from sparseserve.worker.offload_cache import TwoTierCache

from tests.conftest import DEVICE
from tests.kernels.test_retrieve import category_keys, random_slots

PS, D, ROWS = 2, 4, 5


def cache_with_selection(n: int, seed: int, fused: bool):
    """A one-layer TwoTierCache on DEVICE, half full, and a selection of n entries in one
    (request, KV head) row per batch row: pages [B, 1, K] (B = 2 when n > 1: the second row
    is shorter and its token starts a page), num_sel, rows, starts [B] int32."""
    slots = max(8, n)  # room for every miss
    host = 3 * slots + 8
    cfg = CacheConfig(page_size=PS, num_pages=slots, kv_offload=True, num_host_pages=host,
                      eviction="category-lru", d2h_method="gpu-direct")
    c = TwoTierCache(cfg, 1, D, ROWS, torch.float32, DEVICE)
    c.fused = fused
    g = torch.Generator().manual_seed(seed)
    c.attach_device_tier([torch.zeros(slots + 1, PS, D, device=DEVICE)],
                         [torch.zeros(slots + 1, PS, D, device=DEVICE)])
    c.host_k[0].copy_(torch.randn(host + 1, PS, D, generator=g))
    c.host_v[0].copy_(torch.randn(host + 1, PS, D, generator=g))
    nres = slots // 2
    mapped = torch.randperm(slots, generator=g)[:nres].to(DEVICE)
    resident = torch.randperm(host, generator=g)[:nres]
    c.page_of[0, mapped] = resident.to(DEVICE)
    c.last_access[0, mapped] = torch.randint(0, 90, (nres,), generator=g).to(DEVICE)
    c.owner[0, mapped] = torch.randint(0, ROWS, (nres,), generator=g).to(DEVICE)
    c.step.fill_(100)
    c.stamps.step.fill_(9)
    residency_hash.rebuild(c.res_table[0], c.page_of[0], c.res_fill[0])
    for sl, p in zip(mapped.tolist(), resident.tolist()):  # resident data = the host page
        c.dev_k[0][sl] = c.host_k[0][p].to(DEVICE)
        c.dev_v[0][sl] = c.host_v[0][p].to(DEVICE)
    B = 2 if n > 1 else 1
    K = -(-n // B)
    # distinct pages, about half of them resident; the last row's last entry the scratch page
    others = [p for p in torch.randperm(host, generator=g).tolist()
              if p not in set(resident.tolist())]
    pool = resident.tolist()[: K * B // 2] + others[: K * B]
    pick = torch.tensor(pool)[torch.randperm(len(pool), generator=g)[: B * K]]
    pages = pick.view(B, 1, K).to(torch.int32)
    num_sel = torch.tensor([[K]] + [[max(1, K - 3)]] * (B - 1), dtype=torch.int32)
    if B > 1:
        pages[-1, 0, 0] = c.scratch_page  # a padding entry: never stamped, never loaded
    starts = torch.tensor([0] + [1] * (B - 1), dtype=torch.int32)
    rows = torch.arange(B)
    return c, pages.to(DEVICE), num_sel.to(DEVICE), rows.to(DEVICE), starts.to(DEVICE)


@pytest.mark.parametrize("n", [1, 17, 54, 97, 4097])
def test_fused_stamps_and_fresh_last_match_torch(n):
    """Fused (stamps and fresh-page flags in the kernels) vs the torch retrieve: the same
    stamps, hit/miss counts, pages loaded; every valid entry mapped to a slot holding its page
    (loaded unless it is the fresh last page); the victim order's scratch left zeroed."""
    seed = n
    a, pages, num_sel, rows, starts = cache_with_selection(n, seed, fused=False)
    b = cache_with_selection(n, seed, fused=True)[0]
    ref = a.retrieve(0, pages, num_sel, rows, fresh_last=starts)
    got = b.retrieve(0, pages, num_sel, rows, fresh_last=starts)
    assert torch.equal(a.stamps.last_selected, b.stamps.last_selected)
    assert int((b.stamps.last_selected[0] == 9).sum()) > 0
    assert int(b.stamps.last_selected[0, b.scratch_page]) == -1
    assert torch.equal(a.hit_miss, b.hit_miss)
    assert a.loader.stats().pages == b.loader.stats().pages == int(b.hit_miss[1])
    assert int(b._lru_scratch.abs().sum()) == 0
    B, _, K = pages.shape
    for c, slots in ((a, ref), (b, got)):
        s = slots.long().cpu()
        for bi in range(B):
            for j in range(int(num_sel[bi, 0])):
                p = int(pages[bi, 0, j])
                if p == c.scratch_page:
                    assert int(s[bi, 0, j]) == c.scratch_slot
                    continue
                assert int(c.page_of[0, s[bi, 0, j]]) == p
                fresh = bool(starts[bi]) and j == int(num_sel[bi, 0]) - 1
                if not fresh:
                    assert torch.equal(c.dev_k[0][s[bi, 0, j]].cpu(), c.host_k[0][p])
        c.check_invariants()
    a.close()
    b.close()


@pytest.mark.parametrize("S", [1, 17, 54, 97, 4097])
def test_category_lru_order_need_in_parts(S):
    """`need` given as per-program counts (fused_retrieve's) and a caller's zeroed scratch:
    the same order as need in one count and a fresh scratch (the placement is deterministic);
    its first need entries are distinct slots with the full order's keys."""
    rows = 7
    last, owner, quota, step = random_slots(S, rows, seed=S + 5)
    need = S // 3 + 1
    g = torch.Generator().manual_seed(S)
    cuts = torch.sort(torch.randint(0, need + 1, (6,), generator=g)).values.tolist()
    parts = [b - a for a, b in zip([0] + cuts, cuts + [need])]
    one = category_lru_order(last, owner, quota, step, 64,
                             need=torch.tensor([need], dtype=torch.int32, device=DEVICE))
    scratch = torch.zeros(lru_scratch_size(rows, 64), dtype=torch.int32, device=DEVICE)
    split = category_lru_order(last, owner, quota, step, 64,
                               need=torch.tensor(parts, dtype=torch.int32, device=DEVICE),
                               scratch=scratch)
    assert torch.equal(one[:need], split[:need])
    assert split[:need].unique().numel() == need
    full = category_lru_order(last, owner, quota, step, 64)
    key = category_keys(last, owner, quota, step, rows)
    assert sorted(key[split[:need]].tolist()) == sorted(key[full[:need]].tolist())
