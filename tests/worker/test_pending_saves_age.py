"""TwoTierCache's pending-save marks (worker/offload_cache.py): slots a prefill step marks
pending stay unevictable through the next step and become ordinary slots, aged out of the
working-set window, at the begin_step two steps later — and only then: decode-only steps
(no marks) leave every slot's last access untouched (begin_step skips its pass over the slots)."""
import torch

from sparseserve.config import CacheConfig
from sparseserve.worker.offload_cache import PENDING_SAVE, TwoTierCache

L, D, PS, SLOTS, HOST, ROWS = 2, 4, 2, 6, 63, 2


def _cache() -> TwoTierCache:
    cfg = CacheConfig(page_size=PS, num_pages=SLOTS, kv_offload=True, num_host_pages=HOST,
                      d2h_method="gpu-direct")
    c = TwoTierCache(cfg, L, D, ROWS, torch.float32, torch.device("cpu"))
    c.attach_device_tier([torch.zeros(SLOTS + 1, PS, D) for _ in range(L)],
                         [torch.zeros(SLOTS + 1, PS, D) for _ in range(L)])
    return c


def test_marks_age_two_steps_later_and_only_then():
    c = _cache()
    try:
        for _ in range(20):  # steps whose age is past the window
            c.begin_step()
        slots = torch.tensor([1, 4])
        for layer in range(L):
            c.last_access[layer, 2] = int(c.step) - 1  # an ordinary slot, used last step
            c.mark_saved(layer, slots)
        marked_at = int(c.step)
        assert (c.last_access[:, slots] == PENDING_SAVE + c._host_step % 2).all()
        before = c.last_access.clone()
        c.begin_step()  # s + 1: the marks stay (their saves may be in flight)
        assert torch.equal(c.last_access, before)
        c.begin_step()  # s + 2: aged out of the window, the other slots untouched
        assert (c.last_access[:, slots] == max(0, marked_at + 2 - c.window)).all()
        assert (c.last_access[:, 2] == marked_at - 1).all()
        after = c.last_access.clone()
        for _ in range(5):  # decode-only steps: nothing pending, nothing rewritten
            c.begin_step()
        assert torch.equal(c.last_access, after)
    finally:
        c.close()


def test_retrieve_mark_pending_fused_equals_torch_then_mark():
    """retrieve(mark_pending=True): the fused kernels write the pending mark themselves (no
    mark launch) — the same slots, last access, page map and owners as the torch retrieve
    followed by mark_saved; hits (an earlier step's pages) and misses (new pages, some fresh)
    alike, 17 entries over 3 heads and rows of 1 and 17 pages."""
    import numpy as np
    states = []
    for fused in (True, False):
        cfg = CacheConfig(page_size=PS, num_pages=64, kv_offload=True, num_host_pages=HOST,
                          d2h_method="gpu-direct")
        c = TwoTierCache(cfg, L, D, ROWS, torch.float32, torch.device("cpu"))
        c.attach_device_tier([torch.zeros(65, PS, D) for _ in range(L)],
                             [torch.zeros(65, PS, D) for _ in range(L)])
        c.fused = fused
        try:
            outs = []
            for step, (n, fresh) in enumerate([(1, 0), (17, 1)]):
                c.begin_step()
                pages = torch.from_numpy(np.arange(3 * n).reshape(1, 3, n)).int()
                num = torch.full((1, 3), n, dtype=torch.int32)
                ff = torch.full((1, 3), fresh, dtype=torch.int32)
                for layer in range(L):
                    s = c.retrieve(layer, pages, num, torch.tensor([1]), fresh_from=ff,
                                   prefill=True, mark_pending=True)
                    outs.append(s.long())
            assert (c.last_access[:, -1] == -1).all()
            states.append((outs, c.last_access.clone(), c.page_of.clone(), c.owner.clone(),
                           set(c._marked_steps)))
        finally:
            c.close()
    (o1, *r1), (o2, *r2) = states
    assert all(torch.equal(a, b) for a, b in zip(o1, o2))
    assert torch.equal(r1[0], r2[0]) and torch.equal(r1[1], r2[1]) and torch.equal(r1[2], r2[2])
    assert r1[3] == r2[3]
