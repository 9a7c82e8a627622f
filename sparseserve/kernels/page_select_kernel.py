"""Fused page selection by estimated attention mass: scores + kept pages + top-k + compaction
in Triton, replacing ``SparseAlgorithm.select``'s score kernel, ~30 torch ops and ``torch.topk``
(the measured bottleneck of sparse decode). One (request, KV head) row at a time;
``ref.select_pages`` / ``ref.mass_from_bounds`` are the spec:

1. Bounds. Per query head g of the GQA group, ``u_g = sum_c max(q_gc M_c, q_gc m_c)
   = q_g+ . M + q_g- . m`` (equal whenever ``M >= m``: a min/max box and ArkVale's ``c -/+ r``
   box): two ``tl.dot``s of a ``[BLOCK_W, D]`` summary tile against the ``[D, GP]`` positive
   and negative parts of the heads (GP = G padded to 16; operands in the summary dtype, where
   q+ / q- are exact, fp32 accumulation; IEEE for fp32 summaries). Key-code algorithms put
   the log-sum-exp of a page's approximate token logits here instead (``code_scores``,
   ``channel_codes``, ``sparq_lanes`` / ``sparq_stream`` / ``sparq_tiles``; GP = G padded
   to 4). Every full page is scored (kept ones too: they normalise); the partial last page,
   whose summary is not built yet, is not.
2. Normalisation. ``x_g = u_g * D**-0.5 * log2(e)`` is written to a ``[G, W]`` fp32 scratch row
   while an online max / sum-of-exp2 per head runs over the full pages (as flash attention
   does), giving ``lse_g``. Split mode keeps one partial (max, sum) per split program and the
   select launch merges them.
3. Keys. ``mass = sum_g exp2(x_g - lse_g)`` (each head's estimated attention distribution over
   the full pages, summed over the group); mass >= 0, so its float bits are an
   order-preserving int32 key. Kept pages get INT_MAX, the last page and entries past
   ``num_pages`` INT_MIN.
4. Threshold. Binary search over the 2^32 key values for T = the k-th largest key
   (``count(key >= T) >= k > count(key > T)``): 32 block-wide counts over the row, held in
   registers when W <= ``MAX_TILE`` (else written to a key scratch row and re-read, L2-resident).
5. Compact. Keys > T and the first ``k - count(> T)`` keys == T in block order (deterministic
   ties) are written in block order by a prefix sum; the last page follows at ``num_sel - 1``.

Fused mode runs everything in one program per (request, KV head). With few rows (small batch)
one program per row cannot pull the summaries fast enough, so split mode scores with
``num_splits`` programs per row and normalises + selects in a second launch of the same kernel.
Fixed shapes, no host synchronisation (CUDA-graph capturable).
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import patch_triton_interpreter
from .channel_codes import chan_code_page_x
from .code_scores import code_page_x
from .sparq_codes import sparq_page_x
from .sparq_lanes import sparq_score_lanes
from .sparq_stream import sparq_score_stream
from .sparq_tiles import sparq_score_tiles

patch_triton_interpreter()


@triton.jit
def _row_keys(s_row, stride_sg, offs, n, sink, local, lse, G: tl.constexpr, GP: tl.constexpr):
    """int32 keys [TILE] of entries ``offs``: mass bits for scored pages, INT_MAX kept, INT_MIN
    for the last page and entries past n. lse [GP]: per-head log2-sum-exp2 over the row's
    full pages."""
    offs_g = tl.arange(0, GP)
    cand = offs < n - 1  # the last page is appended separately
    kept = cand & ((offs < sink) | (offs >= n - local))
    scored = cand & (~kept)
    mass = tl.zeros(offs.shape, tl.float32)
    for g in tl.static_range(G):
        lse_g = tl.sum(tl.where(offs_g == g, lse, 0.0), axis=0)
        x = tl.load(s_row + g * stride_sg + offs, mask=scored, other=float("-inf"),
                    cache_modifier=".cg")
        mass += tl.exp2(x - lse_g)  # lse_g is finite: 0 off the scored pages
    key = mass.to(tl.int32, bitcast=True)  # mass >= 0: its bits order like its value
    key = tl.where(kept, 2147483647, key)
    return tl.where(scored | kept, key, -2147483647 - 1)


# the split count, its chunks per program and the partials' strides follow the step's decode
# rows (eager hybrid steps run any batch size; graphs only their buckets): not specialised on
# (== 1, % 16), else a new class compiles mid-serving (serving.md, twentieth session)
@triton.jit(do_not_specialize=["chunks_per_split", "num_splits", "stride_mlb", "stride_mlh"])
def _page_select_kernel(
    q_ptr, kmin_ptr, kmax_ptr, codes_ptr, mean_ptr, chan_ptr, kscale_ptr, pt_ptr, np_ptr, s_ptr,
    ml_ptr, key_ptr, pages_ptr, blocks_ptr, nsel_ptr,
    stride_qb, stride_qh, stride_min, stride_max, stride_codes, stride_mean, stride_chan,
    stride_ptb, stride_pth, stride_npb,
    stride_sb, stride_sh, stride_sg, stride_mlb, stride_mlh,
    stride_kb, stride_kh, stride_pb, stride_ph, stride_bb, stride_bh, stride_nb,
    W, k_top, k_out, sink, local, chunks_per_split, num_splits, qk_scale, magic,
    NSUB: tl.constexpr, BITS: tl.constexpr, PS: tl.constexpr, R: tl.constexpr,
    INT8_MEAN: tl.constexpr, SPARQ: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
    D: tl.constexpr, BLOCK_W: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, TILE: tl.constexpr, ONE_TILE: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr, DO_SCORE: tl.constexpr,
    DO_SELECT: tl.constexpr, NW: tl.constexpr, ASM: tl.constexpr, FAST: tl.constexpr,
    BCS: tl.constexpr, CCS: tl.constexpr, REC: tl.constexpr, RI: tl.constexpr = 1,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    b64 = b.to(tl.int64)
    n = tl.load(np_ptr + b * stride_npb + h)
    pt_row = pt_ptr + b64 * stride_ptb + h * stride_pth
    s_row = s_ptr + b64 * stride_sb + h * stride_sh
    ml_row = ml_ptr + b64 * stride_mlb + h * stride_mlh  # [num_splits, 2 * GP]: max, sum
    key_row = key_ptr + b64 * stride_kb + h * stride_kh
    offs_g = tl.arange(0, GP)
    if DO_SCORE:
        c0 = tl.program_id(2) * chunks_per_split
        # chunks past the row's full pages score nothing: W is the table's width (max_model_len
        # in pages), a short row's program stops at its own pages (none: m_run / l_run keep
        # their initial values, which the merge and the lse treat as "no page seen")
        c1 = tl.minimum(c0 + chunks_per_split, tl.cdiv(tl.maximum(n - 1, 0), BLOCK_W))
    if DO_SCORE and SPARQ == 2:  # sparq_tiles: the row's R channels, tensor-core layout
        m_run, l_run = sparq_score_tiles(
            q_ptr + b64 * stride_qb + h * G * stride_qh, stride_qh, mean_ptr, kmin_ptr, kmax_ptr,
            codes_ptr, kscale_ptr, chan_ptr + b64 * stride_chan + h * R, stride_mean,
            stride_min, stride_max, stride_codes, pt_row, s_row, stride_sg, n, c0, c1, qk_scale,
            magic, G, GP, D, BLOCK_D, PS, R, BLOCK_W, 16, NW, ASM, FAST, DOT_PREC, BCS, CCS, REC,
            RI)
    elif DO_SCORE and (SPARQ == 3 or SPARQ == 4):  # sparq_stream (4: its 2-warp launch)
        m_run, l_run = sparq_score_stream(
            q_ptr + b64 * stride_qb + h * G * stride_qh, stride_qh, mean_ptr, kmin_ptr, kmax_ptr,
            codes_ptr, kscale_ptr, chan_ptr + b64 * stride_chan + h * R, stride_mean,
            stride_min, stride_max, stride_codes, pt_row, s_row, stride_sg, n, c0, c1, qk_scale,
            magic, G, GP, D, BLOCK_D, PS, R, BLOCK_W, NW, ASM, FAST, DOT_PREC, BCS, CCS, REC, 2,
            RI)
    elif DO_SCORE and SPARQ == 5:  # sparq_lanes: per-lane mma fragments, a chunk a warp
        m_run, l_run = sparq_score_lanes(
            q_ptr + b64 * stride_qb + h * G * stride_qh, stride_qh, mean_ptr, codes_ptr,
            kscale_ptr, chan_ptr + b64 * stride_chan + h * R, stride_mean, stride_codes, pt_row,
            s_row, stride_sg, n, c0, c1, qk_scale, G, GP, D, NW, REC, RI, FAST)
    elif DO_SCORE:
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        # [BLOCK_D, GP]: column g = query head h * G + g (zero columns pad the group to GP)
        qm = d_ok[:, None] & (offs_g[None, :] < G)
        qt = tl.load(q_ptr + b64 * stride_qb + (h * G + offs_g[None, :]) * stride_qh
                     + offs_d[:, None], mask=qm, other=0.0)
        qt = qt.to(kmax_ptr.dtype.element_ty)  # the dot's operands share the summary dtype
        zero = tl.zeros_like(qt)
        qp = tl.where(qt > zero, qt, zero)  # exact in any dtype: no rounding of the bound
        qn = tl.where(qt < zero, qt, zero)
        m_run = tl.full([GP], -1e30, tl.float32)  # finite: no inf - inf before a page is seen
        l_run = tl.zeros([GP], tl.float32)
        for c in range(c0, c1):
            offs_w = c * BLOCK_W + tl.arange(0, BLOCK_W)
            need = offs_w < n - 1  # full pages, kept ones included (they normalise too)
            page = tl.load(pt_row + offs_w, mask=need, other=0).to(tl.int64)
            m2 = need[:, None] & d_ok[None, :]
            if SPARQ:  # the row's R channels of every page (chan: [B, Hkv, R] of them)
                x = sparq_page_x(
                    mean_ptr, kmin_ptr, kmax_ptr, codes_ptr, kscale_ptr, chan_ptr + b64 *
                    stride_chan + h * R, stride_mean, stride_min, stride_max, stride_codes, q_ptr
                    + b64 * stride_qb + h * G * stride_qh, stride_qh, qt, page, need, qk_scale,
                    D, BLOCK_D, BLOCK_W, PS, R, G, GP, INT8_MEAN, DOT_PREC, BCS, CCS)
            elif R > 0:  # channel key codes (kmin / kmax: the R coded channels' ranges)
                x = chan_code_page_x(mean_ptr, kmin_ptr, kmax_ptr, chan_ptr, codes_ptr,
                                     kscale_ptr, stride_mean, stride_min, stride_max,
                                     stride_chan, stride_codes,
                                     q_ptr + b64 * stride_qb + h * G * stride_qh, stride_qh, qt,
                                     page, need, qk_scale, D, BLOCK_D, BLOCK_W, PS, R, G, GP,
                                     INT8_MEAN, DOT_PREC, FAST)
            elif BITS == 0:
                u = tl.full([BLOCK_W, GP], float("-inf"), tl.float32)
                # a page row holds NSUB boxes of D channels: the page's bound is their max
                for j in tl.static_range(NSUB):
                    hi = tl.load(kmax_ptr + page[:, None] * stride_max + j * D
                                 + offs_d[None, :], mask=m2, other=0.0)      # [BLOCK_W, BLOCK_D]
                    lo = tl.load(kmin_ptr + page[:, None] * stride_min + j * D
                                 + offs_d[None, :], mask=m2, other=0.0).to(hi.dtype)
                    uj = tl.dot(hi, qp, input_precision=DOT_PREC)            # [BLOCK_W, GP] fp32
                    uj = tl.dot(lo, qn, acc=uj, input_precision=DOT_PREC)
                    u = tl.maximum(u, uj)
                x = u * qk_scale
            else:  # token key codes: x = log2-sum-exp2 of the page's approximate logits
                x = code_page_x(kmin_ptr, kmax_ptr, codes_ptr, stride_min, stride_max,
                                stride_codes, pt_row, c * BLOCK_W, n, qt, qk_scale, D,
                                BLOCK_D, BLOCK_W, PS, BITS, GP, DOT_PREC, FAST)
            tl.store(s_row + offs_g[None, :] * stride_sg + offs_w[:, None], x,
                     mask=need[:, None] & (offs_g[None, :] < G))
            xm = tl.where(need[:, None], x, float("-inf"))
            m_new = tl.maximum(m_run, tl.max(xm, axis=0))
            l_run = l_run * tl.exp2(m_run - m_new) + tl.sum(tl.exp2(xm - m_new[None, :]), axis=0)
            m_run = m_new
    if DO_SCORE and not DO_SELECT:
        ml = ml_row + tl.program_id(2) * (2 * GP) + offs_g
        tl.store(ml, m_run)
        tl.store(ml + GP, l_run)
    if DO_SELECT:
        if DO_SCORE:
            # other threads of this program wrote the scratch row: order their stores before
            # our loads (and read through L2 with .cg, never a stale L1 line)
            tl.debug_barrier()
        else:  # merge the split programs' partial (max, sum) per head
            offs_s = tl.arange(0, BLOCK_S)
            mls = ml_row + offs_s[:, None] * (2 * GP) + offs_g[None, :]
            s_ok = (offs_s < num_splits)[:, None]
            m_s = tl.load(mls, mask=s_ok, other=-1e30)                      # [BLOCK_S, GP]
            l_s = tl.load(mls + GP, mask=s_ok, other=0.0)
            m_run = tl.max(m_s, axis=0)
            l_run = tl.sum(l_s * tl.exp2(m_s - m_run[None, :]), axis=0)
        # l >= 1 once a full page was seen (its max adds exp2(0)); 0 = none (no key reads lse
        # then): clamping at 1 changes nothing else and keeps lse finite
        lse = m_run + tl.log2(tl.maximum(l_run, 1.0))
        k_eff = tl.maximum(tl.minimum(k_top, n - 1), 0)
        offs_t = tl.arange(0, TILE)
        if ONE_TILE:
            keys = _row_keys(s_row, stride_sg, offs_t, n, sink, local, lse, G, GP)
        else:
            for t0 in range(0, W, TILE):
                kt = _row_keys(s_row, stride_sg, t0 + offs_t, n, sink, local, lse, G, GP)
                tl.store(key_row + t0 + offs_t, kt, mask=t0 + offs_t < W)
            tl.debug_barrier()  # the search below reads other threads' keys
        # binary search on [lo, hi): count(>= lo) >= k_eff > count(>= hi); int64 bounds
        lo = tl.full([], -2147483647, tl.int64)
        hi = tl.full([], 2147483648, tl.int64)
        n_gt = tl.full([], 0, tl.int32)  # count(>= hi), i.e. count(> T) at the end
        for _ in range(32):
            mid = lo + (hi - lo) // 2
            mid32 = mid.to(tl.int32)
            if ONE_TILE:
                cnt = tl.sum((keys >= mid32).to(tl.int32), axis=0)
            else:
                cnt = tl.full([], 0, tl.int32)
                for t0 in range(0, W, TILE):
                    kt = tl.load(key_row + t0 + offs_t, mask=t0 + offs_t < W,
                                 other=-2147483647 - 1, cache_modifier=".cg")
                    cnt += tl.sum((kt >= mid32).to(tl.int32), axis=0)
            ok = cnt >= k_eff
            lo = tl.where(ok, mid, lo)
            n_gt = tl.where(ok, n_gt, cnt)
            hi = tl.where(ok, hi, mid)
        thr = lo.to(tl.int32)
        n_eq_take = k_eff - n_gt  # ties at T taken, lowest block index first
        out_p = pages_ptr + b64 * stride_pb + h * stride_ph
        out_b = blocks_ptr + b64 * stride_bb + h * stride_bh
        base_gt = tl.full([], 0, tl.int32)
        base_eq = tl.full([], 0, tl.int32)
        for t0 in range(0, W, TILE):
            offs = t0 + offs_t
            if ONE_TILE:
                kt = keys
            else:
                kt = tl.load(key_row + offs, mask=offs < W, other=-2147483647 - 1,
                             cache_modifier=".cg")
            gt = (kt > thr).to(tl.int32)
            eq = (kt == thr).to(tl.int32)
            cs = tl.cumsum(gt + (eq << 16), axis=0)  # both counts in one scan (TILE < 2^16)
            c_gt = (cs & 0xFFFF) - gt + base_gt     # exclusive counts before each entry
            c_eq = (cs >> 16) - eq + base_eq
            sel = (gt > 0) | ((eq > 0) & (c_eq < n_eq_take))
            pos = c_gt + tl.minimum(c_eq, n_eq_take)
            page = tl.load(pt_row + offs, mask=sel, other=0)
            tl.store(out_p + pos, page, mask=sel)
            tl.store(out_b + pos, offs.to(tl.int64), mask=sel)
            base_gt += tl.sum(gt, axis=0)
            base_eq += tl.sum(eq, axis=0)
        # the last page at num_sel - 1; the unused tail repeats it, so every entry is a valid id
        last = tl.maximum(n - 1, 0)
        last_page = tl.load(pt_row + last)
        offs_k = tl.arange(0, BLOCK_K)
        tail = (offs_k >= k_eff) & (offs_k < k_out)
        tl.store(out_p + offs_k, tl.zeros([BLOCK_K], tl.int32) + last_page, mask=tail)
        tl.store(out_b + offs_k, tl.zeros([BLOCK_K], tl.int64) + last.to(tl.int64), mask=tail)
        tl.store(nsel_ptr + b * stride_nb + h, k_eff + (n > 0).to(tl.int32))
