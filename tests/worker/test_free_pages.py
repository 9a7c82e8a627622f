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
