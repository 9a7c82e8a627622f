"""A prefill's pages mapped in several layers at once (TwoTierCache.map_prefill_layers: the
fused retrieve with a layer axis, kernels/retrieve.py) == the per-layer retrieve calls it
replaces (`retrieve(layer, ..., prefill=True, mark_pending=True)`) on an identical cache:
the same slots in every layer, the same page_of / last_access / owner / residency index and
fill, the same prefill hit and miss counts, the same pages loaded into the same slots — with
layers whose states differ (other resident pages, ages, owners, quotas over and under), odd
selection lengths, pages with no data yet, a sub-range of the layers, and enough misses to
evict. Compiled on CUDA, interpreted on CPU."""
import pytest
import torch

from sparseserve.config import CacheConfig
from sparseserve.kernels import residency_hash
from sparseserve.worker.offload_cache import TwoTierCache

from tests.conftest import DEVICE

D, PS, HOST, ROWS, HKV = 4, 2, 700, 5, 2


def make_cache(layers: int, slots: int, seed: int) -> TwoTierCache:
    """A fused TwoTierCache on DEVICE whose layers each hold a different random state: about
    three quarters of the slots resident (other pages, ages and owners per layer), the device
    tier holding those pages' data, and random host pages."""
    cfg = CacheConfig(page_size=PS, num_pages=slots, kv_offload=True, num_host_pages=HOST,
                      eviction="category-lru", d2h_method="gpu-direct")
    c = TwoTierCache(cfg, layers, D, ROWS, torch.float32, DEVICE)
    c.fused = True
    g = torch.Generator().manual_seed(seed)
    dk = [torch.zeros(slots + 1, PS, D, device=DEVICE) for _ in range(layers)]
    dv = [torch.zeros(slots + 1, PS, D, device=DEVICE) for _ in range(layers)]
    c.attach_device_tier(dk, dv)
    c.row_quota.copy_(torch.tensor([slots // 4, 2, slots, 1, slots // 3, slots]))
    c.step.fill_(100)
    for layer in range(layers):
        c.host_k[layer].copy_(torch.randn(HOST + 1, PS, D, generator=g))
        c.host_v[layer].copy_(torch.randn(HOST + 1, PS, D, generator=g))
        n = 3 * slots // 4
        mapped = torch.randperm(slots, generator=g)[:n]
        resident = torch.randperm(HOST, generator=g)[:n]
        c.page_of[layer, mapped.to(DEVICE)] = resident.to(DEVICE)
        c.last_access[layer, mapped.to(DEVICE)] = torch.randint(0, 101, (n,), generator=g).to(
            DEVICE)
        c.owner[layer, mapped.to(DEVICE)] = torch.randint(0, ROWS, (n,), generator=g).to(DEVICE)
        residency_hash.rebuild(c.res_table[layer], c.page_of[layer], c.res_fill[layer])
        for s, p in zip(mapped.tolist(), resident.tolist()):
            dk[layer][s] = c.host_k[layer][p].to(DEVICE)
            dv[layer][s] = c.host_v[layer][p].to(DEVICE)
    return c


def prefill_selection(c: TwoTierCache, nb: int, seed: int):
    """A chunk's pages [1, Hkv, nb] as _prefill_plan makes them (distinct host pages per head;
    some resident in some layers), num_sel [1, Hkv], its row [1] and fresh_from [1, Hkv]."""
    g = torch.Generator().manual_seed(seed + 1000)
    # half of them pages resident in layer 0 (hits there, misses elsewhere), half not
    res0 = [p for p in c.page_of[0, :-1].tolist() if p >= 0]
    pick = torch.randperm(len(res0), generator=g)[:HKV * nb // 2].tolist()
    others = [p for p in torch.randperm(HOST, generator=g).tolist() if p not in set(res0)]
    ids = [res0[i] for i in pick] + others[:HKV * nb - len(pick)]
    pages = torch.tensor(ids, dtype=torch.int32).view(1, HKV, nb)
    num = torch.full((1, HKV), nb, dtype=torch.int32)
    fresh = torch.full((1, HKV), nb - nb // 3, dtype=torch.int32)  # the last third: new pages
    return (pages.to(DEVICE), num.to(DEVICE), torch.tensor([3], device=DEVICE),
            fresh.to(DEVICE))


def state(c: TwoTierCache):
    """Every layer's state (those outside the mapped range too: nothing may touch them). The
    residency index as each layer's multiset of entries: on a GPU the programs' inserts race
    for their probe positions, so where an entry lands varies from run to run (lookups through
    it are checked by slot_of in the test)."""
    return [t.clone().cpu() for t in (c.page_of, c.last_access, c.owner, c.res_fill,
                                      c.res_table.sort(dim=1).values, c._lru_scratch,
                                      c.prefill_hit_miss)] + [
        torch.stack(c.dev_k).cpu(), torch.stack(c.dev_v).cpu()]


@pytest.mark.parametrize("layers,l0,l1,slots,nb", [(3, 0, 3, 48, 17), (4, 1, 3, 97, 9),
                                                   (2, 0, 2, 24, 1), (3, 0, 3, 300, 97)])
@pytest.mark.parametrize("defer", [False, True])
def test_layers_at_once_equal_per_layer_calls(layers, l0, l1, slots, nb, defer):
    a, b = make_cache(layers, slots, 5), make_cache(layers, slots, 5)
    pages, num, row, fresh = prefill_selection(a, nb, 5)
    assert a.maps_layers_at_once()
    got, src, dst, n = a.map_prefill_layers(l0, l1, pages, num, row, fresh, defer_rebuild=defer)
    for layer in range(l0, l1):
        a.load_layer(layer, src[layer - l0], dst[layer - l0], n[layer - l0])
    want = [b.retrieve(layer, pages, num, row, fresh_from=fresh, prefill=True,
                       defer_rebuild=defer, mark_pending=True) for layer in range(l0, l1)]
    if defer:
        a.rebuild_indexes(l0, l1)
        b.rebuild_indexes(l0, l1)
    assert got.shape == (l1 - l0, 1, HKV, nb)
    for j, w in enumerate(want):
        assert torch.equal(got[j].cpu(), w.cpu()), f"layer {l0 + j}"
    for x, y in zip(state(a), state(b), strict=True):
        assert torch.equal(x, y)
    # every mapped page is found through the residency index of its layer
    for layer in range(l0, l1):
        found = a.slot_of(layer, pages.reshape(-1).long())
        assert torch.equal(found.cpu(), got[layer - l0].reshape(-1).long().cpu())
    assert int(a.prefill_hit_miss[1]) > 0  # something really missed (and was loaded)
    a.check_invariants()
    b.check_invariants()
    a.close()
    b.close()
