"""Paged prefill attention (chunks continuing a prefix, K/V read from the pages): the Triton
kernel (compiled on CUDA, interpreted on CPU) against explicit float64 causal softmax attention
over each sequence's unpaged K/V. Physical pages are a random permutation, token slots past a
sequence's end and unused pages hold NaN, page-table entries past a sequence's pages hold
garbage — none of which may reach the output."""
import numpy as np
import pytest
import torch

from sparseserve.kernels.paged_prefill import (METADATA, block_tokens, paged_prefill_attention,
                                               plan_blocks, plan_metadata)

from tests.conftest import DEVICE
from tests.kernels import TOL, to_dev
from tests.kernels.test_paged_decode import _paged


def _pool(totals, Hkv, D, ps, gen, dtype):
    """Sequences of `totals` tokens per KV head in a NaN pool of permuted pages, garbage past
    each sequence's entries (test_paged_decode's harness) -> (dense K/V per sequence [Hkv, L,
    D] on the CPU, k_cache, v_cache [P, ps, D], table [S, Hkv, W] int32)."""
    return _paged(totals, Hkv, D, ps, gen, dtype)[:5]


def _reference(q, ks, vs, lens, starts, scale):
    """float64 causal attention: query i of chunk s (position starts[s] + i) over keys 0..p."""
    q = q.double().cpu()
    Hq = q.shape[1]
    out, off = [], 0
    for k, v, n, a in zip(ks, vs, lens, starts):
        G = Hq // k.shape[0]
        kk = k.double().repeat_interleave(G, 0)  # [Hq, L, D]
        vv = v.double().repeat_interleave(G, 0)
        qs = q[off:off + n].transpose(0, 1)      # [Hq, n, D]
        s = qs @ kk[:, :a + n].transpose(1, 2) * scale
        pos = torch.arange(a, a + n)[:, None]
        s = s.masked_fill(torch.arange(a + n)[None, :] > pos, float("-inf"))
        out.append((torch.softmax(s, -1) @ vv[:, :a + n]).transpose(0, 1))
        off += n
    return torch.cat(out)


def _run(lens, starts, Hq, Hkv, D=32, ps=16, dtype=torch.float32, block_m=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    totals = [a + n for a, n in zip(starts, lens)]
    ks, vs, kc, vc, table = _pool(totals, Hkv, D, ps, gen, dtype)
    q = torch.randn(sum(lens), Hq, D, generator=gen).to(dtype)
    meta = {k: torch.from_numpy(v) for k, v in plan_metadata(lens, starts, block_m).items()}
    scale = D ** -0.5
    got = paged_prefill_attention(*to_dev(q, kc, vc, table),
                                  *to_dev(*[meta[k] for k in METADATA]), scale, block_m)
    want = _reference(q, ks, vs, lens, starts, scale)
    assert got.device.type == DEVICE.type and got.dtype == dtype
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.cpu().double(), want, **{
        k: v * (4 if dtype != torch.float32 else 1) for k, v in TOL[dtype].items()})


@pytest.mark.parametrize("n", [1, 17, 54, 97])
@pytest.mark.parametrize("start", [0, 5, 16, 31, 100])
def test_one_chunk_odd_lengths_gqa(n, start):
    _run([n], [start], Hq=8, Hkv=2)


@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (6, 2), (2, 1)])  # MHA, a group of 3, MQA
def test_head_layouts(Hq, Hkv):
    _run([17, 54], [31, 0], Hq=Hq, Hkv=Hkv)


def test_mixed_chunks_one_launch():
    """Several chunks of different lengths and prefixes in one call (a mixed batch)."""
    _run([1, 97, 17, 54], [4000, 3, 64, 0], Hq=8, Hkv=2, seed=3)


def test_long_prefix_4097():
    _run([97], [4000], Hq=4, Hkv=2, ps=32, seed=5)


BF16_DOT = pytest.mark.gpu_only("Triton's interpreter multiplies bf16 dot operands' bit "
                                "patterns (triton#11584): bf16 runs compiled only")


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=BF16_DOT)])
def test_half_precision(dtype):
    _run([54, 17], [100, 31], Hq=8, Hkv=2, dtype=dtype, seed=7)


def test_gpu_block_size():
    """The block size the engine uses on the GPU (block_tokens), with D = 128."""
    bm = block_tokens(32, 8)
    assert bm * 4 == 64
    _run([97], [33], Hq=8, Hkv=2, D=128, ps=32, block_m=bm, seed=9)


def test_plan_blocks():
    seq, q0 = plan_blocks([1, 33, 16], 16)
    assert seq.tolist() == [0, 1, 1, 1, 2]
    assert q0.tolist() == [0, 1, 17, 33, 34]
    meta = plan_metadata([1, 33, 16], [7, 0, 2], 16)
    assert meta["q_begin"].tolist() == [0, 1, 34] and meta["q_end"].tolist() == [1, 34, 50]
    assert all(v.dtype == np.int32 for v in meta.values())
    with pytest.raises(ValueError, match=">= 1 token"):
        plan_blocks([3, 0], 16)
    with pytest.raises(ValueError, match="starts"):
        plan_metadata([3], [-1], 16)


def test_bad_block_size():
    q = torch.zeros(3, 2, 16)
    kc = torch.zeros(2, 16, 16)
    meta = {k: torch.from_numpy(v) for k, v in plan_metadata([3], [0], 16).items()}
    with pytest.raises(ValueError, match="power of two"):
        paged_prefill_attention(q, kc, kc, torch.zeros(1, 2, 1, dtype=torch.int32),
                                *[meta[k] for k in METADATA], 1.0, 24)


def test_chunks_placed_among_other_rows():
    """Chunks at given rows of a larger batch (decode rows before them, a chunk served
    elsewhere between them): their rows are written, every other row of `out` is untouched."""
    gen = torch.Generator().manual_seed(11)
    Hq, Hkv, D, ps, bm = 4, 2, 32, 16, 16
    lens, starts, q_begin = [17, 54], [40, 3], [5, 30]  # rows 0-4 and 22-29 belong to others
    ks, vs, kc, vc, table = _pool([a + n for a, n in zip(starts, lens)], Hkv, D, ps, gen,
                                  torch.float32)
    q = torch.randn(84, Hq, D, generator=gen)
    meta = plan_metadata(lens, starts, bm, q_begin)
    out = torch.full_like(q, 7.0)
    got = paged_prefill_attention(*to_dev(q, kc, vc, table),
                                  *to_dev(*[torch.from_numpy(meta[k]) for k in METADATA]),
                                  D ** -0.5, bm, out=to_dev(out)).cpu()
    mine = torch.cat([torch.arange(5, 22), torch.arange(30, 84)])
    want = _reference(q[mine], ks, vs, lens, starts, D ** -0.5)
    torch.testing.assert_close(got[mine].double(), want, **TOL[torch.float32])
    others = torch.cat([torch.arange(0, 5), torch.arange(22, 30)])
    assert (got[others] == 7.0).all()


def test_fixed_size_metadata_skips_unused_blocks():
    """A CUDA graph's metadata buffers are sized for the most blocks a bucket can hold and
    keep a previous step's entries past the live ones: blocks past num_blocks are skipped,
    their rows untouched."""
    gen = torch.Generator().manual_seed(13)
    Hq, Hkv, D, ps, bm = 4, 2, 32, 16, 16
    lens, starts = [17, 5, 9], [40, 0, 3]  # the third chunk is a stale entry
    ks, vs, kc, vc, table = _pool([a + n for a, n in zip(starts, lens)], Hkv, D, ps, gen,
                                  torch.float32)
    q = torch.randn(40, Hq, D, generator=gen)
    meta = plan_metadata(lens, starts, bm)
    live = len(plan_blocks(lens[:2], bm)[0])
    assert live < len(meta["block_seq"])
    out = torch.full_like(q, 7.0)
    got = paged_prefill_attention(*to_dev(q, kc, vc, table),
                                  *to_dev(*[torch.from_numpy(meta[k]) for k in METADATA]),
                                  D ** -0.5, bm, out=to_dev(out),
                                  num_blocks=to_dev(torch.tensor([live], dtype=torch.int32))).cpu()
    want = _reference(q[:22], ks[:2], vs[:2], lens[:2], starts[:2], D ** -0.5)
    torch.testing.assert_close(got[:22].double(), want, **TOL[torch.float32])
    assert (got[22:] == 7.0).all()


def test_warm_up_runs_on_the_engine_caches():
    """The start-up compile call (cuda_graphs.capture_runner_graphs on a GPU): one one-token
    chunk over page 0 of caches shaped like the engine's, nothing written to them."""
    from sparseserve.kernels.paged_prefill import warm_up

    kc, vc = to_dev(torch.randn(3, 16, 32), torch.randn(3, 16, 32))
    before = kc.clone(), vc.clone()
    warm_up(kc, vc, 8, 2, 32 ** -0.5)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
