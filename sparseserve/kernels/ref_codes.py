"""Pure-torch references of the key-code page scores (``sparse/keycodes.py``,
``sparse/keycode_channels.py``): the specifications of ``code_scores.code_page_bounds`` and
``channel_codes.channel_code_page_bounds``, re-exported by ``kernels.ref`` (same conventions:
vectorised, no ``.item()``, the CPU execution path)."""
from __future__ import annotations

import torch


def code_page_bounds(q, kmin, kmax, codes, page_table, num_pages, bits, out=None):
    """Per-query-head page scores from token-level key codes (``sparse/keycodes.py``).

    Args:
        q:          [B, Hq, D]                      decode queries, Hq = Hkv * G
        kmin, kmax: [S, D]                          each page's code range per channel
        codes:      [S, page_size * D * bits / 32]  int32 words; code of (token t, channel c)
                                                    at bit offset f = (t * D + c) * bits:
                                                    ``(word[f // 32] >> f % 32) & (2**bits - 1)``
        page_table: [B, Hkv, W] int32, num_pages [B, Hkv] int32
        bits:       1 (level = code) or 2..  (level = (code + 0.5) / 2**bits)
    Returns:
        [B, Hkv, G, W] float32: ``logsumexp_t(scale * q_g · k^_t) / scale`` over the page's
        tokens with ``k^ = kmin + (kmax - kmin) * level``, ``scale = D ** -0.5``; -inf past
        num_pages. ``mass_from_bounds`` of it = the approximate token attention mass per page.
    """
    B, Hq, D = q.shape
    _, Hkv, W = page_table.shape
    ps = codes.shape[1] * 32 // (bits * D)
    ok = torch.arange(W, device=q.device).view(1, 1, W) < num_pages.to(torch.long).unsqueeze(-1)
    ids = torch.where(ok, page_table.to(torch.long), 0)
    w = codes[ids].to(torch.int64) & 0xFFFFFFFF                               # [B, Hkv, W, nw]
    shift = torch.arange(32 // bits, device=q.device) * bits
    code = ((w.unsqueeze(-1) >> shift) & ((1 << bits) - 1)).flatten(-2)     # [B, Hkv, W, ps*D]
    lev = code.float() if bits == 1 else (code.float() + 0.5) / (1 << bits)
    lo, hi = kmin[ids].float(), kmax[ids].float()                            # [B, Hkv, W, D]
    kh = lo.unsqueeze(-2) + (hi - lo).unsqueeze(-2) * lev.view(B, Hkv, W, ps, D)
    scale = D ** -0.5
    x = torch.einsum("bhgd,bhwtd->bhgwt", q.float().view(B, Hkv, Hq // Hkv, D), kh) * scale
    s = (torch.logsumexp(x, dim=-1) / scale).masked_fill(~ok.unsqueeze(2), float("-inf"))
    if out is None:
        return s
    out.copy_(s)
    return out


def channel_code_page_bounds(q, kmean, klo, khi, chan, codes, page_table, num_pages,
                             kscale=None, out=None):
    """Per-query-head page scores from key codes on a few channels (``sparse/keycode_channels.py``).

    Args:
        q:          [B, Hq, D]            decode queries, Hq = Hkv * G
        kmean:      [S, D]                each page's mean key (int8 with ``kscale`` [S, 1]:
                                          the mean is ``kmean * kscale``)
        klo, khi:   [S, R]                range of each coded channel
        chan:       [S, R / 4] int32      the coded channels, 8 bits each (channel j at bits
                                          8 (j % 4) of word j // 4)
        codes:      [S, page_size * R * 2 / 32] int32: 2-bit code of (token t, coded channel
                                          j) at bit offset f = (t * R + j) * 2
        page_table: [B, Hkv, W] int32, num_pages [B, Hkv] int32
    Returns:
        [B, Hkv, G, W] float32: ``logsumexp_t(scale * q_g . k^_t) / scale`` over the page's
        tokens, ``k^_t`` = the page mean except on the coded channels, where it is
        ``klo + (khi - klo) * (code + 0.5) / 4``; ``scale = D ** -0.5``; -inf past num_pages.
    """
    B, Hq, D = q.shape
    _, Hkv, W = page_table.shape
    G, R = Hq // Hkv, klo.shape[1]
    ps = codes.shape[1] * 16 // R
    ok = torch.arange(W, device=q.device).view(1, 1, W) < num_pages.to(torch.long).unsqueeze(-1)
    ids = torch.where(ok, page_table.to(torch.long), 0)                     # [B, Hkv, W]

    def unpack(words, bits):
        w = words.to(torch.int64) & 0xFFFFFFFF
        shift = torch.arange(32 // bits, device=q.device) * bits
        return ((w.unsqueeze(-1) >> shift) & ((1 << bits) - 1)).flatten(-2)

    mean = kmean[ids].float()                                               # [B, Hkv, W, D]
    if kscale is not None:
        mean = mean * kscale[ids].float()
    ch = unpack(chan[ids], 8)                                               # [B, Hkv, W, R]
    lev = (unpack(codes[ids], 2).float() + 0.5) / 4
    lo, hi = klo[ids].float(), khi[ids].float()
    val = lo.unsqueeze(-2) + (hi - lo).unsqueeze(-2) * lev.view(B, Hkv, W, ps, R)
    dev = val - mean.gather(-1, ch).unsqueeze(-2)                           # [B, Hkv, W, ps, R]
    qf = q.float().view(B, Hkv, G, 1, D)
    base = (qf * mean.unsqueeze(2)).sum(-1)                                 # [B, Hkv, G, W]
    qc = qf.expand(B, Hkv, G, W, D).gather(-1, ch.unsqueeze(2).expand(B, Hkv, G, W, R))
    scale = D ** -0.5
    x = (base.unsqueeze(-1) + torch.einsum("bhgwr,bhwtr->bhgwt", qc, dev)) * scale
    s = (torch.logsumexp(x, dim=-1) / scale).masked_fill(~ok.unsqueeze(2), float("-inf"))
    if out is None:
        return s
    out.copy_(s)
    return out
