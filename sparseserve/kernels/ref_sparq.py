"""Pure-torch references of the SparQ-style key-code select (``sparse/keycode_sparq.py``): the
specifications of ``sparq_codes.sparq_channels`` and ``sparq_codes.sparq_page_bounds`` (and of
``page_select.select_pages(..., sparq_chan=)`` through ``ref.select_pages``), re-exported by
``kernels.ref`` (same conventions: vectorised, no ``.item()``, the CPU execution path).

Summaries per page (``S`` rows, channel-major codes so that a select reads the codes of the
channels it chose and no others):

* ``kmin``, ``kmax`` [S, D]: keycode2's min/max box per channel (the codes' range);
* ``codes`` [S, D * page_size / 16] int32: the 2-bit code of (channel c, token t) at bits
  ``2 * (t % 16)`` of word ``c * page_size / 16 + t // 16`` (channel c's page_size codes are
  ``page_size / 16`` consecutive words);
* ``kmean`` [S, D] (int8 with ``kscale`` [S, 1]: the page mean is ``kmean * kscale``).

The default layout packs a page's ``kmin``, ``kmax`` and codes per channel into 16-byte records
(``sparq_records.py``); its ``record_views`` are strided views of the records in these shapes
(``codes`` as [S, D, page_size / 16]), which every function here takes as they are.
"""
from __future__ import annotations

import torch


def unpack_channel_codes(words: torch.Tensor) -> torch.Tensor:
    """[..., nw] int32 words of one channel -> [..., nw * 16] int64 2-bit codes (token order)."""
    shift = torch.arange(16, device=words.device) * 2
    w = words.to(torch.int64) & 0xFFFFFFFF
    return ((w.unsqueeze(-1) >> shift) & 3).flatten(-2)


def channel_major(codes: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[S, D, page_size / 16] view of channel-major codes given as [S, D * page_size / 16]
    (the first layout's rows) or already as [S, D, page_size / 16] (a record view)."""
    return codes if codes.dim() == 3 else codes.view(codes.shape[0], head_dim, -1)


def sparq_channels(q, kmin, kmax, page_table, num_pages, channels):
    """The R channels each (request, KV head) row decodes: the largest
    ``sum_g |q_gc| * width_c``, ``width_c`` = ``kmax - kmin`` of channel c summed over the row's
    full pages before its last (entries ``w < num_pages - 1``; the last page may be partial).

    Args:
        q:          [B, Hq, D]         decode queries, Hq = Hkv * G
        kmin, kmax: [S, D]             the pages' boxes
        page_table: [B, Hkv, W] int32, num_pages [B, Hkv] int32
        channels:   R (<= D)
    Returns:
        [B, Hkv, R] int32 channel ids, by decreasing weight (ties: the lower channel first).
    """
    B, Hq, D = q.shape
    _, Hkv, W = page_table.shape
    ok = torch.arange(W, device=q.device).view(1, 1, W) < num_pages.long().unsqueeze(-1) - 1
    ids = torch.where(ok, page_table.long(), 0)
    wid = kmax[ids].float() - kmin[ids].float()                             # [B, Hkv, W, D]
    width = torch.where(ok.unsqueeze(-1), wid, 0.0).sum(2)                   # [B, Hkv, D]
    weight = q.float().view(B, Hkv, Hq // Hkv, D).abs().sum(2) * width
    order = torch.sort(weight, dim=-1, descending=True, stable=True).indices
    return order[..., :channels].to(torch.int32)


def sparq_page_bounds(q, kmean, kscale, kmin, kmax, codes, chosen, page_table, num_pages,
                      out=None):
    """Per-query-head page scores of the SparQ-style key codes: log-sum-exp over a page's
    tokens of the approximate logits, in bound units (``mass_from_bounds`` of it is the
    approximate token attention mass per page).

    Token t's approximate logit for head g is ``q_g . mean + q_g[R] . (k^_t[R] - mean[R])``
    with ``R`` = ``chosen`` (the row's channels, ``sparq_channels``), ``mean`` the page mean and
    ``k^ = kmin + (kmax - kmin) * (code + 0.5) / 4`` keycode2's decoded key.

    Args:
        q:          [B, Hq, D]            decode queries, Hq = Hkv * G
        kmean:      [S, D]                page means (int8 with kscale [S, 1], else any float)
        kmin, kmax: [S, D]                the codes' range per channel
        codes:      [S, D * page_size / 16] or [S, D, page_size / 16] int32, channel-major
                    (module docstring)
        chosen:     [B, Hkv, R] int       each row's decoded channels
        page_table: [B, Hkv, W] int32, num_pages [B, Hkv] int32
    Returns:
        [B, Hkv, G, W] float32: ``logsumexp_t(scale * x_gt) / scale``, ``scale = D ** -0.5``;
        -inf past num_pages.
    """
    B, Hq, D = q.shape
    _, Hkv, W = page_table.shape
    G, R = Hq // Hkv, chosen.shape[-1]
    ok = torch.arange(W, device=q.device).view(1, 1, W) < num_pages.long().unsqueeze(-1)
    ids = torch.where(ok, page_table.long(), 0)                              # [B, Hkv, W]
    mean = kmean[ids].float()                                                # [B, Hkv, W, D]
    if kscale is not None:
        mean = mean * kscale[ids].float()
    ch = chosen.long().unsqueeze(2).expand(B, Hkv, W, R)                     # [B, Hkv, W, R]
    rows = ids.unsqueeze(-1)
    lo, hi = kmin[rows, ch].float(), kmax[rows, ch].float()                  # [B, Hkv, W, R]
    lev = (unpack_channel_codes(channel_major(codes, D)[rows, ch]).float() + 0.5) / 4
    dev = lo.unsqueeze(-1) + (hi - lo).unsqueeze(-1) * lev - mean.gather(-1, ch).unsqueeze(-1)
    qf = q.float().view(B, Hkv, G, D)
    base = torch.einsum("bhgd,bhwd->bhgw", qf, mean)
    qc = qf.gather(-1, chosen.long().unsqueeze(2).expand(B, Hkv, G, R))      # [B, Hkv, G, R]
    scale = D ** -0.5
    x = (base.unsqueeze(-1) + torch.einsum("bhgr,bhwrt->bhgwt", qc, dev)) * scale
    s = (torch.logsumexp(x, dim=-1) / scale).masked_fill(~ok.unsqueeze(2), float("-inf"))
    if out is None:
        return s
    out.copy_(s)
    return out
