"""Residency index kernels on the GPU: compiled Triton == torch path at a realistic slot
count, and rebuild + lookup replay correctly inside a CUDA graph."""
import pytest
import torch

from sparseserve.kernels import residency_hash as rh

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def random_map(num_slots, g):
    page_of = torch.full((num_slots,), -1, dtype=torch.long)
    mapped = torch.rand(num_slots, generator=g) < 0.9
    page_of[mapped] = torch.randperm(10 * num_slots, generator=g)[:int(mapped.sum())]
    return page_of.cuda()


def test_compiled_kernels_match_torch():
    g = torch.Generator().manual_seed(0)
    page_of = random_map(100_003, g)
    table = torch.empty(rh.table_size(page_of.numel()), dtype=torch.int32, device="cuda")
    rh.rebuild(table, page_of)
    q = torch.randint(-1, 10 * 100_003, (50_000,), generator=g).cuda()
    q = torch.cat([q, page_of])
    ref_table = table.cpu().clone()
    rh.rebuild(ref_table, page_of.cpu(), backend="torch")
    assert torch.equal(rh.lookup(table, page_of, q).cpu(),
                       rh.lookup(ref_table, page_of.cpu(), q.cpu(), backend="torch"))


def test_graph_replay_sees_remapped_slots():
    g = torch.Generator().manual_seed(1)
    page_of = random_map(4097, g)
    table = torch.empty(rh.table_size(4097), dtype=torch.int32, device="cuda")
    q = torch.arange(-1, 10 * 4097, device="cuda")
    rh.rebuild(table, page_of)
    rh.lookup(table, page_of, q)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rh.rebuild(table, page_of)
        out = rh.lookup(table, page_of, q)
    for _ in range(3):
        page_of.copy_(random_map(4097, g))
        graph.replay()
        ref = torch.empty(rh.table_size(4097), dtype=torch.int32)
        rh.rebuild(ref, page_of.cpu(), backend="torch")
        assert torch.equal(out.cpu(), rh.lookup(ref, page_of.cpu(), q.cpu(), backend="torch"))
