"""Pure-torch references for every kernel in ``sparseserve.kernels``.

Each function has the same signature and contract as its Triton counterpart and is the
specification the kernels are tested against. They are also the CPU execution path
(``sparseserve.kernels`` dispatches here for non-CUDA tensors), so they are vectorised
(no Python loops over requests or pages) and never call ``.item()``.

KV layout (one tensor per layer for K and one for V)::

    k_cache, v_cache: [num_pages, page_size, head_dim]   one page = page_size tokens of ONE KV head

GQA mapping: query head ``h * G + g`` (``G = Hq // Hkv``) reads KV head ``h``.

This file: paged decode attention (and its log-sum-exp), page summaries, sub-page rows and the
merge of attention parts. The page scores and selection live in ``ref_select.py``, the key-code
page scores in ``ref_codes.py`` / ``ref_sparq.py``; all are re-exported here.
"""
from __future__ import annotations

import torch

__all__ = ["paged_decode_attention", "paged_decode_plan", "paged_decode_planned",
           "update_page_summaries", "score_pages", "head_bounds", "sub_bounds", "sub_table", "sub_page_rows", "mass_from_bounds", "page_mass",
           "select_pages", "select_from_scores", "shortlist_mask", "shortlist_scores",
           "select_pages_shortlist", "merge_attention", "paged_decode_lse", "code_page_bounds",
           "channel_code_page_bounds", "SCORE_MODES"]


def _valid_token_mask(num_pages: torch.Tensor, last_page_len: torch.Tensor, W: int, page_size: int):
    """[B, Hkv, W, page_size] bool: token t of entry w of (b, h) is attended."""
    dev = num_pages.device
    w = torch.arange(W, device=dev).view(1, 1, W, 1)
    t = torch.arange(page_size, device=dev).view(1, 1, 1, page_size)
    n = num_pages.to(torch.long).unsqueeze(-1).unsqueeze(-1)          # [B, Hkv, 1, 1]
    last = last_page_len.to(torch.long).view(-1, 1, 1, 1)             # [B, 1, 1, 1]
    return (w < n) & ((w < n - 1) | (t < last))


def paged_decode_attention(q, k_cache, v_cache, page_table, num_pages, last_page_len, scale,
                           out=None):
    """Decode attention (one query token per request) over a list of KV pages per KV head.

    Args:
        q:             [B, Hq, D]          one decode query per request, Hq = Hkv * G
        k_cache:       [P, page_size, D]   physical K pages of this layer
        v_cache:       [P, page_size, D]   physical V pages of this layer
        page_table:    [B, Hkv, W] int32   physical page ids to attend, any order, except that the
                                           request's partial last page, if included, is entry
                                           ``num_pages[b, h] - 1``; entries >= num_pages are ignored
        num_pages:     [B, Hkv] int32      valid entries of page_table[b, h] (>= 1)
        last_page_len: [B] int32           tokens valid in entry num_pages[b, h] - 1 (1..page_size);
                                           all other valid entries are full pages
        scale:         float               softmax scale (usually D ** -0.5)
        out:           [B, Hq, D] or None  written in place if given
    Returns:
        out: [B, Hq, D] in q's dtype = softmax(scale * q K^T) V over the selected tokens,
        computed in fp32.
    """
    plan = paged_decode_plan(page_table, num_pages, last_page_len, k_cache.shape[1])
    return paged_decode_planned(q, k_cache, v_cache, plan, scale, out)


def paged_decode_plan(page_table, num_pages, last_page_len, page_size):
    """The layer-independent part of ``paged_decode_attention`` (which tokens are attended):
    computed once per step and passed to ``paged_decode_planned`` by every layer.

    Returns (ids [B * Hkv * W] int64 page to read per entry (0 past num_pages),
    drop_s [B, Hkv, 1, W * page_size] bool (tokens not attended), drop_v [B, Hkv, W *
    page_size, 1] bool (its transpose), B, Hkv, W)."""
    B, Hkv, W = page_table.shape
    valid = _valid_token_mask(num_pages, last_page_len, W, page_size)          # [B, Hkv, W, ps]
    ids = torch.where(valid[..., 0], page_table.to(torch.long), 0).reshape(-1)  # [B*Hkv*W]
    drop = ~valid.reshape(B, Hkv, 1, W * page_size)
    return ids, drop, drop.transpose(-1, -2), B, Hkv, W


def paged_decode_planned(q, k_cache, v_cache, plan, scale, out=None):
    """``paged_decode_attention`` with its ``paged_decode_plan`` precomputed: a dozen ops."""
    ids, drop_s, drop_v, B, Hkv, W = plan
    Hq, D = q.shape[1], q.shape[2]
    N = W * k_cache.shape[1]
    k = k_cache.index_select(0, ids)                                           # [B*Hkv*W, ps, D]
    v = v_cache.index_select(0, ids)
    if k.dtype != torch.float32:
        k, v = k.float(), v.float()
    k = k.view(B, Hkv, N, D)                                                   # [B, Hkv, N, D]
    v = v.view(B, Hkv, N, D)
    qf = q if q.dtype == torch.float32 else q.float()
    qf = qf.reshape(B, Hkv, Hq // Hkv, D)                                      # [B, Hkv, G, D]
    s = torch.matmul(qf, k.transpose(-1, -2)) * scale                          # [B, Hkv, G, N]
    p = torch.softmax(s.masked_fill_(drop_s, float("-inf")), dim=-1)
    v = v.masked_fill_(drop_v, 0.0)                             # garbage V never leaks (0 * NaN)
    o = torch.matmul(p, v).view(B, Hq, D)
    if o.dtype != q.dtype:
        o = o.to(q.dtype)
    if out is None:
        return o
    out.copy_(o)
    return out


def update_page_summaries(k_cache, page_ids, num_tokens, kmin, kmax, kradius=None,
                          box: bool = False, write_ids=None) -> None:
    """(Re)compute per-page key summaries in place.

    Args:
        k_cache:    [P, page_size, D]  K pages of this layer
        page_ids:   [N] int32          pages whose summary to compute; entries < 0 are padding
                                       and skipped; valid ids must be unique
        num_tokens: [N] int32          valid tokens in each page (1..page_size)
        kmin, kmax: [S, D]             per-channel min / max of the page's valid keys, written at
                                       row page_ids[i] (S >= P); other rows untouched
        kradius:    [N, D] or None     ArkVale cuboid radius of entry i (row i, not the page's
                                       row: a per-call buffer, so a captured step owns it):
                                       mean over valid tokens t of |c - k_t| with
                                       c = (kmin + kmax) / 2; padding entries' rows untouched
        box:        ArkVale's box [c - r, c + r] into kmin / kmax instead (no kradius): min, max
                    and r rounded to the summary dtype first, then c -/+ r in fp32
        write_ids:  [N] or None            the rows kmin / kmax of entry i go to (default:
                                           page_ids[i]); unique where page_ids >= 0
    """
    assert not (box and kradius is not None), "box writes the box itself: no radius buffer"
    page_size = k_cache.shape[1]
    keep = page_ids >= 0                                                       # [N]
    ids = page_ids[keep].to(torch.long)                                        # [N']
    rows = ids if write_ids is None else write_ids[keep].to(torch.long)        # [N']
    n = num_tokens[keep].to(torch.long)                                        # [N']
    k = k_cache[ids].float()                                                   # [N', ps, D]
    tok_ok = (torch.arange(page_size, device=k.device).view(1, -1) < n.view(-1, 1)).unsqueeze(-1)
    mn = torch.where(tok_ok, k, torch.full_like(k, float("inf"))).amin(dim=1)   # [N', D]
    mx = torch.where(tok_ok, k, torch.full_like(k, float("-inf"))).amax(dim=1)  # [N', D]
    if not box:
        kmin[rows] = mn.to(kmin.dtype)
        kmax[rows] = mx.to(kmax.dtype)
    if kradius is not None or box:
        c = (mn + mx) * 0.5
        dev = torch.where(tok_ok, (c.unsqueeze(1) - k).abs(), torch.zeros_like(k))
        r = dev.sum(dim=1) / n.view(-1, 1).float()
        if not box:
            kradius[keep] = r.to(kradius.dtype)
            return
        dt = kmin.dtype
        cb = (mn.to(dt).float() + mx.to(dt).float()) * 0.5
        rb = r.to(dt).float()
        kmin[rows] = (cb - rb).to(dt)
        kmax[rows] = (cb + rb).to(dt)


def sub_page_rows(page_ids, num_tokens, n_sub, sub_size):
    """Sub-block rows of listed pages, for indexing ``n_sub`` partitions per page with a
    page-summary kernel over a ``[P * n_sub, sub_size, D]`` view of the K pages.

    page_ids [N] int32 (< 0 = padding), num_tokens [N] int32 (1..n_sub * sub_size) ->
    (ids [N * n_sub] int32: ``page * n_sub + j``, -1 for padding and for sub-blocks without
    a valid token; ntok [N * n_sub] int32 valid tokens of each sub-block, >= 1)."""
    j = torch.arange(n_sub, device=page_ids.device).view(1, -1)
    n = num_tokens.to(torch.long).view(-1, 1)
    live = (page_ids.view(-1, 1) >= 0) & (j * sub_size < n)
    ids = torch.where(live, page_ids.to(torch.long).view(-1, 1) * n_sub + j, -1)
    ntok = (n - j * sub_size).clamp(min=1, max=sub_size)
    return ids.reshape(-1).to(torch.int32), ntok.reshape(-1).to(torch.int32)


def merge_attention(o_sel, lse_sel, o_est, lse_est):
    """Merge two attention parts by log-sum-exp: ``o = w o_sel + (1 - w) o_est`` with
    ``w = exp(lse_sel - logaddexp(lse_sel, lse_est))`` — exact when each part is a softmax-
    normalised output over disjoint token sets and lse its log-sum-exp of scaled logits.

    o_sel, o_est [B, Hq, D]; lse_sel, lse_est [B, Hq] float32 (lse_est = -inf: no estimate)
    -> [B, Hq, D] in o_sel's dtype."""
    lse = torch.logaddexp(lse_sel.float(), lse_est.float())
    w = torch.exp(lse_sel.float() - lse).nan_to_num(1.0).unsqueeze(-1)
    o = w * o_sel.float() + (1.0 - w) * o_est.float().nan_to_num(0.0)
    return o.to(o_sel.dtype)


def paged_decode_lse(q, k_cache, page_table, num_pages, last_page_len, scale):
    """[B, Hq] float32 log-sum-exp of ``scale * q·k`` over the tokens ``paged_decode_attention``
    attends (same arguments): the exact part's weight when an estimate is merged."""
    B, Hq, D = q.shape
    _, Hkv, W = page_table.shape
    page_size = k_cache.shape[1]
    valid = _valid_token_mask(num_pages, last_page_len, W, page_size)
    ids = torch.where(valid[..., 0], page_table.to(torch.long), 0)
    k = k_cache[ids].float().reshape(B, Hkv, W * page_size, D)
    s = torch.einsum("bhgd,bhnd->bhgn", q.float().view(B, Hkv, Hq // Hkv, D), k) * scale
    s = s.masked_fill(~valid.reshape(B, Hkv, 1, W * page_size), float("-inf"))
    return torch.logsumexp(s, dim=-1).reshape(B, Hq)


# the key-code page scores live in ref_codes.py, the page scores and selection in
# ref_select.py (this file stays one page per topic)
from .ref_codes import channel_code_page_bounds, code_page_bounds  # noqa: E402,F401
from .ref_select import (SCORE_MODES, head_bounds, mass_from_bounds, page_mass,  # noqa: E402,F401
                         score_pages, select_from_scores, select_pages, select_pages_shortlist,
                         shortlist_mask, shortlist_scores, sub_bounds, sub_table)
from .ref_sparq import sparq_channels, sparq_page_bounds  # noqa: E402,F401
