"""Causal attention of prompt chunks that continue a prefix, read in place from the KV pages.

Why: a chunk at positions [start, start + n) attends every key before it. The torch path
(`worker/forward_context.py`) gathered the sequence's pages into a contiguous [Hkv, start + n, D]
copy, repeated it G times for SDPA's lower-right causal path (that path has no GQA flag) and
built a mask — at a 32k prefix, ~0.7 GB of copies per layer (Llama-3-8B) and a dozen launches.
This kernel reads K and V straight from the per-KV-head pages, all G query heads of a group
sharing each K/V tile (no repeat), with the causal bound computed from positions.

One program per (block of BLOCK_M query tokens of one chunk, KV head): the q tile is
``[BLOCK_M * GP, D]`` (token-major, GP = G padded to a power of two) so every K/V tile loaded
serves the whole group; an online softmax (base 2, fp32) runs over the chunk's keys in
``BLOCK_N``-token tiles (``BLOCK_N // page_size`` pages each) up to the block's last position.
Which chunk and which first token a program handles come from two small int32 arrays built on
the host from the chunk lengths (`plan_metadata`, moved to the device by the caller: this is a
leaf); everything else is read on the device. The grid depends on the chunks' lengths only.
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from . import patch_triton_interpreter

patch_triton_interpreter()

__all__ = ["paged_prefill_attention", "plan_metadata", "plan_blocks", "block_tokens", "METADATA",
           "warm_up"]

_LOG2E = 1.4426950408889634
# query rows (tokens x group heads) per program on the GPU, with 4 warps and 2 stages: the best
# of 128/4/2, 128/8/2, 64/4/2 on the H200 (docs/results/data/paged_prefill_session17.json,
# 2,048-token chunk, prefixes 0-128k: Llama-3-8B heads 12.6 vs 15.0 / 26.6 ms at 128k)
ROWS_PER_PROGRAM = 64


@triton.jit
def _attend_tile(q, m_i, l_i, acc, j0, last, pos, pt_row, k_ptr, v_ptr, qk_scale,
                 stride_kp, stride_kt, stride_vp, stride_vt, offs_n, offs_d, d_ok,
                 PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, CAUSAL: tl.constexpr):
    """One BLOCK_N-token tile of keys [j0, j0 + BLOCK_N) into the online softmax (m, l, acc);
    CAUSAL: the tile may hold keys past a row's position or past `last` (masked)."""
    key = j0 + offs_n                                                           # [BLOCK_N]
    entry = j0 // PAGE_SIZE + offs_n // PAGE_SIZE
    tok = offs_n % PAGE_SIZE
    if CAUSAL:
        key_ok = key <= last
        page = tl.load(pt_row + entry, mask=key_ok, other=0).to(tl.int64)
        ld = key_ok[:, None] & d_ok[None, :]
    else:
        page = tl.load(pt_row + entry).to(tl.int64)
        ld = d_ok[None, :] & (key[:, None] >= 0)
    k = tl.load(k_ptr + page[:, None] * stride_kp + tok[:, None] * stride_kt + offs_d[None, :],
                mask=ld, other=0.0)                                             # [BLOCK_N, BLOCK_D]
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale        # [ROWS, BLOCK_N]
    if CAUSAL:
        s = tl.where(key[None, :] <= pos[:, None], s, float("-inf"))
    # m stays finite: the first tile holds key 0, which every row sees
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_ptr + page[:, None] * stride_vp + tok[:, None] * stride_vt + offs_d[None, :],
                mask=ld, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# the page table's strides vary with the step's widest chunk, and the metadata are slices of
# one packed buffer: one compiled kernel for all of them (so the start-up warm_up compiles
# what serving runs; a class it missed cost 0.9 s mid-serving on the H200, serving.md
# twentieth session). The metadata are per-block scalar loads: alignment buys nothing.
@triton.jit(do_not_specialize=["stride_pts", "stride_pth"],
            do_not_specialize_on_alignment=["pt_ptr", "qb_ptr", "qe_ptr", "st_ptr", "bseq_ptr",
                                            "bq0_ptr", "nblk_ptr"])
def _paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, pt_ptr, qb_ptr, qe_ptr, st_ptr, bseq_ptr, bq0_ptr,
    nblk_ptr,                    # [1] int32 blocks in use (CHECK_BLOCKS: a grid sized for the most)
    qk_scale,                    # scale * log2(e)
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kp, stride_kt, stride_vp, stride_vt,
    stride_pts, stride_pth,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, CHECK_BLOCKS: tl.constexpr,
):
    blk = tl.program_id(0)
    h = tl.program_id(1)
    if CHECK_BLOCKS:
        if blk >= tl.load(nblk_ptr):
            return
    ROWS: tl.constexpr = BLOCK_M * GP

    seq = tl.load(bseq_ptr + blk)
    q0 = tl.load(bq0_ptr + blk)                  # first query token of this block
    q_begin = tl.load(qb_ptr + seq)
    q_end = tl.load(qe_ptr + seq)
    start = tl.load(st_ptr + seq)                # the chunk's first position (its prefix)

    offs_r = tl.arange(0, ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    tok_q = q0 + offs_r // GP                    # query token of each row
    g = offs_r % GP
    row_ok = (tok_q < q_end) & (g < G)
    d_ok = offs_d < D
    # a padded row attends key 0 only (finite softmax, never stored)
    pos = tl.where(row_ok, start + tok_q - q_begin, 0)                         # [ROWS]
    tok64 = tok_q.to(tl.int64)
    q = tl.load(q_ptr + tok64[:, None] * stride_qt + (h * G + g)[:, None] * stride_qh
                + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    first = start + q0 - q_begin                                               # block's first position
    last = tl.minimum(q_end, q0 + BLOCK_M) - 1 - q_begin + start               # and its last
    pt_row = pt_ptr + seq.to(tl.int64) * stride_pts + h * stride_pth
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    # tiles wholly before the block's first position: every row sees every key, no masks
    split = (first // BLOCK_N) * BLOCK_N
    for j0 in range(0, split, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, j0, last, pos, pt_row, k_ptr, v_ptr,
                                     qk_scale, stride_kp, stride_kt, stride_vp, stride_vt,
                                     offs_n, offs_d, d_ok, PAGE_SIZE, DOT_PRECISION, False)
    for j0 in range(split, last + 1, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, j0, last, pos, pt_row, k_ptr, v_ptr,
                                     qk_scale, stride_kp, stride_kt, stride_vp, stride_vt,
                                     offs_n, offs_d, d_ok, PAGE_SIZE, DOT_PRECISION, True)
    o = acc / l_i[:, None]
    tl.store(o_ptr + tok64[:, None] * stride_ot + (h * G + g)[:, None] * stride_oh + offs_d[None, :],
             o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def block_tokens(num_q_heads: int, num_kv_heads: int) -> int:
    """Query tokens per program: ROWS_PER_PROGRAM rows of (token, group head), >= 16 tokens."""
    gp = triton.next_power_of_2(num_q_heads // num_kv_heads)
    return max(16, ROWS_PER_PROGRAM // gp)


def plan_blocks(chunk_lens, block_m: int, q_begin=None) -> tuple[np.ndarray, np.ndarray]:
    """-> (block_seq, block_q0) int32 [NB]: for every BLOCK_M-token block of the chunks
    (lengths ``chunk_lens``, each >= 1; chunk s's first row in q is q_begin[s], default: the
    chunks concatenated), its chunk index and first query row."""
    lens = np.asarray(chunk_lens, dtype=np.int64)
    if lens.size == 0 or (lens < 1).any():
        raise ValueError(f"every chunk needs >= 1 token, got lengths {lens.tolist()}")
    starts = (np.concatenate([[0], np.cumsum(lens)[:-1]]) if q_begin is None
              else np.asarray(q_begin, dtype=np.int64))
    nblocks = -(-lens // block_m)
    seq = np.repeat(np.arange(lens.size), nblocks)
    first = np.repeat(starts, nblocks)
    within = np.arange(nblocks.sum()) - np.repeat(np.cumsum(nblocks) - nblocks, nblocks)
    return seq.astype(np.int32), (first + within * block_m).astype(np.int32)


def plan_metadata(chunk_lens, starts, block_m: int, q_begin=None) -> dict[str, np.ndarray]:
    """The kernel's int32 metadata for S chunks (host arrays; the caller moves them to the
    device): q_begin / q_end [S] (chunk s is q[q_begin[s]:q_end[s]]; default: the chunks
    concatenated in order), starts [S] (each chunk's first position), block_seq / block_q0
    [NB] (`plan_blocks`)."""
    lens = np.asarray(list(chunk_lens), dtype=np.int64)
    st = np.asarray(list(starts), dtype=np.int64)
    if st.shape != lens.shape or (st < 0).any():
        raise ValueError(f"starts {st.tolist()} must be >= 0, one per chunk ({lens.size})")
    qb = (np.concatenate([[0], np.cumsum(lens)[:-1]]) if q_begin is None
          else np.asarray(list(q_begin), dtype=np.int64))
    if qb.shape != lens.shape:
        raise ValueError(f"q_begin {qb.tolist()} needs one entry per chunk ({lens.size})")
    bseq, bq0 = plan_blocks(lens, block_m, qb)
    return {"q_begin": qb.astype(np.int32), "q_end": (qb + lens).astype(np.int32),
            "starts": st.astype(np.int32), "block_seq": bseq, "block_q0": bq0}

METADATA = ("q_begin", "q_end", "starts", "block_seq", "block_q0")  # the kernel's order


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            page_table: torch.Tensor, q_begin: torch.Tensor,
                            q_end: torch.Tensor, starts: torch.Tensor, block_seq: torch.Tensor,
                            block_q0: torch.Tensor, scale: float, block_m: int,
                            out: torch.Tensor | None = None, num_warps: int = 4,
                            num_stages: int = 2,
                            num_blocks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of S prompt chunks over their whole sequences, read from KV pages.

    Args:
        q:          [T, Hq, D]          the chunks' queries, concatenated
        k_cache:    [P, page_size, D]   K pages of this layer (the chunks' own keys already stored)
        v_cache:    [P, page_size, D]   V pages of this layer
        page_table: [S, Hkv, W] int32   each chunk's sequence pages per KV head in token order:
                                        entry i holds positions [i * page_size, (i + 1) * page_size);
                                        W >= ceil((starts[s] + chunk length) / page_size)
        q_begin, q_end, starts, block_seq, block_q0: int32 device tensors of
                                        `plan_metadata(..., block_m)` (chunk s is rows
                                        q[q_begin[s]:q_end[s]], at positions starts[s] + 0, 1,
                                        ...); other rows of q and out are not touched
        scale:      softmax scale
        block_m:    query tokens per program, the one the metadata was planned with
                    (`block_tokens(Hq, Hkv)` on the GPU); a power of two >= 16
        out:        [T, Hq, D] or None  the chunks' rows written in place if given
        num_blocks: [1] int32 or None   blocks of block_seq / block_q0 in use; the rest are
                                        skipped (fixed-size metadata of a CUDA graph, where
                                        the grid is the buffers' length); None: all
    Returns:
        [T, Hq, D] in q's dtype: query i of chunk s attends keys 0..starts[s] + i of its
        sequence, softmax in fp32. No host synchronisation.
    """
    T, Hq, D = q.shape
    S, Hkv, W = page_table.shape
    page_size = k_cache.shape[1]
    if Hq % Hkv or k_cache.shape != v_cache.shape or k_cache.shape[2] != D:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k/v {tuple(k_cache.shape)}, "
                         f"page_table {tuple(page_table.shape)}")
    if (q_begin.shape != (S,) or q_end.shape != (S,) or starts.shape != (S,)
            or block_seq.shape != block_q0.shape):
        raise ValueError("metadata does not match the page table's chunks: plan it with "
                         "plan_metadata(chunk_lens, starts, block_m)")
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    G = Hq // Hkv
    if out is None:
        out = torch.empty_like(q)
    BLOCK_D = max(16, triton.next_power_of_2(D))
    BLOCK_N = max(64 if BLOCK_D > 64 else 128, page_size)
    _paged_prefill_kernel[(block_seq.shape[0], Hkv)](
        q, k_cache, v_cache, out, page_table, q_begin, q_end, starts, block_seq, block_q0,
        block_seq if num_blocks is None else num_blocks, float(scale) * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        page_table.stride(0), page_table.stride(1),
        G=G, GP=triton.next_power_of_2(G), D=D, PAGE_SIZE=page_size, BLOCK_M=block_m,
        BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        CHECK_BLOCKS=num_blocks is not None, num_warps=num_warps, num_stages=num_stages)
    return out


def warm_up(k_cache: torch.Tensor, v_cache: torch.Tensor, num_q_heads: int,
            num_kv_heads: int, scale: float) -> None:
    """Compile the kernel the eager path launches, before serving (a first compile mid-serving
    costs one request ~0.6 s of TTFT: light8 on the H200, seventeenth session): one one-token
    chunk at position 0 reading page 0 of these caches (its output is dropped)."""
    dev, d = k_cache.device, k_cache.shape[-1]
    bm = block_tokens(num_q_heads, num_kv_heads)
    q = torch.zeros(1, num_q_heads, d, dtype=k_cache.dtype, device=dev)
    table = torch.zeros(1, num_kv_heads, 1, dtype=torch.int32, device=dev)
    meta = plan_metadata([1], [0], bm)
    paged_prefill_attention(q, k_cache, v_cache, table,
                            *[torch.from_numpy(meta[k]).to(dev) for k in METADATA], scale, bm)
