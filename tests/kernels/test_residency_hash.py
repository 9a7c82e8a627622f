"""Residency index (hash table page -> slot): Triton kernels (compiled on CUDA, interpreted on
CPU) and the torch path, both on the test device, vs a dict built from the reverse map, at odd
sizes, with dense runs of page ids (a chunk) and a nearly full table."""
import pytest
import torch

from sparseserve.kernels import residency_hash as rh


def expected(page_of, queries):
    """Slot of each query page by a dict (-1: not mapped), on the queries' device."""
    where = {int(p): s for s, p in enumerate(page_of.tolist()) if p >= 0}
    return torch.tensor([where.get(int(p), -1) if p >= 0 else -1 for p in queries.tolist()],
                        device=queries.device)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("num_slots,fill", [(1, 1.0), (17, 0.5), (97, 1.0), (4097, 0.8)])
def test_lookup_finds_every_mapped_slot(device, backend, num_slots, fill):
    g = torch.Generator().manual_seed(num_slots)
    page_of = torch.full((num_slots,), -1, dtype=torch.long)
    mapped = torch.rand(num_slots, generator=g) < fill
    n = int(mapped.sum())
    # half consecutive ids (a chunk's pages), half scattered ids
    ids = torch.cat([torch.arange(1000, 1000 + n // 2),
                     torch.randperm(10**6, generator=g)[:n - n // 2] + 2000])
    page_of[mapped] = ids
    page_of = page_of.to(device)
    table = torch.empty(rh.table_size(num_slots), dtype=torch.int32, device=device)
    rh.rebuild(table, page_of, backend=backend)
    assert int((table >= 0).sum()) == n
    queries = torch.cat([page_of, torch.randint(0, 10**6, (301,), generator=g).to(device),
                         torch.tensor([-1, 0], device=device)])
    got = rh.lookup(table, page_of, queries, backend=backend)
    assert torch.equal(got, expected(page_of, queries))


def test_backends_agree_after_remapping(device):
    """Rebuilt after slots change pages (eviction): no stale entry survives."""
    g = torch.Generator().manual_seed(3)
    page_of = torch.randperm(500, generator=g)[:64].long().to(device)
    table = torch.empty(rh.table_size(64), dtype=torch.int32, device=device)
    for i in range(3):
        victims = torch.randperm(64, generator=g)[:20].to(device)
        page_of[victims] = (torch.randperm(500, generator=g)[:20] + 500 * (i + 1)).to(device)
        page_of[victims[:5]] = -1
        for backend in ("torch", "triton"):
            rh.rebuild(table, page_of, backend=backend)
            q = torch.arange(-1, 2000, device=device)
            assert torch.equal(rh.lookup(table, page_of, q, backend=backend),
                               expected(page_of, q))


def test_table_size_keeps_load_at_most_half():
    for s in (1, 2, 17, 1000, 4096, 4097):
        h = rh.table_size(s)
        assert h & (h - 1) == 0 and h >= 2 * s


@pytest.mark.parametrize("num_slots", [1, 17, 97])
def test_batched_rebuild_if_full_decides_per_layer(device, num_slots):
    """rebuild_if_full over [L, H] tables in one launch set == each layer on its own: a layer
    whose entries exceed half its table is rebuilt (fill = its mapped slots, stale entries
    gone), the others are left as they were (a stale entry there stays)."""
    g = torch.Generator().manual_seed(num_slots)
    L, H = 3, rh.table_size(num_slots)
    page_of = torch.full((L, num_slots), -1, dtype=torch.long)
    for layer in range(L):
        k = max(1, num_slots // (layer + 1))
        page_of[layer, torch.randperm(num_slots, generator=g)[:k]] = \
            torch.randperm(10**5, generator=g)[:k]
    page_of = page_of.to(device)
    table = torch.empty((L, H), dtype=torch.int32, device=device)
    fill = torch.zeros((L, 2), dtype=torch.long, device=device)
    for layer in range(L):
        rh.rebuild(table[layer], page_of[layer], fill[layer], backend="triton")
    old = page_of.clone()
    page_of[:, 0] = torch.tensor([10**6, 10**6 + 1, 10**6 + 2], device=device)  # remaps
    fill[:, 0] = torch.tensor([H // 2 + 1, H // 2, H], device=device)      # due, not, due
    before = table.clone()
    rh.rebuild_if_full(table, page_of, fill, backend="triton")
    for layer, due in enumerate((True, False, True)):
        if due:
            assert int(fill[layer, 0]) == int((page_of[layer] >= 0).sum())
            q = torch.cat([page_of[layer], old[layer, :1]])
            assert torch.equal(rh.lookup(table[layer], page_of[layer], q, backend="triton"),
                               expected(page_of[layer], q))
        else:
            assert int(fill[layer, 0]) == H // 2 and torch.equal(table[layer], before[layer])
    assert torch.equal(fill[:, 1], torch.zeros(L, dtype=torch.long, device=device))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("num_slots,n_queries", [(1, 1), (17, 54), (97, 4097)])
def test_lookup_layers_equals_each_layer(device, backend, num_slots, n_queries):
    """lookup_layers over [L, H] tables (one launch) == lookup in each layer: different pages
    per layer, some shared, queries with misses and -1."""
    g = torch.Generator().manual_seed(num_slots + n_queries)
    L, H = 3, rh.table_size(num_slots)
    page_of = torch.full((L, num_slots), -1, dtype=torch.long)
    for layer in range(L):
        k = max(1, num_slots - layer * num_slots // 3)
        page_of[layer, torch.randperm(num_slots, generator=g)[:k]] = \
            torch.randperm(200, generator=g)[:k]
    page_of = page_of.to(device)
    table = torch.empty((L, H), dtype=torch.int32, device=device)
    rh.rebuild(table, page_of, backend=backend)
    q = torch.cat([torch.randint(0, 200, (n_queries - 1,), generator=g),
                   torch.tensor([-1])]).to(device)
    got = rh.lookup_layers(table, page_of, q, backend=backend)
    assert got.shape == (L, n_queries)
    for layer in range(L):
        assert torch.equal(got[layer], expected(page_of[layer], q))
