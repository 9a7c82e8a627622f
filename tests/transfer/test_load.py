"""Loading host pages into device slots: FlashH2D (Triton; the interpreter on CPU), its torch
path and the per-page memcpy baseline, against a reference built page by page. Bit-exact;
masked entries (src < 0) leave their slots untouched."""
import numpy as np
import pytest
import torch

from sparseserve.transfer import PageLoader, load_pages
from sparseserve.transfer.flash_h2d import flash_load_pages

from . import DEV, PIN, filled, host_tier, random_bits, same_bits, sync

METHODS = [("flash", "triton"), ("flash", "torch"), ("memcpy", None)]
SENTINEL = 0x5A5A


def _case(N, ps, D, dtype, seed, masked_frac=0.25, idx_dtype=torch.int64):
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    P, S = N + 13, N + 7
    hk, hv = host_tier(P, ps, D, dtype, gen)
    dk = filled((S, ps, D), dtype, SENTINEL, DEV)
    dv = filled((S, ps, D), dtype, SENTINEL, DEV)
    src = rng.permutation(P)[:N]
    src[rng.random(N) < masked_frac] = -1
    dst = rng.permutation(S)[:N]
    return (hk, hv, dk, dv, torch.tensor(src, dtype=idx_dtype, device=DEV),
            torch.tensor(dst, dtype=idx_dtype, device=DEV))


def _expected(hk, hv, dk, dv, src, dst):
    ek, ev = dk.cpu().clone(), dv.cpu().clone()
    for s, d in zip(src.tolist(), dst.tolist()):
        if s >= 0:
            ek[d], ev[d] = hk[s], hv[s]
    return ek, ev


@pytest.mark.parametrize("method,backend", METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ps", [16, 32])
@pytest.mark.parametrize("N", [1, 17, 54, 97])
def test_load_pages_exact(method, backend, dtype, ps, N):
    hk, hv, dk, dv, src, dst = _case(N, ps, 32, dtype, seed=N * 100 + ps)
    ek, ev = _expected(hk, hv, dk, dv, src, dst)
    load_pages(hk, hv, dk, dv, src, dst, method, backend=backend)
    sync()
    assert same_bits(dk, ek) and same_bits(dv, ev)


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_flash_index_dtypes_and_odd_pages(idx_dtype):
    # page of 16 x 24 elements (not a power of two: masked tail), several loop iterations
    hk, hv, dk, dv, src, dst = _case(23, 16, 24, torch.bfloat16, seed=3, idx_dtype=idx_dtype)
    ek, ev = _expected(hk, hv, dk, dv, src, dst)
    flash_load_pages(hk, hv, dk, dv, src, dst, block_bytes=256)
    sync()
    assert same_bits(dk, ek) and same_bits(dv, ev)


def test_flash_layer_slices_of_bigger_tensors():
    """Tiers that are one layer of a [L, P, ps, D] tensor (page stride free)."""
    gen = torch.Generator().manual_seed(5)
    host = random_bits((3, 2, 20, 16, 32), torch.bfloat16, gen, pin=PIN)   # [L, K/V, P, ps, D]
    dev = filled((3, 2, 9, 16, 32), torch.bfloat16, SENTINEL, DEV)
    hk, hv, dk, dv = host[1, 0], host[1, 1], dev[1, 0], dev[1, 1]
    src = torch.tensor([4, -1, 19, 0, 7], device=DEV)
    dst = torch.tensor([8, 0, 1, 2, 5], device=DEV)
    before = dev.cpu().clone()
    ek, ev = _expected(hk, hv, dk, dv, src, dst)
    flash_load_pages(hk, hv, dk, dv, src, dst)
    sync()
    assert same_bits(dk, ek) and same_bits(dv, ev)
    before[1, 0], before[1, 1] = ek, ev
    assert same_bits(dev, before)           # other layers untouched


@pytest.mark.parametrize("method,backend", METHODS)
def test_all_masked_and_empty(method, backend):
    hk, hv, dk, dv, src, dst = _case(9, 16, 32, torch.float32, seed=7, masked_frac=1.0)
    before = dk.cpu().clone(), dv.cpu().clone()
    load_pages(hk, hv, dk, dv, src, dst, method, backend=backend)
    load_pages(hk, hv, dk, dv, src[:0], dst[:0], method, backend=backend)
    sync()
    assert same_bits(dk, before[0]) and same_bits(dv, before[1])


@pytest.mark.parametrize("method,backend", METHODS)
def test_page_loader_counters(method, backend):
    loader = PageLoader(method, backend=backend)
    total = 0
    for seed in (1, 2):
        hk, hv, dk, dv, src, dst = _case(17, 16, 32, torch.bfloat16, seed=seed)
        loader.load(hk, hv, dk, dv, src, dst)
        total += int((src >= 0).sum())
    st = loader.stats()
    assert (st.calls, st.pages, st.bytes) == (2, total, total * 2 * 16 * 32 * 2)
    loader.reset()
    assert loader.stats().pages == 0


@pytest.mark.parametrize("max_programs", [1, 3, 16])
def test_flash_grid_narrower_than_the_list(max_programs):
    """Each program loops over every max_programs-th entry (the capped grid of decode steps'
    long, mostly-hit lists): the slots and the counters equal one program per entry's."""
    hk, hv, dk, dv, src, dst = _case(54, 16, 32, torch.bfloat16, seed=max_programs)
    ek, ev = _expected(hk, hv, dk, dv, src, dst)
    counter = torch.zeros(2, dtype=torch.int64, device=DEV)
    flash_load_pages(hk, hv, dk, dv, src, dst, counter, max_programs=max_programs)
    sync()
    assert same_bits(dk, ek) and same_bits(dv, ev)
    live = int((src >= 0).sum())
    assert 0 < live < 54
    assert counter.tolist() == [live, live * 2 * 16 * 32 * 2]
    with pytest.raises(ValueError, match="max_programs"):
        flash_load_pages(hk, hv, dk, dv, src, dst, max_programs=0)


def test_bad_arguments():
    hk, hv, dk, dv, src, dst = _case(5, 16, 32, torch.float32, seed=1)
    with pytest.raises(ValueError):
        load_pages(hk, hv, dk, dv, src, dst[:3], "flash", backend="triton")
    with pytest.raises(ValueError):
        load_pages(hk, hv, dk[:, :8], dv[:, :8], src, dst, "flash")
    with pytest.raises(ValueError):
        load_pages(hk, hv, dk.to(torch.float16), dv.to(torch.float16), src, dst, "memcpy")
    with pytest.raises(ValueError):
        load_pages(hk, hv, dk, dv, src, dst, "dma")


@pytest.mark.parametrize("method,backend", METHODS)
@pytest.mark.parametrize("N,live", [(1, 0), (17, 1), (97, 54), (97, 97), (4097, 4096)])
def test_load_pages_num_live_reads_only_the_compacted_prefix(method, backend, N, live):
    """Compacted lists (retrieve's loads): entries past num_live[0] are never read, even if
    they hold valid ids; the kernel's fixed grid loops over the live prefix."""
    hk, hv, dk, dv, src, dst = _case(N, 16, 32, torch.bfloat16, seed=N + live, masked_frac=0.1)
    ek, ev = _expected(hk, hv, dk, dv, src[:live], dst[:live])
    num_live = torch.tensor([live], dtype=torch.int32, device=DEV)
    load_pages(hk, hv, dk, dv, src, dst, method, backend=backend, num_live=num_live)
    sync()
    assert same_bits(dk, ek) and same_bits(dv, ev)
