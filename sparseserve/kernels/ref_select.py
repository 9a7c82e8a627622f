"""Pure-torch references of page scoring and selection: Quest / ArkVale box bounds, the
estimated attention mass of pages, the top-k selection with kept pages and the key-code
shortlist — the specifications of ``page_scores``, ``page_select`` and ``shortlist``,
re-exported by ``kernels.ref`` (same conventions: vectorised, no ``.item()``, the CPU
execution path)."""
from __future__ import annotations

import torch

from .ref_codes import channel_code_page_bounds, code_page_bounds
from .ref_sparq import sparq_page_bounds

SCORE_MODES = ("quest", "arkvale")


def score_pages(q, kmin, kmax, kradius, page_table, num_pages, mode, out=None, per_head=False):
    """Upper-bound scores of candidate pages from their summaries, summed over the GQA group
    (the raw-sum scoring; Quest/ArkVale now score by ``page_mass``) or per head.

    Args:
        q:          [B, Hq, D]          decode queries, Hq = Hkv * G
        kmin, kmax: [S, D]              per-page channel min / max (summary rows)
        kradius:    [S, D] or None      ArkVale radius (required for mode "arkvale")
        page_table: [B, Hkv, W] int32   candidate pages (summary rows)
        num_pages:  [B, Hkv] int32      valid entries of page_table[b, h]
        mode:       "quest"   score = sum_g sum_c max(q_gc * M_c, q_gc * m_c)
                    "arkvale" with c = (M + m) / 2, r = kradius:
                              score = sum_g sum_c max(q_gc * (c + r)_c, q_gc * (c - r)_c)
        out:        [B, Hkv, W] float32 or None (written in place if given);
                    [B, Hkv, G, W] with per_head
        per_head:   each query head's bound instead of the sum over the group
    Returns:
        scores: [B, Hkv, W] float32 (per_head: [B, Hkv, G, W]); entries w >= num_pages[b, h]
        are -inf.
    """
    if mode not in SCORE_MODES:
        raise ValueError(f"unknown score mode {mode!r}; expected one of {SCORE_MODES}")
    B, Hq, D = q.shape
    _, Hkv, W = page_table.shape
    G = Hq // Hkv
    ok = torch.arange(W, device=q.device).view(1, 1, W) < num_pages.to(torch.long).unsqueeze(-1)
    ids = torch.where(ok, page_table.to(torch.long), 0)                        # [B, Hkv, W]
    hi = kmax[ids].float()                                                     # [B, Hkv, W, D]
    lo = kmin[ids].float()
    if mode == "arkvale":
        if kradius is None:
            raise ValueError("mode 'arkvale' needs kradius")
        c = (hi + lo) * 0.5
        r = kradius[ids].float()
        hi, lo = c + r, c - r
    qf = q.float().view(B, Hkv, G, 1, D)                                       # [B, Hkv, G, 1, D]
    # a shape loop over the group keeps the intermediate at [B, Hkv, W, D]
    per = [torch.maximum(qf[:, :, g] * hi, qf[:, :, g] * lo).sum(dim=-1) for g in range(G)]
    if per_head:
        s = torch.stack(per, dim=2).masked_fill(~ok.unsqueeze(2), float("-inf"))
    else:
        s = torch.stack(per, dim=0).sum(0).masked_fill(~ok, float("-inf"))
    if out is None:
        return s
    out.copy_(s)
    return out


def sub_table(page_table, num_pages, n_sub):
    """[B, Hkv, W * n_sub] int32 sub-block rows ``page * n_sub + j`` of the valid entries
    (0 past num_pages: never read) — a page table over the rows of a ``[S * n_sub, D]`` view
    of ``[S, n_sub * D]`` summaries. n_sub = 1: the page table itself (valid entries)."""
    B, Hkv, W = page_table.shape
    ok = torch.arange(W, device=page_table.device).view(1, 1, W) < num_pages.to(torch.long).unsqueeze(-1)
    pages = torch.where(ok, page_table.to(torch.long), 0)
    j = torch.arange(n_sub, device=page_table.device)
    return (pages.unsqueeze(-1) * n_sub + j).reshape(B, Hkv, W * n_sub).to(torch.int32)


def sub_bounds(q, kmin, kmax, page_table, num_pages, n_sub=1):
    """Per-query-head upper bounds of q·k over each of a page's ``n_sub`` summary boxes.

    Args:
        q:          [B, Hq, D]               decode queries, Hq = Hkv * G
        kmin, kmax: [S, n_sub * D]           per page row, n_sub boxes of D channels each
                                             (kmin <= kmax elementwise); n_sub = 1: one box
        page_table: [B, Hkv, W] int32        candidate pages (summary rows)
        num_pages:  [B, Hkv] int32           valid entries of page_table[b, h]
    Returns:
        bounds: [B, Hkv, G, W, n_sub] float32, bounds[b, h, g, w, j] = sum_c max(q_c M_c,
        q_c m_c) over box j of page w for query head h * G + g, computed as q+ · M + q- · m
        (equal because M >= m); entries w >= num_pages[b, h] are -inf.
    """
    B, Hq, D = q.shape
    _, Hkv, W = page_table.shape
    ok = torch.arange(W, device=q.device).view(1, 1, W) < num_pages.to(torch.long).unsqueeze(-1)
    ids = torch.where(ok, page_table.to(torch.long), 0)                        # [B, Hkv, W]
    qf = q.float().view(B, Hkv, Hq // Hkv, D)                                  # [B, Hkv, G, D]
    hi = kmax.view(kmax.shape[0], n_sub, D)[ids].float()                       # [B, Hkv, W, n, D]
    lo = kmin.view(kmin.shape[0], n_sub, D)[ids].float()
    u = (torch.einsum("bhgd,bhwjd->bhgwj", qf.clamp(min=0), hi)
         + torch.einsum("bhgd,bhwjd->bhgwj", qf.clamp(max=0), lo))
    return u.masked_fill(~ok.unsqueeze(2).unsqueeze(-1), float("-inf"))


def head_bounds(q, kmin, kmax, page_table, num_pages, n_sub=1):
    """Per-query-head upper bounds of q·k over each candidate page's summary boxes.

    Args:
        q:          [B, Hq, D]          decode queries, Hq = Hkv * G
        kmin, kmax: [S, n_sub * D]      summary box rows (kmin <= kmax elementwise); a page
                                        row holds ``n_sub`` boxes (sub-page partitions)
        page_table: [B, Hkv, W] int32   candidate pages (summary rows)
        num_pages:  [B, Hkv] int32      valid entries of page_table[b, h]
        n_sub:      boxes per page (1: one box over the whole page)
    Returns:
        bounds: [B, Hkv, G, W] float32, bounds[b, h, g, w] = max over the page's boxes of
        sum_c max(q_c M_c, q_c m_c) for query head h * G + g (a bound on the page's largest
        logit, tighter the finer the boxes), computed as q+ · M + q- · m (equal because
        M >= m: the max picks q_c M_c exactly when q_c >= 0); entries w >= num_pages[b, h]
        are -inf.
    """
    return sub_bounds(q, kmin, kmax, page_table, num_pages, n_sub).amax(dim=-1)


def mass_from_bounds(bounds, num_pages, sink_pages, local_pages, scale, out=None,
                     normalise_kept=True):
    """Estimated attention mass of each page, from per-query-head logit bounds.

    Per query head g, a softmax at the attention scale over the row's full pages (every page
    but the partial last one, whose summary is not built yet), summed over the group's G heads:
    ``mass[w] = sum_g exp(scale * bounds[g, w] - lse_g)``, ``lse_g`` the log-sum-exp of
    ``scale * bounds[g, :]`` over the full pages. Each head thus spends a total of 1, so a head
    whose bounds single out one page is not drowned by heads with large but flat bounds (what a
    raw sum over heads does), and a head that puts its mass on the always-kept pages (sink,
    local window: normalised over, selected anyway) weighs little in the choice of the others
    — as in the true attention mass that ``oracle`` ranks by. Measured against normalising
    over the scored pages only (``normalise_kept=False``) in docs/results/fidelity.md.

    Args:
        bounds:    [B, Hkv, G, W] float32  per-head bounds (``head_bounds``), -inf past num_pages
        num_pages: [B, Hkv] int32          valid entries
        sink_pages, local_pages: ints      the always-kept pages
        scale:     float                   softmax scale (head_dim ** -0.5, the attention's)
        out:       [B, Hkv, W] float32 or None (written in place if given)
        normalise_kept: False = the softmax runs over the scored pages only (evaluation variant)
    Returns:
        mass: [B, Hkv, W] float32 in [0, G] for scored pages (neither kept nor the last page),
        +inf for kept pages and the last page (selected whatever the score), -inf for entries
        w >= num_pages[b, h].
    """
    W = bounds.shape[-1]
    n = num_pages.to(torch.long).unsqueeze(-1)                                 # [B, Hkv, 1]
    blk = torch.arange(W, device=bounds.device).view(1, 1, W)
    full = blk < n - 1
    scored = full & (blk >= sink_pages) & (blk < n - local_pages)             # [B, Hkv, W]
    norm = full if normalise_kept else scored
    x = bounds.float() * scale                                                 # [B, Hkv, G, W]
    xs = x.masked_fill(~norm.unsqueeze(2), float("-inf"))
    m = xs.amax(dim=-1, keepdim=True)                                          # [B, Hkv, G, 1]
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # no full page: any finite m
    lse = m + torch.log(torch.exp(xs - m).sum(dim=-1, keepdim=True))
    mass = torch.exp(xs - lse).sum(dim=2)                                      # [B, Hkv, W]
    mass = torch.where(scored, mass, float("inf"))
    mass = mass.masked_fill(blk >= n, float("-inf"))
    if out is None:
        return mass
    out.copy_(mass)
    return out


def page_mass(q, kmin, kmax, page_table, num_pages, sink_pages, local_pages, out=None,
              n_sub=1):
    """Quest/ArkVale's page scores: ``mass_from_bounds(head_bounds(...))`` at the attention
    scale ``D ** -0.5``. q [B, Hq, D], kmin/kmax [S, n_sub * D], page_table [B, Hkv, W] int32,
    num_pages [B, Hkv] int32 -> [B, Hkv, W] float32 (see mass_from_bounds)."""
    u = head_bounds(q, kmin, kmax, page_table, num_pages, n_sub)
    return mass_from_bounds(u, num_pages, sink_pages, local_pages, q.shape[-1] ** -0.5, out)


def select_pages(q, kmin, kmax, page_table, num_pages, last_page_len, budget_pages, sink_pages,
                 local_pages, out_pages=None, out_num=None, out_blocks=None, n_sub=1,
                 codes=None, bits=0, kmean=None, chan=None, kscale=None, sparq_chan=None,
                 sparq_rec=None):
    """Quest/ArkVale page selection: ``page_mass`` + kept pages + top-k, exactly
    ``SparseAlgorithm.select``'s torch path over ``Quest.score`` (the spec of
    ``page_select.select_pages``).

    Args:
        q:             [B, Hq, D]          decode queries, Hq = Hkv * G
        kmin, kmax:    [S, n_sub * D]      summary box rows (n_sub boxes per page; a page's
                                           bound is the max of its boxes' bounds)
        codes, bits:   token key codes (bits > 0): pages scored by ``code_page_bounds``
                       instead of their boxes' bounds (kmin / kmax: the codes' range)
        kmean, chan, kscale: channel key codes (with codes): pages scored by
                       ``channel_code_page_bounds`` (kmin / kmax: the coded channels' ranges)
        sparq_chan:    [B, Hkv, R] with codes (channel-major), kmean, kscale: pages scored by
                       ``sparq_page_bounds`` (each row decodes its R channels); ``sparq_rec``
                       (the records kmin / kmax / codes view, ``sparq_records``) is unused
        page_table:    [B, Hkv, W] int32   all of each request's pages in order
        num_pages:     [B, Hkv] int32      valid entries of page_table (1..W)
        last_page_len: [B] int32           unused (the caller's Selection carries it)
        budget_pages, sink_pages, local_pages: ints
        out_pages / out_num / out_blocks:  optional outputs, written in place
    Returns:
        pages [B, Hkv, K] int32 physical ids, num_sel [B, Hkv] int32, blocks [B, Hkv, K] int64
        logical indices, K = max(1, min(budget - 1, W)) + 1. Entries < num_sel: the kept pages
        (first ``sink``, last ``local`` incl. the last page) and the others of highest mass in
        descending mass, then the last page at num_sel - 1 (num_sel = min(K, num_pages));
        entries past it repeat the last page.
    """
    B, _, W = page_table.shape
    if sparq_chan is not None:  # the row's channels of every page
        u = sparq_page_bounds(q, kmean, kscale, kmin, kmax, codes, sparq_chan, page_table,
                              num_pages)
        scores = mass_from_bounds(u, num_pages, sink_pages, local_pages, q.shape[-1] ** -0.5)
    elif chan is not None:  # channel key codes: approximate token attention mass per page
        u = channel_code_page_bounds(q, kmean, kmin, kmax, chan, codes, page_table, num_pages,
                                     kscale)
        scores = mass_from_bounds(u, num_pages, sink_pages, local_pages, q.shape[-1] ** -0.5)
    elif bits:  # token key codes: approximate token attention mass per page
        scores = mass_from_bounds(code_page_bounds(q, kmin, kmax, codes, page_table, num_pages,
                                                   bits), num_pages, sink_pages, local_pages,
                                  q.shape[-1] ** -0.5)
    else:
        scores = page_mass(q, kmin, kmax, page_table, num_pages, sink_pages, local_pages,
                           n_sub=n_sub)
    res = select_from_scores(scores, page_table, num_pages, budget_pages, sink_pages,
                             local_pages)
    outs = (out_pages, out_num, out_blocks)
    return tuple(r if o is None else o.copy_(r) for o, r in zip(outs, res))


def select_from_scores(scores, page_table, num_pages, budget_pages, sink_pages, local_pages,
                       stable=False):
    """``select_pages``' selection over given page scores [B, Hkv, W] (``-inf`` past
    num_pages): kept pages forced, the last page appended at num_sel - 1, the top
    ``max(1, min(budget - 1, W))`` others (``torch.topk``: descending score; ``stable``: a
    stable sort instead, ties to the lower block, the fused kernel's rule) -> (pages int32,
    num_sel int32, blocks int64) as ``select_pages`` returns them."""
    W = scores.shape[-1]
    n = num_pages.long().unsqueeze(-1)                                         # [B, Hkv, 1]
    blk = torch.arange(W, device=scores.device).view(1, 1, W)
    kept = ((blk < sink_pages) | (blk >= n - local_pages)) & (blk < n)
    scores = torch.where(kept, torch.full_like(scores, float("inf")), scores)
    # the last page is appended at the end of the list (attend needs it there)
    scores = torch.where(blk == n - 1, torch.full_like(scores, float("-inf")), scores)
    k = max(1, min(budget_pages - 1, W))
    if stable:
        vals, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
        vals, idx = vals[..., :k], idx[..., :k]
    else:
        vals, idx = scores.topk(k, dim=-1)                                     # [B, Hkv, k]
    num_sel = (vals > float("-inf")).sum(-1, keepdim=True) + 1                 # [B, Hkv, 1]
    blocks = torch.cat([idx, torch.zeros_like(idx[..., :1])], dim=-1)          # [B, Hkv, k + 1]
    last = (n - 1).clamp(min=0)
    pos = torch.arange(k + 1, device=scores.device).view(1, 1, -1)
    blocks = torch.where(pos >= num_sel - 1, last, blocks)
    pages = page_table.gather(2, blocks).to(torch.int32)
    return pages, num_sel.squeeze(-1).to(torch.int32), blocks


def shortlist_mask(box_bounds, num_pages, shortlist_pages, sink_pages, local_pages, scale):
    """[B, Hkv, W] bool: the shortlist of ``select_pages_shortlist`` — what ``select_pages``
    selects at budget ``shortlist_pages`` from Quest's box mass (``mass_from_bounds`` of the
    per-head box bounds ``box_bounds`` [B, Hkv, G, W], -inf past num_pages): the kept pages,
    the last page and the others of highest box mass (ties: lower block first)."""
    mass = mass_from_bounds(box_bounds, num_pages, sink_pages, local_pages, scale)
    B, Hkv, W = mass.shape
    blk = torch.arange(W, device=mass.device).expand(B, Hkv, W)
    _, num, blocks = select_from_scores(mass, blk, num_pages, shortlist_pages, sink_pages,
                                        local_pages, stable=True)
    ok = torch.arange(blocks.shape[-1], device=mass.device).view(1, 1, -1) < num.long()[..., None]
    m = torch.zeros(B, Hkv, W + 1, dtype=torch.bool, device=mass.device)
    return m.scatter_(2, torch.where(ok, blocks, W), True)[..., :W]


def shortlist_scores(code_bounds, in_short, num_pages, sink_pages, local_pages, scale):
    """[B, Hkv, W] page scores of ``select_pages_shortlist``'s final choice: the approximate
    token attention mass from key codes (``code_bounds`` [B, Hkv, G, W], any values outside
    the shortlist) with each head's softmax over the *shortlisted* full pages only; +inf kept
    / last page, -inf outside the shortlist and past num_pages (``mass_from_bounds``)."""
    x = code_bounds.masked_fill(~in_short.unsqueeze(2), float("-inf"))
    mass = mass_from_bounds(x, num_pages, sink_pages, local_pages, scale)
    return mass.masked_fill(~in_short, float("-inf"))


def select_pages_shortlist(q, kmin, kmax, codes, page_table, num_pages, last_page_len,
                           budget_pages, shortlist_pages, sink_pages, local_pages, bits):
    """Two-stage selection (``sparse/keycode_shortlist.py``; spec of
    ``kernels.shortlist.select_pages_shortlist``): the shortlist = ``select_pages`` at budget
    ``shortlist_pages`` by the box mass of Quest's bound on each page's code box ``kmin`` /
    ``kmax`` (``shortlist_mask``), then ``select_pages`` at ``budget_pages`` inside it by the
    key codes' approximate token attention mass normalised over the shortlist
    (``shortlist_scores``). Both scores are computed here for every page; needs
    ``shortlist_pages >= sink_pages + local_pages + 1`` (every kept page in the shortlist).
    Same arguments and returns as ``select_pages`` (K = max(1, min(budget - 1, W)) + 1)."""
    assert shortlist_pages >= max(budget_pages, sink_pages + local_pages + 1)
    scale = q.shape[-1] ** -0.5
    box = head_bounds(q, kmin, kmax, page_table, num_pages)
    in_short = shortlist_mask(box, num_pages, shortlist_pages, sink_pages, local_pages, scale)
    code = code_page_bounds(q, kmin, kmax, codes, page_table, num_pages, bits)
    scores = shortlist_scores(code, in_short, num_pages, sink_pages, local_pages, scale)
    return select_from_scores(scores, page_table, num_pages, budget_pages, sink_pages,
                              local_pages)
