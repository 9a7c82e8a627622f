"""RetroInfer-style attention (Chen et al., "RetroInfer", 2025) mapped onto pages: key
clusters, an exact zone, an estimation zone, the rest dropped.

RetroInfer clusters each (request, KV head)'s keys (segmented k-means at prefill, ~16 tokens a
cluster), scores the centroids with the query, attends the top clusters exactly, estimates the
next ones from ``centroid x cluster size`` and the cluster's value sum, and drops the rest.
Here the device cache, the transfers and the summaries are page-granular (one fixed-shape row
per page), so the clustering is **segmented k-means with the page as the segment**: at index
time each page's 32 keys are clustered into ``n_clusters`` clusters (Lloyd, a fixed number of
iterations from contiguous-segment means, torch, fixed shapes); per page we keep

* ``cent``  [C, D]  the clusters' centroids (mean key), KV dtype;
* ``vmean`` [C, D]  the clusters' value means (value sum / size), KV dtype;
* ``count`` [C]     the cluster sizes (0 = empty), float32.

At decode, per query head ``g`` and cluster ``j`` of page ``w`` the estimated logit mass is
``n_j exp(s q_g·c_j)`` (``s`` the attention scale): each token of the cluster taken at its
centroid. A page's score is its estimated attention mass, ``log sum_j n_j exp(s q·c_j)``
through ``ref.mass_from_bounds`` (per head a softmax over the row's full pages, summed over the
GQA group), and the shared ``select`` picks the **exact zone** (the selected pages). The
**estimation zone** is the next ``zone_factor * budget_pages`` unselected full pages by the same
score (``zone_factor = None``: every unselected page); ``estimate`` returns, per query head,
``lse_est = logsumexp_{j in zone}(s q·c_j + log n_j)`` and ``o_est = sum_j softmax(...)_j
vmean_j``, which the engine merges with the exact part by log-sum-exp. Pages beyond the zone
are dropped. ``retroinfer-noest`` is the same selection without the estimate.

Why clusters inside the page rather than RetroInfer's global (segment-wide) clusters: the unit
of transfer and of the device cache is the page, so attending one global cluster exactly costs
every page that holds one of its tokens. A 16-token cluster of a segment-wide k-means is
spread over up to 16 pages (RoPE keys cluster by content, not position), so an exact zone of K
tokens would cost up to K pages of budget and PCIe instead of K/32 - a budget of 2048 tokens
could exact-attend as few as 64 tokens. In-page clusters cost exactly their page: the exact
zone is what ``select`` picks, the budget is spent as for every other algorithm. The price:
(1) a selected page brings all 32 tokens, where the hot cluster may be 8-16 of them (the exact
zone holds the useful tokens at 1/2-1/4 density, i.e. for the same useful tokens we select
2-4x the pages global clustering would if its clusters were page-contiguous); (2) clusters of
32 mostly neighbouring keys are coarser (less similar keys per cluster, so the centroid
estimate is rougher; Jensen: ``n exp(q·c) <= sum_t exp(q·k_t)``, the estimate undershoots).
Reordering tokens so that global clusters are page-contiguous (RetroInfer's own buffer layout)
would remove (1) but changes the KV layout the rest of the engine assumes (positions in page
order); it is not done here.

Summary bytes per page and KV head (page 32, head_dim 64, bf16 KV, 8 KiB of K+V): C = 4:
2 x 4 x 64 x 2 B + 4 x 4 B = 1040 B = 12.7 %; C = 2 (16 tokens a cluster, RetroInfer's
granularity): 6.3 %. ``score`` reads the centroids and counts (C x D per page, as 8/16-token
boxes do), ``estimate`` re-reads them and the value means of the zone (a fused select +
estimate would read the centroids once). The merge needs the exact part's log-sum-exp, which
today is ``ref.paged_decode_lse`` in torch (one more read of the selected keys on the GPU).

Fixed shapes, no host sync, no loops over data (the k-means loop runs a fixed count).
"""
from __future__ import annotations

import torch

from sparseserve.kernels.ref import mass_from_bounds
from sparseserve.sparse.base import SparseAlgorithm, register


def kmeans_pages(k: torch.Tensor, valid: torch.Tensor, n_clusters: int, iters: int):
    """Lloyd's k-means of each page's keys, fixed shapes.

    k [N, ps, D] float32 keys, valid [N, ps] bool (the page's filled tokens, a prefix) ->
    (assign [N, ps] int64 cluster of each token (invalid tokens: 0, not counted),
    onehot [N, ps, C] float32 (0 for invalid tokens), count [N, C] float32,
    cent [N, C, D] float32 the mean key of each cluster, 0 for an empty one).

    Initial clusters: the valid tokens in ``C`` contiguous runs (token t of n in run t*C // n),
    then ``iters`` rounds of (assign each token to its nearest non-empty centroid by L2,
    recompute the means)."""
    n, ps, _ = k.shape
    c = n_clusters
    ntok = valid.sum(1, keepdim=True).clamp(min=1)  # [N, 1]
    t = torch.arange(ps, device=k.device).view(1, ps)
    assign = torch.div(t * c, ntok, rounding_mode="floor").clamp(max=c - 1)  # [N, ps]
    onehot, count, cent = _means(k, valid, assign, c)
    for _ in range(iters):
        d = ((k.unsqueeze(2) - cent.unsqueeze(1)) ** 2).sum(-1)  # [N, ps, C]
        d = d.masked_fill((count == 0).unsqueeze(1), float("inf"))
        assign = d.argmin(-1)
        onehot, count, cent = _means(k, valid, assign, c)
    return torch.where(valid, assign, 0), onehot, count, cent


def _means(x, valid, assign, c):
    """(onehot [N, ps, C], count [N, C], mean of x per cluster [N, C, D]; 0 where empty)."""
    onehot = torch.nn.functional.one_hot(assign, c).float() * valid.unsqueeze(-1).float()
    count = onehot.sum(1)
    mean = torch.einsum("ntc,ntd->ncd", onehot, x) / count.clamp(min=1).unsqueeze(-1)
    return onehot, count, mean


@register("retroinfer")
class RetroInfer(SparseAlgorithm):
    """In-page key clusters (centroid, value mean, size); pages scored by their clusters'
    estimated attention mass; the next unselected pages estimated from their clusters."""

    summary_names = ("cent", "vmean", "count")
    uses_values = True
    estimates = True
    n_clusters = 4  # clusters per page (8 tokens each at page 32)
    kmeans_iters = 4
    # estimation zone: the next zone_factor * budget_pages unselected pages by score;
    # None = every unselected page (nothing dropped)
    zone_factor: int | None = 4

    def summary_shapes(self, head_dim):
        c = self.n_clusters
        return {"cent": (c, head_dim), "vmean": (c, head_dim), "count": (c,)}

    def summary_dtypes(self):
        return {"count": torch.float32}

    # ---- index ------------------------------------------------------------------------------
    def index(self, k_cache, page_ids, num_tokens, summaries, queries, v_cache=None):
        """Cluster the listed pages' keys: page_ids [N] int32 (< 0 masked: written to the
        scratch row), num_tokens [N]; k_cache / v_cache [P, ps, D]. Without v_cache (a caller
        that does not pass values) the value means are written as 0 - the engine always
        passes them (``uses_values``)."""
        cent, vmean, count = summaries["cent"], summaries["vmean"], summaries["count"]
        c = self.n_clusters
        live = page_ids >= 0
        rows = torch.where(live, page_ids, cent.shape[0] - 1).long()  # masked -> scratch row
        src = torch.where(live, page_ids, 0).long()
        k = k_cache[src].float()  # [N, ps, D]
        n, ps, d = k.shape
        valid = torch.arange(ps, device=k.device).view(1, ps) < num_tokens.view(-1, 1)
        _, onehot, cnt, ck = kmeans_pages(k, valid, c, self.kmeans_iters)
        if v_cache is not None:
            v = v_cache[src].float()
            vm = torch.einsum("ntc,ntd->ncd", onehot, v) / cnt.clamp(min=1).unsqueeze(-1)
        else:
            vm = torch.zeros_like(ck)
        cent[rows] = ck.reshape(n, c * d).to(cent.dtype)
        vmean[rows] = vm.reshape(n, c * d).to(vmean.dtype)
        count[rows] = cnt.to(count.dtype)

    # ---- score ------------------------------------------------------------------------------
    def cluster_logits(self, q, page_table, num_pages, summaries, scale):
        """[B, Hkv, G, W, C] float32: ``scale * q_g·c_j + log n_j`` of every cluster of the
        row's pages (-inf for empty clusters and entries >= num_pages) and the gathered page
        rows ``ids`` [B, Hkv, W] (entries past num_pages -> row 0)."""
        b, hq, d = q.shape
        hkv, w = page_table.shape[1:]
        c = self.n_clusters
        ok = torch.arange(w, device=q.device).view(1, 1, w) < num_pages.long().unsqueeze(-1)
        ids = torch.where(ok, page_table.long(), 0)
        cent = summaries["cent"][ids].float().view(b, hkv, w, c, d)
        cnt = summaries["count"][ids].float()  # [B, Hkv, W, C]
        x = torch.einsum("bhgd,bhwcd->bhgwc", q.float().view(b, hkv, hq // hkv, d), cent)
        logn = torch.where(cnt > 0, cnt.clamp(min=1).log(), float("-inf"))
        x = x * scale + logn.unsqueeze(2)
        return x.masked_fill(~ok.view(b, hkv, 1, w, 1), float("-inf")), ids

    def page_mass(self, x, num_pages, scale):
        """Page scores [B, Hkv, W] from cluster logits [B, Hkv, G, W, C]: the estimated
        attention mass (``ref.mass_from_bounds`` of each page's log-sum-exp), +inf kept /
        last page, -inf past num_pages."""
        lse = torch.logsumexp(x, dim=-1)  # [B, Hkv, G, W], -inf past num_pages
        return mass_from_bounds(lse / scale, num_pages, self.sink_pages, self.local_pages,
                                scale)

    def score(self, q, page_table, num_pages, last_page_len, summaries, k_cache):
        """q [B, Hq, D], page_table [B, Hkv, W] -> [B, Hkv, W] float32 estimated mass."""
        scale = q.shape[-1] ** -0.5
        x, _ = self.cluster_logits(q, page_table, num_pages, summaries, scale)
        return self.page_mass(x, num_pages, scale)

    # ---- estimate ---------------------------------------------------------------------------
    def zone(self, x, sel, num_pages, scale):
        """[B, Hkv, W] bool: the estimation zone - unselected full pages, the next
        ``zone_factor * budget_pages`` of them by score (all of them for ``None``)."""
        b, hkv, _, w, _ = x.shape
        dev = x.device
        n = num_pages.long().unsqueeze(-1)
        blk = torch.arange(w, device=dev).view(1, 1, w)
        k = sel.blocks.shape[2]
        entry_ok = torch.arange(k, device=dev).view(1, 1, k) < sel.num_pages.long().unsqueeze(-1)
        chosen = torch.zeros((b, hkv, w + 1), dtype=torch.bool, device=dev)
        chosen.scatter_(2, torch.where(entry_ok, sel.blocks.long(), w), True)
        cand = (blk < n - 1) & ~chosen[..., :w]  # full, indexed, not attended exactly
        if self.zone_factor is None or self.zone_factor * self.budget_pages >= w:
            return cand
        mass = self.page_mass(x, num_pages, scale)
        mass = mass.masked_fill(~cand, float("-inf"))
        vals, idx = mass.topk(self.zone_factor * self.budget_pages, dim=-1)
        zone = torch.zeros((b, hkv, w + 1), dtype=torch.bool, device=dev)
        zone.scatter_(2, torch.where(vals > float("-inf"), idx, w), True)
        return zone[..., :w]

    def estimate(self, q, sel, page_table, num_pages, summaries, scale):
        """(o_est [B, Hq, D] float32, lse_est [B, Hq] float32): the estimation zone's clusters,
        each ``n_j`` tokens at key ``c_j`` and value ``vmean_j``; lse -inf and o 0 where the
        zone is empty (e.g. every page selected)."""
        b, hq, d = q.shape
        hkv, w = page_table.shape[1:]
        c = self.n_clusters
        x, ids = self.cluster_logits(q, page_table, num_pages, summaries, scale)
        zone = self.zone(x, sel, num_pages, scale)  # [B, Hkv, W]
        x = x.masked_fill(~zone.view(b, hkv, 1, w, 1), float("-inf")).flatten(3)  # [.., W*C]
        lse = torch.logsumexp(x, dim=-1)  # [B, Hkv, G]
        p = torch.exp(x - lse.unsqueeze(-1)).nan_to_num(0.0)  # 0 where lse = -inf
        # ids may be [1, Hkv, W] when every row reads the same pages (the fidelity harness)
        vm = summaries["vmean"][ids].float().view(ids.shape[0], hkv, w * c, d)
        o = torch.einsum("bhgn,bhnd->bhgd", p, vm.expand(b, -1, -1, -1))
        return o.reshape(b, hq, d), lse.reshape(b, hq)


@register("retroinfer-noest")
class RetroInferNoEstimate(RetroInfer):
    """``retroinfer``'s selection (exact zone) alone: no estimation zone."""

    estimates = False
