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
   ``channel_codes``, ``sparq_tiles``; GP = G padded to 4). Every full page is scored (kept
   ones too: they normalise); the partial last page, whose summary is not built yet, is not.
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

import functools
import os

import torch
import triton
import triton.language as tl

from . import patch_triton_interpreter
from .channel_codes import chan_code_page_x
from .code_scores import code_page_x
from .ref_sparq import channel_major
from .sparq_codes import sparq_page_x
from .sparq_records import rec_kind as rec_kind_of
from .sparq_tiles import MAGIC_F32, SPARQ_ASM, SPARQ_KERNEL, TILE_PAGES, sparq_score_tiles

patch_triton_interpreter()

__all__ = ["select_pages", "MAX_TILE"]

MAX_TILE = 8192  # widest key row held in registers (32 int32 per thread at 8 warps)
# Untuned defaults (no GPU was at hand when written); None = the heuristics in select_pages.
# Set here or by environment to sweep them without code changes.
NUM_SPLITS = int(os.environ.get("SPARSESERVE_SELECT_SPLITS", 0)) or None
BLOCK_W = int(os.environ.get("SPARSESERVE_SELECT_BLOCK_W", 0)) or None
NUM_WARPS = int(os.environ.get("SPARSESERVE_SELECT_WARPS", 0)) or None
SPLIT_PROGRAMS_PER_SM = 2  # split mode until rows alone give this many programs per SM
# ... and only for rows of more chunks than this: a row of a few chunks scores them in a few
# us in one program, less than the split mode's second launch (light8 profile, fifteenth
# session: 2 launches of ~9 us per layer at 160-page rows)
FUSED_MAX_CHUNKS = 4
LOG2E = 1.4426950408889634


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


@triton.jit
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
    BCS: tl.constexpr, CCS: tl.constexpr, REC: tl.constexpr,
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
            magic, G, GP, D, BLOCK_D, PS, R, BLOCK_W, 16, NW, ASM, FAST, DOT_PREC, BCS, CCS, REC)
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


@functools.lru_cache(maxsize=None)
def _num_sms(index) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _default_splits(q, rows: int, chunks: int) -> int:
    """Programs per row for the score phase: 1 (fused) once rows alone fill the GPU, or when
    a row has at most FUSED_MAX_CHUNKS chunks."""
    if chunks <= FUSED_MAX_CHUNKS:
        return 1
    sms = _num_sms(q.device.index if q.device.index is not None else torch.cuda.current_device()) \
        if q.is_cuda else 8
    return max(1, min(chunks, triton.cdiv(SPLIT_PROGRAMS_PER_SM * sms, rows)))


def select_pages(q, kmin, kmax, page_table, num_pages, last_page_len, budget_pages, sink_pages,
                 local_pages, out_pages=None, out_num=None, out_blocks=None, *, num_splits=None,
                 block_w=None, num_warps=None, n_sub=1, codes=None, bits=0, kmean=None,
                 chan=None, kscale=None, sparq_chan=None, sparq_kernel=None, sparq_asm=None,
                 sparq_rec=None, scores_out=None):
    """Fused Quest/ArkVale page selection by estimated attention mass
(``SparseAlgorithm.select``'s contract over ``Quest.score``; spec: ``ref.select_pages``).

    Args:
        q:             [B, Hq, D]          decode queries, Hq = Hkv * G (last dim contiguous)
        kmin, kmax:    [S, n_sub * D]      summary box rows (kmin <= kmax elementwise); a row
                                           holds n_sub boxes (sub-page partitions), the page's
                                           bound per head is the max of its boxes' bounds
        page_table:    [B, Hkv, W] int32   all of each request's pages in order
        num_pages:     [B, Hkv] int32      valid entries of page_table (1..W)
        last_page_len: [B] int32           unused here (the caller's Selection carries it)
        budget_pages, sink_pages, local_pages: ints
        out_pages / out_num / out_blocks:  optional outputs, written in place
        num_splits:    score programs per row (1 = one fused launch; default: by SM count)
        block_w, num_warps: tuning overrides (pages per score step; warps of each launch)
        n_sub:         boxes per page row (1: Quest / ArkVale's one box per page)
        codes, bits:   token key codes (``sparse/keycodes.py``): codes [S, page_size * D *
                       bits / 32] int32 and kmin/kmax [S, D] their range; a page's per-head
                       score input is then the log-sum-exp of its tokens' approximate logits
                       (``ref.code_page_bounds``) instead of a box bound
        kmean, chan, kscale: channel key codes (``sparse/keycode_channels.py``, with
                       ``codes``, bits 2): kmean [S, D] (int8 with kscale [S, 1]), chan
                       [S, R / 4] int32, and kmin / kmax [S, R] the coded channels' ranges;
                       scores as ``ref.channel_code_page_bounds``
        sparq_chan:    [B, Hkv, R] int32 with kmean / kscale / codes (channel-major, bits 2;
                       [S, D * PS / 16] or [S, D, PS / 16]) and kmin / kmax [S, D]: each row
                       decodes its R channels (``sparse/keycode_sparq.py``; scores as
                       ``ref.sparq_page_bounds``); kmin / kmax / codes may be strided views
        sparq_kernel, sparq_asm: its score phase (2: ``sparq_tiles``, 1: ``sparq_codes``)
                       and bf16x2 decoding in it (default: ``sparq_tiles.SPARQ_*``, by env)
        sparq_rec:     [S, D * NR] int32: the records that kmin / kmax / codes view
                       (``sparq_records``); ``sparq_tiles`` then loads whole 4-word records
        scores_out:    [B, Hkv, G, W] fp32 for the per-head scores (``x_g`` above; written
                       for the full pages), else scratch
    Returns:
        pages [B, Hkv, K] int32 physical ids, num_sel [B, Hkv] int32, blocks [B, Hkv, K] int64
        logical indices, K = max(1, min(budget - 1, W)) + 1 (= budget when W >= budget - 1).
        Entries < num_sel: the kept pages (first ``sink``, last ``local`` incl. the last page)
        and the others of highest mass (ties: lower block first), in block order, then the last
        page at num_sel - 1 (num_sel = min(K, num_pages)); entries past it repeat the last page.

    Scratch (fixed shapes): the scores, split partials [B, Hkv, splits, 2 * GP] fp32, and
    the key row [B, Hkv, W] int32 when W exceeds ``MAX_TILE`` (else keys stay in registers).
    """
    B, Hq, D = q.shape
    _, Hkv, W = page_table.shape
    assert Hq % Hkv == 0 and W >= 1
    sparq = sparq_chan is not None
    chan = sparq_chan.to(torch.int32).contiguous() if sparq else chan  # sparq: [B, Hkv, R]
    R = (chan.shape[-1] if sparq else kmin.shape[-1]) if chan is not None else 0
    ps = 1
    rec_kind = rec_kind_of(kmin.dtype) if sparq_rec is not None else 0  # before any cast
    if sparq:  # [S, D, PS / 16] code words, any channel stride (the records' or PS / 16)
        codes = channel_major(codes, D)
        assert codes.stride(2) == 1 and (sparq_rec is None or sparq_rec.stride(1) == 1)
    if R:
        from . import channel_codes_supported
        assert channel_codes_supported(R, D) and bits == 2 and codes is not None and n_sub == 1
        assert kmean.shape[-1] == D and kmean.stride(1) == 1 and chan.dtype == torch.int32
        nc = D if sparq else R  # the channels whose codes a page row holds
        ps = codes[0].numel() * 16 // nc
        assert ps * nc == codes[0].numel() * 16 and ps & (ps - 1) == 0 and (ps >= 16 or not sparq)
        if not q.is_cuda and kmax.dtype == torch.bfloat16 and kscale is None:
            kmean = kmean.float()  # with kmin / kmax below: the interpreter's bf16 dot
    else:
        assert kmin.shape[-1] == n_sub * D and kmax.shape[-1] == n_sub * D
    if bits and not R:
        assert n_sub == 1 and codes is not None and codes.dtype == torch.int32
        assert codes.stride(1) == 1
        ps = codes.shape[1] * 32 // (bits * D)
        assert ps * bits * D == codes.shape[1] * 32 and ps & (ps - 1) == 0
    if not q.is_cuda and kmax.dtype == torch.bfloat16:
        # Triton's interpreter multiplies bf16 dot operands' bit patterns (triton#11584):
        # run it in fp32 there (exact: bf16 values are fp32 values)
        q, kmin, kmax = q.float(), kmin.float(), kmax.float()
    assert q.stride(2) == 1 and kmin.stride(1) == kmax.stride(1) and (sparq or kmin.stride(1) == 1)
    page_table = page_table.to(torch.int32)  # no-ops for the engine's int32 tables
    num_pages = num_pages.to(torch.int32)
    page_table = page_table if page_table.stride(2) == 1 else page_table.contiguous()
    num_pages = num_pages if num_pages.stride(1) == 1 else num_pages.contiguous()
    k_top = max(1, min(budget_pages - 1, W))
    k_out = k_top + 1
    dev = q.device
    if out_pages is None:
        out_pages = torch.empty(B, Hkv, k_out, dtype=torch.int32, device=dev)
    if out_num is None:
        out_num = torch.empty(B, Hkv, dtype=torch.int32, device=dev)
    if out_blocks is None:
        out_blocks = torch.empty(B, Hkv, k_out, dtype=torch.int64, device=dev)
    assert out_pages.shape == (B, Hkv, k_out) and out_pages.dtype == torch.int32
    assert out_blocks.shape == (B, Hkv, k_out) and out_blocks.dtype == torch.int64
    assert out_num.shape == (B, Hkv) and out_num.dtype == torch.int32
    assert out_pages.stride(2) == 1 and out_blocks.stride(2) == 1 and out_num.stride(1) == 1
    if B == 0:
        return out_pages, out_num, out_blocks
    G = Hq // Hkv  # GP: the dots' N (key codes: per-token work scales with it, 4 is enough)
    GP = max(4 if bits else 16, triton.next_power_of_2(G))
    num_splits, block_w, num_warps = (num_splits or NUM_SPLITS, block_w or BLOCK_W,
                                      num_warps or NUM_WARPS)
    BLOCK_D = max(16, triton.next_power_of_2(D))
    version = (SPARQ_KERNEL if sparq_kernel is None else sparq_kernel) if sparq else 0
    if version == 2 and (kscale is None or ps // 16 not in (1, 2, 4)):
        version = 1  # sparq_tiles: int8 means, 16 to 64 tokens a page
    # whole-record loads: sparq_tiles with 4-word records (else their strided views)
    rec_kind = rec_kind if version == 2 and rec_kind and sparq_rec.shape[1] == 4 * D else 0
    if version == 2:  # chunks of TILE_PAGES pages (a multiple of 16: sub-tiles of 16)
        block_w = block_w if block_w and block_w % 16 == 0 else TILE_PAGES
    block_w = block_w or (16 if R else max(1, min(16, 8192 // (ps * BLOCK_D))) if bits
                          else max(16, min(64, 8192 // BLOCK_D)))
    TILE = max(16, min(MAX_TILE, triton.next_power_of_2(W)))
    chunks = triton.cdiv(W, block_w)
    splits = num_splits or _default_splits(q, B * Hkv, chunks)
    splits = max(1, min(splits, chunks))
    cps = triton.cdiv(chunks, splits)
    splits = triton.cdiv(chunks, cps)
    xs = torch.empty(B, Hkv, G, W, dtype=torch.float32, device=dev) if scores_out is None \
        else scores_out  # scaled per-head bounds (log2 units)
    assert xs.shape == (B, Hkv, G, W) and xs.dtype == torch.float32 and xs.stride(3) == 1
    ml = torch.empty(B, Hkv, splits, 2 * GP, dtype=torch.float32, device=dev)  # split partials
    keys = torch.empty(B, Hkv, W if TILE < W else 1, dtype=torch.int32, device=dev)
    sel_warps = num_warps or (4 if TILE <= 1024 else 8 if TILE <= 4096 else 16)
    cd = (sparq_rec if rec_kind else codes) if bits else page_table  # any int32 when unused
    mean = kmean if R else kmin
    ch = chan if R else page_table
    ks = kscale.reshape(-1) if kscale is not None else kmin
    args = (q, kmin, kmax, cd, mean, ch, ks, page_table, num_pages, xs, ml, keys, out_pages,
            out_blocks, out_num, q.stride(0), q.stride(1), kmin.stride(0), kmax.stride(0),
            cd.stride(0), mean.stride(0), ch.stride(0), page_table.stride(0),
            page_table.stride(1), num_pages.stride(0), xs.stride(0), xs.stride(1), xs.stride(2),
            ml.stride(0), ml.stride(1), keys.stride(0), keys.stride(1),
            out_pages.stride(0), out_pages.stride(1), out_blocks.stride(0), out_blocks.stride(1),
            out_num.stride(0), W, k_top, k_out, sink_pages, local_pages, cps, splits,
            D ** -0.5 * LOG2E, MAGIC_F32)
    asm = (SPARQ_ASM if sparq_asm is None else sparq_asm) and q.is_cuda and ps == 32 \
        and kmax.dtype == torch.bfloat16
    meta = dict(NSUB=n_sub, BITS=bits, PS=ps, R=R, INT8_MEAN=kscale is not None, SPARQ=version,
                G=G, GP=GP, D=D, BLOCK_W=block_w, BLOCK_D=BLOCK_D,
                BLOCK_S=triton.next_power_of_2(splits), TILE=TILE, ONE_TILE=TILE >= W,
                BLOCK_K=triton.next_power_of_2(k_out),
                # fp32 summaries: exact products (no TF32); 16-bit operands multiply exactly
                # on the tensor cores whatever the setting
                DOT_PREC="ieee" if kmax.dtype == torch.float32 else "tf32",
                ASM=bool(asm), FAST=q.is_cuda,  # FAST: lg2.approx (not in the interpreter)
                BCS=kmin.stride(1), CCS=codes.stride(1) if sparq else 1, REC=rec_kind)
    if splits == 1:
        _page_select_kernel[(B, Hkv, 1)](*args, **meta, DO_SCORE=True, DO_SELECT=True,
                                         NW=sel_warps, num_warps=sel_warps)
    else:
        _page_select_kernel[(B, Hkv, splits)](*args, **meta, DO_SCORE=True, DO_SELECT=False,
                                              NW=num_warps or 4, num_warps=num_warps or 4)
        _page_select_kernel[(B, Hkv, 1)](*args, **meta, DO_SCORE=False, DO_SELECT=True,
                                         NW=sel_warps, num_warps=sel_warps)
    return out_pages, out_num, out_blocks
