"""TwoTierCache.free_pages (worker/offload_cache.py): freeing a finished request's pages never
blocks the host on saves that complete in stream order (GPU-direct, per-page copies) — it
fences them on the device instead — while FlashD2H, whose CPU scatter completes only on the
host, still waits. Either way the pages leave the device tier and the working-set stamps."""
import numpy as np
import pytest
import torch

from sparseserve.config import CacheConfig
from sparseserve.worker.offload_cache import TwoTierCache

L, D, PS, SLOTS, HOST, ROWS = 2, 4, 2, 6, 63, 2


@pytest.mark.parametrize("d2h,host_waits", [("gpu-direct", False), ("memcpy", False),
                                            ("flash", True), ("copy-engine", False)])
def test_free_pages_waits_on_the_host_only_for_host_completed_saves(d2h, host_waits):
    cfg = CacheConfig(page_size=PS, num_pages=SLOTS, kv_offload=True, num_host_pages=HOST,
                      d2h_method=d2h)
    c = TwoTierCache(cfg, L, D, ROWS, torch.float32, torch.device("cpu"))
    c.attach_device_tier([torch.zeros(SLOTS + 1, PS, D) for _ in range(L)],
                         [torch.zeros(SLOTS + 1, PS, D) for _ in range(L)])
    calls = {"host": 0, "device": 0}
    real_wait_all = c.saver.wait_all
    c.saver.wait_all = lambda: (calls.__setitem__("host", calls["host"] + 1), real_wait_all())
    if hasattr(c.saver, "device_fence"):
        real_fence = c.saver.device_fence
        c.saver.device_fence = lambda: (calls.__setitem__("device", calls["device"] + 1),
                                        real_fence())
    c.stamps.assign(torch.tensor([0]), torch.tensor([0]))
    c.begin_step()
    pages = torch.tensor([[[1, 2, 3]]], dtype=torch.int32).expand(1, 1, 3).contiguous()
    for layer in range(L):
        c.retrieve(layer, pages, torch.tensor([[3]], dtype=torch.int32), torch.tensor([0]))
    assert int((c.page_of[:, :-1] >= 0).sum()) == 3 * L
    c.free_pages(np.arange(0, 16))
    assert calls == ({"host": 1, "device": 0} if host_waits else {"host": 0, "device": 1})
    assert int((c.page_of[:, :-1] >= 0).sum()) == 0
    assert int((c.stamps.last_selected[:, :16] >= 0).sum()) == 0
    c.close()


def test_free_pages_clears_only_the_freed_pages_in_every_layer():
    """Two requests resident in both layers; freeing one's pages (and ids never resident)
    unmaps exactly those in every layer — reverse map, access ages, owners, index — and the
    other request's pages are still found where they were."""
    cfg = CacheConfig(page_size=PS, num_pages=SLOTS, kv_offload=True, num_host_pages=HOST,
                      d2h_method="gpu-direct")
    c = TwoTierCache(cfg, L, D, ROWS, torch.float32, torch.device("cpu"))
    c.attach_device_tier([torch.zeros(SLOTS + 1, PS, D) for _ in range(L)],
                         [torch.zeros(SLOTS + 1, PS, D) for _ in range(L)])
    c.begin_step()
    pages = torch.tensor([[[1, 2, 3]], [[40, 41, 42]]], dtype=torch.int32)
    for layer in range(L):
        c.retrieve(layer, pages, torch.tensor([[3], [3]], dtype=torch.int32),
                   torch.tensor([0, 1]))
    kept = torch.tensor([40, 41, 42])
    where = [c.slot_of(layer, kept) for layer in range(L)]
    assert all(bool((w >= 0).all()) for w in where)
    c.free_pages(np.array([1, 2, 3, 17, 62]))
    for layer in range(L):
        assert torch.equal(c.slot_of(layer, torch.tensor([1, 2, 3, 17, 62])),
                           torch.full((5,), -1))
        assert torch.equal(c.slot_of(layer, kept), where[layer])
        live = c.page_of[layer, :-1] >= 0
        assert sorted(c.page_of[layer, :-1][live].tolist()) == [40, 41, 42]
        freed = ~live
        assert bool((c.last_access[layer, :-1][freed] == -1).all())
        assert bool((c.owner[layer, :-1][freed] == c.scratch_row).all())
        assert int(c.res_fill[layer, 0]) == 3
    c.close()
