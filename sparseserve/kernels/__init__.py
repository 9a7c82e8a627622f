"""Kernels: leaves that take tensors and ints, never engine objects.

Each kernel has a Triton implementation (``paged_decode``, ``page_summary``, ``page_scores``,
``page_select``) and a pure-torch reference with the same contract in ``ref``. The functions here
dispatch:

* ``backend=None`` / ``"auto"``: Triton for CUDA tensors, the torch reference otherwise (the CPU
  engine path; Triton's interpreter is far too slow to serve with) -- except paged decode
  attention, whose CPU path is ``paged_decode_cpu`` (the reference's contract, fewer bytes).
* ``"triton"``: always Triton (on CPU tensors this needs ``TRITON_INTERPRET=1`` set before
  triton is first imported; tests/conftest.py does that).
* ``"torch"``: always the reference.

Quest/ArkVale's page scores are estimated attention masses: ``head_bounds`` (per query head)
then ``ref.mass_from_bounds`` (torch, fixed shapes) on the generic path; ``select_pages`` does
both inside one fused kernel.

Triton modules are imported lazily, so importing this package never imports triton.
All kernels run with fixed shapes and no host synchronisation (CUDA-graph capturable).
"""
from __future__ import annotations

import os

import torch

from . import ref

__all__ = ["paged_decode_attention", "update_page_summaries", "score_pages", "head_bounds",
           "select_pages", "select_pages_shortlist", "code_page_bounds",
           "channel_code_page_bounds", "channel_codes_supported", "sparq_channels",
           "sparq_page_bounds", "sparq_supported", "resolve_backend",
           "patch_triton_interpreter", "BACKENDS", "SCORE_MODES", "ref"]

BACKENDS = ("auto", "triton", "torch")
SCORE_MODES = ref.SCORE_MODES


def patch_triton_interpreter() -> None:
    """Make Triton's interpreter (TRITON_INTERPRET=1) work with NumPy >= 2.4.

    Triton 3.6's interpreter converts scalars (1-element arrays) to Python ints with
    ``int(array)``, which NumPy 2.4 rejects, so any loop with a run-time bound fails
    (triton-lang/triton#9171, fixed upstream after 3.6). We re-register ``__index__`` with an
    explicit element read. No-op outside interpreter mode; idempotent. Called by each Triton
    kernel module at import.
    """
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    from triton.runtime import interpreter as _interp

    orig = getattr(_interp, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_sparseserve_fixed", False):
        return

    def _patch_lang_tensor(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _patch_lang_tensor._sparseserve_fixed = True
    _interp._patch_lang_tensor = _patch_lang_tensor


def resolve_backend(backend, tensor) -> str:
    """'triton' or 'torch' for a kernel call whose main input is ``tensor``."""
    if backend is None or backend == "auto":
        return "triton" if tensor.is_cuda else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {BACKENDS}")
    return backend


def paged_decode_attention(q, k_cache, v_cache, page_table, num_pages, last_page_len, scale,
                           out=None, *, backend=None, num_splits=None):
    """Paged decode attention; see ``paged_decode.paged_decode_attention`` for the contract.

    q [B, Hq, D], k_cache/v_cache [P, page_size, D], page_table [B, Hkv, W] int32,
    num_pages [B, Hkv] int32, last_page_len [B] int32 -> out [B, Hq, D] (q's dtype).
    ``num_splits`` (Triton only) overrides the split-K choice, which by default depends on W only.
    """
    if backend in (None, "auto") and not q.is_cuda:  # the CPU engine path: fewer bytes moved
        from .paged_decode_cpu import paged_decode_attention as _cpu
        return _cpu(q, k_cache, v_cache, page_table, num_pages, last_page_len, scale, out)
    if resolve_backend(backend, q) == "torch":
        return ref.paged_decode_attention(q, k_cache, v_cache, page_table, num_pages,
                                          last_page_len, scale, out)
    from .paged_decode import paged_decode_attention as _triton
    return _triton(q, k_cache, v_cache, page_table, num_pages, last_page_len, scale, out,
                   num_splits=num_splits)


def update_page_summaries(k_cache, page_ids, num_tokens, kmin, kmax, kradius=None, *,
                          box: bool = False, write_ids=None, backend=None) -> None:
    """In-place page summaries; see ``page_summary.update_page_summaries``.

    k_cache [P, page_size, D], page_ids [N] int32 (< 0 = skip), num_tokens [N] int32,
    kmin/kmax [S, D] (written at row page_ids[i], or write_ids[i] [N] when given), kradius
    [N, D] (written at row i); box: ArkVale's box [c - r, c + r] into kmin / kmax instead
    (no kradius).
    """
    if resolve_backend(backend, k_cache) == "torch":
        return ref.update_page_summaries(k_cache, page_ids, num_tokens, kmin, kmax, kradius,
                                         box=box, write_ids=write_ids)
    from .page_summary import update_page_summaries as _triton
    return _triton(k_cache, page_ids, num_tokens, kmin, kmax, kradius, box=box,
                   write_ids=write_ids)


def score_pages(q, kmin, kmax, kradius, page_table, num_pages, mode, out=None, *, backend=None,
                per_head=False):
    """Page upper bounds from summaries, summed over the GQA group; see
    ``page_scores.score_pages``.

    q [B, Hq, D], kmin/kmax/kradius [S, D], page_table [B, Hkv, W] int32, num_pages [B, Hkv]
    int32, mode "quest" | "arkvale" -> scores [B, Hkv, W] float32 (-inf past num_pages);
    ``per_head``: [B, Hkv, G, W], each query head's bound.
    """
    if resolve_backend(backend, q) == "torch":
        return ref.score_pages(q, kmin, kmax, kradius, page_table, num_pages, mode, out,
                               per_head)
    from .page_scores import score_pages as _triton
    return _triton(q, kmin, kmax, kradius, page_table, num_pages, mode, out, per_head)


def head_bounds(q, kmin, kmax, page_table, num_pages, *, backend=None, n_sub=1):
    """Per-query-head page bounds (the input of Quest/ArkVale's mass scoring,
    ``ref.mass_from_bounds``); see ``ref.head_bounds``. Triton: ``page_scores`` per head
    (over the sub-block rows when a page holds ``n_sub`` boxes, then the max per page).

    q [B, Hq, D], kmin/kmax [S, n_sub * D], page_table [B, Hkv, W] int32, num_pages [B, Hkv]
    int32 -> [B, Hkv, G, W] float32 (-inf past num_pages).
    """
    if resolve_backend(backend, q) == "torch":
        return ref.head_bounds(q, kmin, kmax, page_table, num_pages, n_sub)
    from .page_scores import score_pages as _triton
    if n_sub == 1:
        return _triton(q, kmin, kmax, None, page_table, num_pages, "quest", per_head=True)
    D = q.shape[-1]
    B, Hkv, W = page_table.shape
    u = _triton(q, kmin.view(-1, D), kmax.view(-1, D), None,
                ref.sub_table(page_table, num_pages, n_sub), (num_pages * n_sub).to(torch.int32),
                "quest", per_head=True)
    return u.view(B, Hkv, -1, W, n_sub).amax(dim=-1)


def select_pages(q, kmin, kmax, page_table, num_pages, last_page_len, budget_pages, sink_pages,
                 local_pages, out_pages=None, out_num=None, out_blocks=None, *, backend=None,
                 num_splits=None, num_warps=None, n_sub=1, codes=None, bits=0, kmean=None,
                 chan=None, kscale=None, sparq_chan=None, sparq_kernel=None, sparq_asm=None,
                 sparq_rec=None, rec_interleave=1):
    """Fused Quest/ArkVale selection (score + kept pages + top-k); see
    ``page_select.select_pages``.

    q [B, Hq, D], kmin/kmax [S, n_sub * D] (``n_sub`` boxes per page: a page's bound is the
    max of its boxes'), page_table [B, Hkv, W] int32, num_pages [B, Hkv] int32,
    last_page_len [B] int32 -> pages [B, Hkv, K] int32, num_sel [B, Hkv] int32,
    blocks [B, Hkv, K] int64 with K = max(1, min(budget_pages - 1, W)) + 1.
    ``num_splits`` (Triton only): score programs per (request, KV head); 1 = one launch.
    ``num_warps`` (Triton only): warps per program of both launches (None: by width).
    ``codes``, ``bits`` > 0: token key codes score the pages (``ref.code_page_bounds``).
    ``kmean``, ``chan``, ``kscale`` with ``codes``: channel key codes score them
    (``ref.channel_code_page_bounds``; kmin / kmax are the coded channels' ranges).
    ``sparq_chan`` [B, Hkv, R] with ``codes`` (channel-major), ``kmean``, ``kscale``: each row
    decodes its R channels of every page (``ref.sparq_page_bounds``; kmin / kmax [S, D]);
    ``sparq_kernel`` / ``sparq_asm`` (Triton only) pick its score phase's version;
    ``sparq_rec``: the records kmin / kmax / codes are views of (``sparq_records``; Triton
    reads them whole), ``rec_interleave`` (Triton only) their interleave.
    """
    cc = dict(kmean=kmean, chan=chan, kscale=kscale, sparq_chan=sparq_chan)
    if chan is not None and not channel_codes_supported(kmin.shape[-1], q.shape[-1]):
        backend = "torch"  # too few coded channels for the kernel
    if sparq_chan is not None and not sparq_supported(sparq_chan.shape[-1], q.shape[-1],
                                                      codes[0].numel()):
        backend = "torch"
    if resolve_backend(backend, q) == "torch":
        if rec_interleave != 1:
            raise ValueError("select_pages: the reference reads records in their rows "
                             "(de-interleave them: KeyCodeSparQ.views)")
        return ref.select_pages(q, kmin, kmax, page_table, num_pages, last_page_len,
                                budget_pages, sink_pages, local_pages, out_pages, out_num,
                                out_blocks, n_sub=n_sub, codes=codes, bits=bits, **cc)
    from .page_select import select_pages as _triton
    return _triton(q, kmin, kmax, page_table, num_pages, last_page_len, budget_pages,
                   sink_pages, local_pages, out_pages, out_num, out_blocks, num_splits=num_splits,
                   num_warps=num_warps, n_sub=n_sub, codes=codes, bits=bits, sparq_kernel=sparq_kernel,
                   sparq_asm=sparq_asm, sparq_rec=sparq_rec, rec_interleave=rec_interleave,
                   **cc)


def code_page_bounds(q, kmin, kmax, codes, page_table, num_pages, bits, out=None, *,
                     backend=None):
    """Per-query-head page scores from token key codes (log-sum-exp of the approximate
    logits, in bound units); see ``ref.code_page_bounds``. Triton: ``code_scores``.

    q [B, Hq, D], kmin/kmax [S, D], codes [S, page_size * D * bits / 32] int32,
    page_table [B, Hkv, W] int32, num_pages [B, Hkv] int32 -> [B, Hkv, G, W] float32."""
    if resolve_backend(backend, q) == "torch":
        return ref.code_page_bounds(q, kmin, kmax, codes, page_table, num_pages, bits, out)
    from .code_scores import code_page_bounds as _triton
    return _triton(q, kmin, kmax, codes, page_table, num_pages, bits, out)


def channel_codes_supported(R: int, D: int) -> bool:
    """Whether the Triton channel-code kernels take R coded channels of head_dim D (the dot's
    K dimension: a power of two >= 16); otherwise the torch reference runs, on any device."""
    return R >= 16 and R & (R - 1) == 0 and D >= 16


def channel_code_page_bounds(q, kmean, klo, khi, chan, codes, page_table, num_pages, kscale=None,
                             out=None, *, backend=None):
    """Per-query-head page scores from key codes on a few channels per page (log-sum-exp of
    the approximate logits, in bound units); see ``ref.channel_code_page_bounds``. Triton:
    ``channel_codes`` (where it takes the coded channel count; the reference otherwise).

    q [B, Hq, D], kmean [S, D] (int8 with kscale [S, 1]), klo/khi [S, R], chan [S, R / 4]
    int32, codes [S, page_size * R / 16] int32, page_table [B, Hkv, W] int32,
    num_pages [B, Hkv] int32 -> [B, Hkv, G, W] float32."""
    args = (q, kmean, klo, khi, chan, codes, page_table, num_pages, kscale, out)
    if resolve_backend(backend, q) == "torch":
        return ref.channel_code_page_bounds(*args)
    if not channel_codes_supported(klo.shape[1], q.shape[2]):
        return ref.channel_code_page_bounds(*args)
    from .channel_codes import channel_code_page_bounds as _triton
    return _triton(*args)


def sparq_supported(R: int, D: int, code_words: int) -> bool:
    """Whether the Triton SparQ-style score kernels take R decoded channels of head_dim D with
    ``code_words`` words of channel-major codes per page (page_size a power of two >= 16;
    ``codes[0].numel()`` of either layout's codes)."""
    ps = code_words * 16 // D
    return channel_codes_supported(R, D) and ps * D == code_words * 16 and ps >= 16 \
        and ps & (ps - 1) == 0


def sparq_channels(q, kmin, kmax, wsum, page_table, num_pages, channels, *, backend=None,
                   rec_interleave=1):
    """The R channels each (request, KV head) row decodes in the SparQ-style key-code select;
    see ``ref.sparq_channels``. Triton (``sparq_codes``) reads and updates the per-page width
    sums ``wsum`` [S, D] fp32 (kmin / kmax / wsum may be record views, ``sparq_records``);
    the reference recomputes them (``wsum`` unused).

    q [B, Hq, D], kmin/kmax [S, D], page_table [B, Hkv, W] int32, num_pages [B, Hkv] int32
    -> [B, Hkv, R] int32. ``rec_interleave`` > 1 (Triton only): the views are of records
    interleaved in chunks of that many pages (``sparq_records.interleave``)."""
    if resolve_backend(backend, q) == "torch":
        if rec_interleave != 1:
            raise ValueError("sparq_channels: the reference reads records in their rows "
                             "(de-interleave them: KeyCodeSparQ.views)")
        return ref.sparq_channels(q, kmin, kmax, page_table, num_pages, channels)
    from .sparq_codes import sparq_channels as _triton
    return _triton(q, kmin, kmax, wsum, page_table, num_pages, channels,
                   rec_interleave=rec_interleave)


def sparq_page_bounds(q, kmean, kscale, kmin, kmax, codes, chosen, page_table, num_pages,
                      out=None, *, backend=None):
    """Per-query-head page scores of the SparQ-style key codes (log-sum-exp of the
    approximate logits, in bound units); see ``ref.sparq_page_bounds``. Triton:
    ``sparq_codes`` (where ``sparq_supported``; the reference otherwise).

    q [B, Hq, D], kmean [S, D] (int8 with kscale [S, 1]), kmin/kmax [S, D], codes
    [S, D * page_size / 16] or [S, D, page_size / 16] int32 channel-major (or record views),
    chosen [B, Hkv, R], page_table [B, Hkv, W] int32, num_pages [B, Hkv] int32
    -> [B, Hkv, G, W] float32."""
    args = (q, kmean, kscale, kmin, kmax, codes, chosen, page_table, num_pages, out)
    if resolve_backend(backend, q) == "torch" or not sparq_supported(
            chosen.shape[-1], q.shape[-1], codes[0].numel()):
        return ref.sparq_page_bounds(*args)
    from .sparq_codes import sparq_page_bounds as _triton
    return _triton(*args)


def select_pages_shortlist(q, kmin, kmax, codes, page_table, num_pages, last_page_len,
                           budget_pages, shortlist_pages, sink_pages, local_pages, bits, *,
                           backend=None, num_splits=None):
    """Key-code shortlist selection: box mass of every page -> ``shortlist_pages`` pages ->
    key codes of those alone -> ``budget_pages`` (two ``select_pages`` calls and a gather;
    see ``shortlist.select_pages_shortlist``, spec ``ref.select_pages_shortlist``). Both
    stages run on ``backend`` (Triton for CUDA tensors by default, the reference otherwise).
    Returns pages [B, Hkv, K] int32, num_sel [B, Hkv] int32, blocks [B, Hkv, K] int64 with
    K = max(1, min(budget_pages - 1, W)) + 1."""
    from .shortlist import select_pages_shortlist as _two_stage
    return _two_stage(q, kmin, kmax, codes, page_table, num_pages, last_page_len, budget_pages,
                      shortlist_pages, sink_pages, local_pages, bits, backend=backend,
                      num_splits=num_splits)
