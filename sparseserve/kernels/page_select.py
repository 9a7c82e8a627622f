"""Fused page selection by estimated attention mass, the host side: ``select_pages`` checks
and normalises its arguments, picks the score path (box bounds, token / channel / SparQ key
codes) and the tuning (fused or split mode, tile and block sizes, warps) and launches the
kernel of ``page_select_kernel`` (the algorithm is described there) once or twice.
``ref.select_pages`` / ``ref.mass_from_bounds`` are the spec."""
from __future__ import annotations

import functools
import os
import warnings

import torch
import triton

from .page_select_kernel import _page_select_kernel
from .ref_sparq import channel_major
from .sparq_lanes import LANE_PAGES, lanes_supported
from .sparq_records import rec_kind as rec_kind_of
from .sparq_stream import STREAM_PAGES
from .sparq_tiles import MAGIC_F32, SPARQ_ASM, SPARQ_KERNEL, TILE_PAGES

__all__ = ["select_pages", "MAX_TILE"]

MAX_TILE = 8192  # widest key row held in registers (32 int32 per thread at 8 warps)
# Untuned defaults (no GPU was at hand when written); None = the heuristics in select_pages.
# Set here or by environment to sweep them without code changes.
NUM_SPLITS = int(os.environ.get("SPARSESERVE_SELECT_SPLITS", 0)) or None
BLOCK_W = int(os.environ.get("SPARSESERVE_SELECT_BLOCK_W", 0)) or None
NUM_WARPS = int(os.environ.get("SPARSESERVE_SELECT_WARPS", 0)) or None
SPLIT_PROGRAMS_PER_SM = 2  # split mode until rows alone give this many programs per SM
# sparq_stream's programs hold 16-page tiles (128 registers: 4 programs of 4 warps an SM); it
# is latency-bound, so more programs than fit at once keep every SM's slots busy to the end:
# at 128k x 16 on the H100 its score launch took 343 us at 5 splits (4 a SM), 258 at 12, 261
# at 24, 272 at 64 (sparse.md, twenty-first session)
STREAM_PROGRAMS_PER_SM = 12
# sparq_kernel=4: sparq_stream's loop in split programs of LEAN_WARPS warps (8 pages a warp and
# iteration instead of 4). Its page-term dots ([16, D] x [D, GP], N = 4) are computed by every
# warp of a program (an mma tile is 16 rows, the sub-tile 16 pages), so halving the warps
# halves that redundancy: offline SASS at 128k x 16 (benchmarks/select_occupancy.py
# --sass-stats, sm_90), 153 warp-instructions per page against 186 at 4 warps, the same 7
# BAR.SYNC per iteration (each now waits on 2 warps, not 4), 168 registers, no spills, 6
# programs (12 warps) per SM instead of 4 x 4. Page terms without tl.dot (broadcast-multiply
# + tl.sum) measured worse offline: Triton's default layouts put those loads' warps off the
# page axis, and the conversions back cost 11-26 barriers. On the H200 at 128k x 16 its score
# launch took 246.0 us against the stream's 259.8 (sparse.md, twenty-fourth session; measured
# once: the default stays 3)
LEAN_WARPS = 2
# sparq_kernel=5 (sparq_lanes): warps score 16-page chunks independently, 4 programs of 4
# warps an SM (128 registers); every program does the same work, so a last wave of a few
# programs costs a whole one: at 128k x 16 on the H100, 8 splits (two waves of 4 a SM)
# 138.4 us, 13 (12 programs a SM, 3.15 waves) 150.0, 16 144.3, 32 158.0 (sparse.md,
# twenty-seventh session). The most splits whose programs fit in this many per SM (two waves)
LANE_PROGRAMS_PER_SM = 8
# ... whose 4 programs of 4 warps an SM need <= 128 registers a thread: ptxas picks 142 for the
# score launch since each lane holds its chunk's 16 code words (sm_90, select_occupancy.py,
# twenty-eighth session), 3 programs an SM; capped at 128 it compiles without spills
LANE_MAXNREG = 128
# ... and only for rows of more pages than this: a short row is scored in a few us by one
# program, less than the split mode's second launch (light8 profile, fifteenth session: 2
# launches of ~9 us per layer at 160-page rows). In pages, not chunks: chunks are 16 to 64
# pages depending on the score phase
FUSED_MAX_PAGES = 256
# score programs per row at most; the select phase merges their partials in one tile of this
# size whatever the step's split count (a constexpr that followed the batch would compile a
# variant per power of two mid-serving: serving.md, twentieth session)
MAX_SPLITS = 64
CPU_SMS = 8  # the split heuristic's SM count on CPU tensors (the interpreter: fewer programs)
LOG2E = 1.4426950408889634


@functools.lru_cache(maxsize=None)
def _num_sms(index) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _default_splits(q, rows: int, chunks: int, block_w: int,
                    per_sm: int = SPLIT_PROGRAMS_PER_SM, within: bool = False) -> int:
    """Programs per row for the score phase: 1 (fused) once rows alone give ``per_sm``
    programs per SM, or when a row (``chunks`` of ``block_w`` pages) has at most
    FUSED_MAX_PAGES pages; ``per_sm * SMs / rows`` rounded up (``within``: down, so that
    programs of equal work never spill into a nearly empty extra wave)."""
    if chunks * block_w <= FUSED_MAX_PAGES:
        return 1
    sms = _num_sms(q.device.index if q.device.index is not None else torch.cuda.current_device()) \
        if q.is_cuda else CPU_SMS
    want = per_sm * sms // rows if within else triton.cdiv(per_sm * sms, rows)
    return max(1, min(chunks, want, MAX_SPLITS))


@functools.lru_cache(maxsize=None)
def _has_mma_m16n8k16(index) -> bool:
    """An NVIDIA GPU of sm_80 or later (``mma.m16n8k16``, ``cvt.rn.f16x2.f32``)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(index) >= (8, 0)


def _lanes_fit(q, rec_kind, page_size, channels, group, head_dim, kmean, rec) -> bool:
    """``sparq_lanes``' configurations (``lanes_supported``) with its 16-byte vector loads
    of the means and records aligned, on an NVIDIA GPU with ``mma.m16n8k16`` (sm_80 on; or
    Triton's interpreter, which emulates it)."""
    if q.is_cuda and not _has_mma_m16n8k16(
            q.device.index if q.device.index is not None else torch.cuda.current_device()):
        return False
    return lanes_supported(rec_kind, page_size, channels, group, head_dim) \
        and kmean.data_ptr() % 16 == 0 and kmean.stride(0) % 16 == 0 \
        and rec.data_ptr() % 16 == 0 and rec.stride(0) % 4 == 0


def select_pages(q, kmin, kmax, page_table, num_pages, last_page_len, budget_pages, sink_pages,
                 local_pages, out_pages=None, out_num=None, out_blocks=None, *, num_splits=None,
                 block_w=None, num_warps=None, n_sub=1, codes=None, bits=0, kmean=None,
                 chan=None, kscale=None, sparq_chan=None, sparq_kernel=None, sparq_asm=None,
                 sparq_rec=None, rec_interleave=1, scores_out=None):
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
        block_w, num_warps: tuning overrides (pages per score step, fixed at 16 for
                       ``sparq_stream``; warps of each launch)
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
        sparq_kernel, sparq_asm: its score phase (3: ``sparq_stream``, 4: the same with
                       ``LEAN_WARPS`` warps per split score program, 2: ``sparq_tiles``,
                       1: ``sparq_codes``, 5: ``sparq_lanes``, which runs ``sparq_stream``
                       where it does not apply: ``lanes_supported``)
                       and bf16x2 decoding in it (default: ``sparq_tiles.SPARQ_*``, by env)
        sparq_rec:     [S, D * NR] int32: the records that kmin / kmax / codes view
                       (``sparq_records``); ``sparq_tiles`` / ``sparq_stream`` then load whole
                       4-word records
        rec_interleave: pages per chunk of ``sparq_rec``'s interleaved layout
                       (``sparq_records.interleave``; 1: a page's records in its row); > 1
                       needs the whole-record path (``sparq_tiles`` / ``sparq_stream``)
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
    # the default score phase: the per-lane kernel compiled; the stream in the interpreter,
    # where the lanes' emulation is ~15x slower (CPU serving never runs these kernels)
    version = ((sparq_kernel or SPARQ_KERNEL or (5 if q.is_cuda else 3)) if sparq else 0)
    if sparq and version not in (1, 2, 3, 4, 5):
        raise ValueError(f"select_pages: sparq_kernel={version} (or SPARSESERVE_SPARQ_KERNEL) is "
                         f"not a score phase: pass 1 (sparq_codes), 2 (sparq_tiles), 3 "
                         f"(sparq_stream), 4 (sparq_stream in {LEAN_WARPS}-warp programs) or 5 "
                         f"(sparq_lanes)")
    if version == 4 and num_warps not in (None, LEAN_WARPS):
        warnings.warn(f"select_pages: num_warps={num_warps} (or SPARSESERVE_SELECT_WARPS) "
                      f"replaces sparq_kernel=4's {LEAN_WARPS} warps per score program: it runs "
                      f"as sparq_kernel=3 at that width", stacklevel=2)
    if version in (2, 3, 4, 5) and (kscale is None or ps // 16 not in (1, 2, 4)):
        version = 1  # sparq_tiles / sparq_stream: int8 means, 16 to 64 tokens a page
    # whole-record loads: sparq_tiles / _stream with 4-word records (else their strided views)
    rec_kind = rec_kind if version >= 2 and rec_kind and sparq_rec.shape[1] == 4 * D else 0
    if version == 5 and not _lanes_fit(q, rec_kind, ps, R, Hq // Hkv, D, kmean, sparq_rec):
        if sparq_kernel == 5 or SPARQ_KERNEL == 5:  # asked for (not the default's choice)
            warnings.warn(f"select_pages: sparq_kernel=5 (sparq_lanes) covers 4-word records "
                          f"with a 16-bit box, page 32, 16 channels, GQA groups <= 4 and "
                          f"head_dim 64 / 128 on 16-byte aligned means, on sm_80 or later; "
                          f"this call (page {ps}, {R} channels, group {Hq // Hkv}, head_dim "
                          f"{D}) runs sparq_stream (3)", stacklevel=2)
        version = 3
    if rec_interleave != 1 and not rec_kind:
        raise ValueError(f"select_pages: rec_interleave={rec_interleave} needs 4-word records "
                         f"read whole (sparq_rec with sparq_kernel 2-5, int8 means, page 16-64)")
    if version == 2:  # chunks of TILE_PAGES pages (a multiple of 16: sub-tiles of 16)
        block_w = block_w if block_w and block_w % 16 == 0 else TILE_PAGES
    elif version in (3, 4, 5):  # a fixed step: one sub-tile an iteration (5: a warp's chunk)
        step, name = (LANE_PAGES, "sparq_lanes") if version == 5 else (STREAM_PAGES,
                                                                        "sparq_stream")
        if block_w not in (None, step):
            warnings.warn(f"select_pages: block_w={block_w} (or SPARSESERVE_SELECT_BLOCK_W) does "
                          f"nothing for {name} (sparq_kernel={version}), whose step is "
                          f"{step} pages; pass sparq_kernel=2 to sweep it", stacklevel=2)
        block_w = step
    block_w = block_w or (16 if R else max(1, min(16, 8192 // (ps * BLOCK_D))) if bits
                          else max(16, min(64, 8192 // BLOCK_D)))
    TILE = max(16, min(MAX_TILE, triton.next_power_of_2(W)))
    chunks = triton.cdiv(W, block_w)
    splits = num_splits or _default_splits(
        q, B * Hkv, chunks, block_w,
        STREAM_PROGRAMS_PER_SM if version in (3, 4) else LANE_PROGRAMS_PER_SM if version == 5
        else SPLIT_PROGRAMS_PER_SM, within=version == 5)
    splits = max(1, min(splits, chunks, MAX_SPLITS))
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
                BLOCK_S=MAX_SPLITS, TILE=TILE, ONE_TILE=TILE >= W,
                BLOCK_K=triton.next_power_of_2(k_out),
                # fp32 summaries: exact products (no TF32); 16-bit operands multiply exactly
                # on the tensor cores whatever the setting
                DOT_PREC="ieee" if kmax.dtype == torch.float32 else "tf32",
                ASM=bool(asm), FAST=q.is_cuda,  # FAST: lg2.approx (not in the interpreter)
                BCS=kmin.stride(1), CCS=codes.stride(1) if sparq else 1, REC=rec_kind,
                RI=rec_interleave)
    if splits == 1:
        _page_select_kernel[(B, Hkv, 1)](*args, **meta, DO_SCORE=True, DO_SELECT=True,
                                         NW=sel_warps, num_warps=sel_warps)
    else:
        score_warps = num_warps or (LEAN_WARPS if version == 4 else 4)
        cap = dict(maxnreg=LANE_MAXNREG) if version == 5 and q.is_cuda else {}
        _page_select_kernel[(B, Hkv, splits)](*args, **meta, DO_SCORE=True, DO_SELECT=False,
                                              NW=score_warps, num_warps=score_warps, **cap)
        _page_select_kernel[(B, Hkv, 1)](*args, **meta, DO_SCORE=False, DO_SELECT=True,
                                         NW=sel_warps, num_warps=sel_warps)
    return out_pages, out_num, out_blocks
