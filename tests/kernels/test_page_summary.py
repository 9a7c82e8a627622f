"""Page summaries (Quest min/max, ArkVale radius): Triton kernel (compiled on CUDA, interpreted
on CPU) vs ``kernels.ref`` (same device) vs a per-page loop (float64 on the CPU). Token slots past num_tokens hold NaN; padding ids (< 0)
must write nothing; unlisted summary rows must stay untouched."""
import math

import pytest
import torch

from sparseserve.kernels import ref
from sparseserve.kernels import update_page_summaries as dispatch_summaries
from sparseserve.kernels.page_summary import update_page_summaries

from tests.conftest import DEVICE
from tests.kernels import DTYPES, close, to_dev

SENTINEL = 12345.0


def _case(lens, ps, D, gen, pad=3):
    """Pages of requests of the given lengths in a NaN-filled pool, listed in random order with
    padding entries (-1) mixed in. Returns k_cache [P, ps, D], page_ids [N], num_tokens [N]."""
    counts = []
    for L in lens:
        n = math.ceil(L / ps)
        counts += [ps] * (n - 1) + [L - (n - 1) * ps]
    P = len(counts) + 4
    k_cache = torch.full((P, ps, D), float("nan"))
    phys = torch.randperm(P, generator=gen)[: len(counts)]
    for pid, t in zip(phys.tolist(), counts):
        k_cache[pid, :t] = torch.randn(t, D, generator=gen) * 3 + 1
    ids = torch.cat([phys, torch.full((pad,), -1, dtype=torch.long)])
    nt = torch.cat([torch.tensor(counts), torch.full((pad,), 7)])
    order = torch.randperm(len(ids), generator=gen)
    return k_cache, ids[order].to(torch.int32), nt[order].to(torch.int32)


def _loop_reference(k_cache, ids, nt, S, D):
    """kmin, kmax [S, D] at the pages' rows; kradius [N, D] at the entries' rows."""
    kmin = torch.full((S, D), SENTINEL)
    kmax = torch.full((S, D), SENTINEL)
    krad = torch.full((len(ids), D), SENTINEL)
    for i, (pid, t) in enumerate(zip(ids.tolist(), nt.tolist())):
        if pid < 0:
            continue
        k = k_cache[pid, :t].double()
        mn, mx = k.min(0).values, k.max(0).values
        kmin[pid], kmax[pid] = mn.float(), mx.float()
        krad[i] = ((mn + mx) / 2 - k).abs().mean(0).float()
    return kmin, kmax, krad


def _buffers(S, D, N, dtype=torch.float32):
    """kmin, kmax [S, D] and kradius [N, D] on DEVICE, every entry SENTINEL."""
    return [torch.full((rows, D), SENTINEL, dtype=dtype, device=DEVICE) for rows in (S, S, N)]


@pytest.mark.parametrize("ps,D", [(32, 64), (16, 128), (32, 128), (16, 64)])
def test_summaries_odd_lengths(ps, D):
    gen = torch.Generator().manual_seed(ps + D)
    lens = [1, 17, 54, 97, 4097] if (ps, D) == (32, 64) else [1, 17, 54, 97]
    k_cache, ids, nt = _case(lens, ps, D, gen)
    S = k_cache.shape[0] + 2                      # summary table may be larger than the pool
    expect = _loop_reference(k_cache, ids, nt, S, D)
    k_cache, ids, nt = to_dev(k_cache, ids, nt)
    for fn in (update_page_summaries, ref.update_page_summaries):
        kmin, kmax, krad = _buffers(S, D, len(ids))
        fn(k_cache, ids, nt, kmin, kmax, krad)
        for got, exp in zip((kmin, kmax, krad), expect):
            close(got, exp)


def test_summaries_without_radius_and_dispatch():
    gen = torch.Generator().manual_seed(9)
    k_cache, ids, nt = _case([54, 17], 16, 64, gen)
    S = k_cache.shape[0]
    exp_min, exp_max, _ = _loop_reference(k_cache, ids, nt, S, 64)
    k_cache, ids, nt = to_dev(k_cache, ids, nt)
    for kwargs in ({}, {"backend": "triton"}, {"backend": "torch"}):
        kmin, kmax, _ = _buffers(S, 64, len(ids))
        dispatch_summaries(k_cache, ids, nt, kmin, kmax, None, **kwargs)
        close(kmin, exp_min)
        close(kmax, exp_max)


def test_summaries_all_padding_writes_nothing():
    k_cache = torch.randn(4, 16, 64, device=DEVICE)
    ids = torch.full((5,), -1, dtype=torch.int32, device=DEVICE)
    nt = torch.full((5,), 16, dtype=torch.int32, device=DEVICE)
    kmin, kmax, krad = _buffers(4, 64, 5)
    update_page_summaries(k_cache, ids, nt, kmin, kmax, krad)
    for t in (kmin, kmax, krad):
        assert (t == SENTINEL).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_summaries_dtypes(dtype):
    """fp32 / fp16 / bf16 caches and summaries: the kernel equals the reference on the same
    rounded keys (min / max exactly, the radius within TOL of the dtype)."""
    gen = torch.Generator().manual_seed(2)
    lens = [1, 17, 54, 97, 4097] if DEVICE.type == "cuda" else [1, 17, 54, 97]
    k_cache, ids, nt = _case(lens, 32, 128, gen)
    S = k_cache.shape[0]
    kc, ids, nt = to_dev(k_cache.to(dtype), ids, nt)
    got, want = _buffers(S, 128, len(ids), dtype), _buffers(S, 128, len(ids), dtype)
    update_page_summaries(kc, ids, nt, *got)
    ref.update_page_summaries(kc, ids, nt, *want)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    close(got[2], want[2], dtype)
    exp = _loop_reference(kc.cpu().float(), ids.cpu(), nt.cpu(), S, 128)
    for g, e in zip(got, exp):
        close(g, e.to(dtype), dtype)


def _two_step_box(fn, kc, ids, nt, kmin, kmax):
    """ArkVale's box the way it was written before `box` existed: min / max / radius into the
    summary dtype, then c -/+ r in fp32 at the listed pages' rows."""
    krad = torch.zeros((len(ids), kmin.shape[1]), dtype=kmin.dtype, device=kmin.device)
    fn(kc, ids, nt, kmin, kmax, krad)
    keep = ids >= 0
    rows = ids[keep].long()
    c = (kmin[rows].float() + kmax[rows].float()) * 0.5
    r = krad[keep].float()
    kmin[rows] = (c - r).to(kmin.dtype)
    kmax[rows] = (c + r).to(kmax.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ps,D", [(32, 128), (16, 64)])
def test_box_equals_two_step_form(dtype, ps, D):
    """`box=True` (one launch) writes the box of min / max / radius followed by the torch
    epilogue, at odd page fills (1, 17, 54, 97 tokens; 4097 on a GPU): bit for bit in the
    reference, and in the compiled kernel against its own two-step form; against the
    reference within the dtype's tolerance (the radius sums in another order; the
    interpreter's own fp32 -> bf16 casts truncate, which the box path avoids by rounding to
    nearest even itself). Padding entries and unlisted rows stay untouched."""
    gen = torch.Generator().manual_seed(ps * D)
    lens = [1, 17, 54, 97, 4097] if DEVICE.type == "cuda" else [1, 17, 54, 97]
    k_cache, ids, nt = _case(lens, ps, D, gen)
    S = k_cache.shape[0] + 1
    kc, ids, nt = to_dev(k_cache.to(dtype), ids, nt)
    listed = torch.zeros(S, dtype=torch.bool, device=DEVICE)
    listed[ids[ids >= 0].long()] = True
    boxes = {}
    for fn in (ref.update_page_summaries, update_page_summaries):
        got = _buffers(S, D, 0, dtype)[:2]
        fn(kc, ids, nt, *got, box=True)
        boxes[fn] = got
        assert (got[0][~listed] == SENTINEL).all() and (got[1][~listed] == SENTINEL).all()
        assert (got[0][listed] <= got[1][listed]).all()
        if fn is ref.update_page_summaries or DEVICE.type == "cuda":
            want = _buffers(S, D, 0, dtype)[:2]
            _two_step_box(fn, kc, ids, nt, *want)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), fn
    for g, w in zip(boxes[update_page_summaries], boxes[ref.update_page_summaries]):
        close(g, w, dtype)
    with pytest.raises(AssertionError, match="no radius buffer"):
        update_page_summaries(kc, ids, nt, *_buffers(S, D, len(ids), dtype), box=True)


@pytest.mark.parametrize("box", [False, True])
def test_write_ids_move_rows(box):
    """`write_ids`: entry i's summary lands at row write_ids[i] (a page read in its device slot,
    summarised at its host id), exactly what the page's own row gets without it; padding
    entries write nothing; every other row stays untouched. Kernel and reference."""
    gen = torch.Generator().manual_seed(5 + box)
    k_cache, ids, nt = _case([1, 17, 54, 97], 16, 64, gen)
    S = 3 * k_cache.shape[0]
    out = torch.randperm(S, generator=gen)[:len(ids)].to(torch.int64)  # unique host rows
    kc, ids, nt, out = to_dev(k_cache, ids, nt, out)
    live = ids >= 0
    for fn in (update_page_summaries, ref.update_page_summaries):
        own = _buffers(S, 64, 0)[:2]
        fn(kc, ids, nt, *own, box=box)
        moved = _buffers(S, 64, 0)[:2]
        fn(kc, ids, nt, *moved, box=box, write_ids=out)
        for o, m in zip(own, moved):
            assert torch.equal(m[out[live]], o[ids[live].long()]), fn
            untouched = torch.ones(S, dtype=torch.bool, device=DEVICE)
            untouched[out[live]] = False
            assert (m[untouched] == SENTINEL).all()
