"""The copy-engine saver's run list and step plans: `dest_runs` against a brute-force mapping,
`dest_blocks` (strided blocks of equal runs) against the runs they group, one plan reused by
every layer of a step == per-layer arguments, k/v given as strided views of a fused qkv
buffer, the run and block counts of a prefill chunk in chunk-allocated host pages, and the
bytes a partial-chunk step lands through strided copies."""
import numpy as np
import pytest
import torch

from sparseserve.transfer import make_save_plan, make_saver
from sparseserve.transfer.save_plan import dest_blocks, dest_runs

from . import DEV, PIN, filled, random_bits, same_bits

SENTINEL = 0x3C3C


@pytest.mark.parametrize("seed", range(20))
def test_dest_runs_brute_force(seed):
    """Staging row i is new[t[i], h[i]] and lands at host row runs' dst + (i - src): every
    live (t, h) exactly once, at page * ps + offset, runs maximal and in address order."""
    rng = np.random.default_rng(seed)
    T, H, ps, P = int(rng.integers(1, 60)), int(rng.integers(1, 4)), int(rng.choice([4, 16])), 60
    # distinct destinations, some dead rows: a random injective map of (t, h) to host rows,
    # or (odd seeds) each head's tokens back to back after the previous head's (long runs)
    if seed % 2:
        rows = (np.arange(T * H).reshape(H, T).T + int(rng.integers(0, ps))) % (P * ps)
    else:
        rows = rng.permutation(P * ps)[:T * H].reshape(T, H)
    pages, offs = rows // ps, rows % ps
    pages[rng.random((T, H)) < 0.2] = -1
    plan = make_save_plan(pages, offs, P, ps)
    t, h, runs = dest_runs(plan, ps)
    dst_of = np.full(len(t), -1)
    for dst, src, n in runs:
        assert n > 0
        dst_of[src:src + n] = np.arange(dst, dst + n)
    assert (dst_of >= 0).all()
    want = {(a, b): pages[a, b] * ps + offs[a, b] for a in range(T) for b in range(H)
            if pages[a, b] >= 0}
    got = {(int(a), int(b)): int(d) for a, b, d in zip(t, h, dst_of)}
    assert got == want
    assert (np.diff(dst_of) > 0).all()                                # address order
    ends = runs[:, 0] + runs[:, 2]
    assert (runs[1:, 0] != ends[:-1]).all()                           # maximal runs


def test_prefill_chunk_runs_in_chunk_allocated_pages():
    """Chunk-allocated pages (C consecutive ids per head; a request's heads take adjacent
    chunks, one row of heads per allocation): a 2048-token chunk of 8 heads is one run per
    row of heads when other requests' rows sit between them, one run when nothing does.
    Starting mid-page (5 tokens in), the first and last rows of heads hold partial pages:
    one run per head there (8 + 3 + 8; 7 + 1 + 7 when the rows are adjacent)."""
    T, H, ps, C = 2048, 8, 32, 16
    for start in (0, 5):
        blk = (start + np.arange(T)) // ps
        for bases, want in (([3, 0, 7, 5, 9], 19 if start else 4),
                            ([0, 1, 2, 3, 4], 15 if start else 1)):
            base = np.asarray(bases)[blk // C]                # the row of heads' allocation
            pages = (base[:, None] * H + np.arange(H)[None, :]) * C + (blk % C)[:, None]
            plan = make_save_plan(pages, (start + np.arange(T)) % ps, int(pages.max()) + 1, ps)
            assert len(dest_runs(plan, ps)[2]) == want, (start, bases)
            assert plan.rows == T * H


def _chunked_pages(T, H, ps, C, start, bases):
    """Pages and offsets of a T-token step of H heads from token `start` on, in host pages
    handed out C per (request, head), rows of heads taken from allocations `bases`."""
    blk = (start + np.arange(T)) // ps
    base = np.asarray(bases)[blk // C]
    pages = (base[:, None] * H + np.arange(H)[None, :]) * C + (blk % C)[:, None]
    return pages, (start + np.arange(T)) % ps


@pytest.mark.parametrize("seed", range(20))
def test_dest_blocks_cover_the_runs(seed):
    """Each block's runs are runs of dest_runs, in order, equally long and `pitch` apart;
    blocks are maximal (neighbours could not join); random and chunk-shaped steps."""
    rng = np.random.default_rng(seed)
    ps, H = 16, int(rng.integers(1, 9))
    if seed % 2:
        T, C = int(rng.integers(1, 700)), int(rng.choice([1, 4]))
        pages, offs = _chunked_pages(T, H, ps, C, int(rng.integers(0, 100)),
                                     rng.permutation(64))
    else:
        T = int(rng.integers(1, 60))
        rows = rng.permutation(80 * ps)[:T * H].reshape(T, H)
        pages, offs = rows // ps, rows % ps
    plan = make_save_plan(pages, offs, int(pages.max()) + 1, ps)
    t, h, runs = dest_runs(plan, ps)
    tb, hb, blocks = dest_blocks(plan, ps)
    assert (tb == t).all() and (hb == h).all()
    expanded = [(dst + i * pitch, src + i * n, n) for dst, pitch, src, n, height in blocks
                for i in range(height)]
    assert expanded == [tuple(r) for r in runs.tolist()]
    for (d0, p0, s0, n0, h0), (d1, p1, s1, n1, h1) in zip(blocks[:-1], blocks[1:]):
        last = d0 + (h0 - 1) * p0
        assert not (n0 == n1 and (h0 == 1 or d1 - last == p0)
                    and (h1 == 1 or p1 == d1 - last)), "blocks not maximal"


def test_partial_chunk_step_is_a_few_blocks():
    """The fourteenth session's LWM-7B case: a 1,918-token step of 32 heads in chunk-allocated
    pages (16 pages per chunk) is 32 runs per layer — the partial chunk is one run per head,
    the first joined to the whole chunks before it — and 2 blocks; starting mid-chunk too,
    63 runs and 3 blocks."""
    T, H, ps, C = 1918, 32, 32, 16
    for start, want_runs, want_blocks in ((0, 32, 2), (100, 63, 3)):
        pages, offs = _chunked_pages(T, H, ps, C, start, list(range(8)))
        plan = make_save_plan(pages, offs, int(pages.max()) + 1, ps)
        assert len(dest_runs(plan, ps)[2]) == want_runs
        assert len(dest_blocks(plan, ps)[2]) == want_blocks


@pytest.mark.parametrize("T,start", [(1, 0), (17, 5), (97, 40), (300, 13)])
def test_strided_blocks_land_the_bytes(T, start):
    """A step starting and ending inside chunks (blocks of height > 1) saves every row to its
    page and offset, touches nothing else, and goes through the copies (no fallback)."""
    H, D, ps, C = 4, 32, 16, 4
    dtype = torch.bfloat16
    pages, offs = _chunked_pages(T, H, ps, C, start, [2, 0, 5, 1, 3, 4, 6])
    P = int(pages.max()) + 3
    gen = torch.Generator().manual_seed(T)
    k = random_bits((T, H, D), dtype, gen, DEV)
    v = random_bits((T, H, D), dtype, gen, DEV)
    hk = [filled((P, ps, D), dtype, SENTINEL, pin=PIN)]
    hv = [filled((P, ps, D), dtype, SENTINEL, pin=PIN)]
    plan = make_save_plan(pages, offs, P, ps)
    assert T < ps * C or (dest_blocks(plan, ps)[2][:, 4] > 1).any()
    if DEV == "cuda":  # the strided copies are the runtime's, not the per-run fallback
        from sparseserve.transfer.memcpy2d import cuda_2d_available
        assert cuda_2d_available()
    with make_saver("copy-engine", hk, hv) as saver:
        saver.wait(saver.save(0, k, v, plan))
        assert saver.fallback_saves == 0
    written = np.zeros((P, ps), bool)
    kc, vc = k.cpu(), v.cpu()
    for a in range(T):
        for b in range(H):
            p, o = pages[a, b], offs[a]
            written[p, o] = True
            assert same_bits(hk[0][p, o], kc[a, b]) and same_bits(hv[0][p, o], vc[a, b])
    untouched = torch.from_numpy(~written)
    assert same_bits(hk[0][untouched], filled((int(untouched.sum()), D), dtype, SENTINEL))
    assert same_bits(hv[0][untouched], filled((int(untouched.sum()), D), dtype, SENTINEL))


@pytest.mark.parametrize("T", [1, 17, 97])
def test_one_plan_for_every_layer_and_strided_views(T):
    """A step's plan passed to each layer's save writes what per-layer arrays write, from
    k/v that are column slices of one qkv buffer (not contiguous)."""
    H, D, ps, P, L = 2, 32, 16, 24, 3
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(T)
    rows = np.arange(T * H).reshape(H, T).T + 3      # each head's tokens back to back: few runs
    pages, offs = rows // ps, rows % ps
    pages[0, -1] = -1
    out = {}
    for mode in ("plan", "arrays"):
        hk = [filled((P, ps, D), dtype, SENTINEL, pin=PIN) for _ in range(L)]
        hv = [filled((P, ps, D), dtype, SENTINEL, pin=PIN) for _ in range(L)]
        gen.manual_seed(T)
        with make_saver("copy-engine", hk, hv) as saver:
            plan = make_save_plan(pages, offs, P, ps)
            for layer in range(L):
                qkv = random_bits((T, 3 * H, D), dtype, gen, DEV)
                k, v = qkv[:, H:2 * H], qkv[:, 2 * H:]
                assert T == 1 or not k.is_contiguous()
                if mode == "plan":
                    saver.save(layer, k, v, plan)
                else:
                    saver.save(layer, k, v, pages, offs)
                for a in range(T):
                    for b in range(H):
                        if pages[a, b] >= 0:
                            out.setdefault((mode, layer), []).append(
                                (int(pages[a, b]), int(offs[a, b]), k[a, b].cpu(),
                                 v[a, b].cpu()))
            saver.wait_all()
            assert saver.stats().calls == L and saver.fallback_saves == 0
        for layer in range(L):
            for p, o, kr, vr in out[(mode, layer)]:
                assert same_bits(hk[layer][p, o], kr) and same_bits(hv[layer][p, o], vr)
    assert all(len(out[("plan", i)]) == len(out[("arrays", i)]) == 2 * T - 1 for i in range(L))


def test_plan_shape_must_match():
    H, D, ps, P = 2, 16, 8, 6
    hk = [torch.zeros(P, ps, D, pin_memory=PIN)]
    with make_saver("copy-engine", hk, [torch.zeros_like(hk[0])]) as saver:
        plan = make_save_plan(np.zeros((3, H), np.int64), np.arange(3), P, ps)
        k = torch.zeros(2, H, D, device=DEV)
        with pytest.raises(ValueError, match="save plan"):
            saver.save(0, k, k, plan)


def test_fragmented_step_falls_back_to_gpu_direct():
    """More runs than max_runs: the layer is written GPU-direct, the same bytes land."""
    H, D, ps, P, T = 2, 16, 8, 40, 30
    dtype = torch.float32
    rng = np.random.default_rng(3)
    rows = rng.permutation(P * ps)[:T * H].reshape(T, H)
    pages, offs = rows // ps, rows % ps
    gen = torch.Generator().manual_seed(0)
    k = random_bits((T, H, D), dtype, gen, DEV)
    v = random_bits((T, H, D), dtype, gen, DEV)
    hk = [filled((P, ps, D), dtype, SENTINEL, pin=PIN)]
    hv = [filled((P, ps, D), dtype, SENTINEL, pin=PIN)]
    with make_saver("copy-engine", hk, hv, max_runs=4) as saver:
        saver.wait(saver.save(0, k, v, pages, offs))
        assert saver.fallback_saves == 1
    kc, vc = k.cpu(), v.cpu()
    for a in range(T):
        for b in range(H):
            assert same_bits(hk[0][pages[a, b], offs[a, b]], kc[a, b])
            assert same_bits(hv[0][pages[a, b], offs[a, b]], vc[a, b])
