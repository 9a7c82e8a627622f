"""`sparseserve eval fidelity` with retroinfer registered (and evaluation-only variants).

The fidelity harness in-process with retroinfer's evaluation-only variants registered (the CLI
knows only the engine's algorithms). Variants
over retroinfer's own summaries (evaluation only, not engine code):

* ``retroinfer-all``  — the estimation zone is every unselected page (nothing dropped);
* ``retroinfer-max``  — pages scored by their best centroid's logit (max over clusters and
  the group's heads of ``q·c``), not by the clusters' estimated mass; estimate on.

Fast mode: the cluster logits from one read of the text's centroids for all rows (every row
of the teacher-forced tail reads the same pages), checked equal to the generic path on the
first call of each run; the exact part's log-sum-exp comes from the shared q·K product
(``fidelity_shared.fast_decode_attention(...).lse``).

    nice -n 10 python benchmarks/fidelity_retroinfer.py --lengths 4096 --budgets 512 2048 \
        --algorithms retroinfer retroinfer-noest arkvale oracle --num-texts 3 --tail 256 \
        --sweep-algorithms arkvale --sweep-settings s1l2d0 --no-needle --no-plot --out OUT
"""
from __future__ import annotations

import sys

import torch

import sparseserve.sparse.retroinfer  # noqa: F401  (registers retroinfer, retroinfer-noest)
from sparseserve.bench import fidelity_tail, fidelity_variants
from sparseserve.sparse.retroinfer import RetroInfer


class RetroInferAll(RetroInfer):
    zone_factor = None


class RetroInferMax(RetroInfer):
    def score(self, q, page_table, num_pages, last_page_len, summaries, k_cache):
        """The best centroid's logit per page (max over its clusters and the group's heads of
        q·c_j, sizes ignored); kept / last page +inf, -inf past num_pages."""
        scale = q.shape[-1] ** -0.5
        x, ids = self.cluster_logits(q, page_table, num_pages, summaries, scale)
        cnt = summaries["count"][ids].float().unsqueeze(2)  # [b | 1, Hkv, 1, W, C]
        raw = torch.where(cnt > 0, x - cnt.clamp(min=1).log(), float("-inf"))
        s = raw.amax(dim=(2, 4))  # [B, Hkv, W]
        w = s.shape[-1]
        n = num_pages.long().unsqueeze(-1)
        blk = torch.arange(w, device=q.device).view(1, 1, w)
        kept = ((blk < self.sink_pages) | (blk >= n - self.local_pages)) & (blk < n)
        return torch.where(kept, float("inf"), s).masked_fill(blk >= n, float("-inf"))


for _name, _cls in (("retroinfer-all", RetroInferAll), ("retroinfer-max", RetroInferMax)):
    fidelity_variants.VARIANTS[_name] = "retroinfer"
    fidelity_variants.CLASSES[_name] = _cls


def shared_retroinfer_class(cls):
    """``cls`` whose cluster logits read the text's centroids once for all rows."""

    class SharedRetroInfer(cls):
        shared = None
        checked = False

        def cluster_logits(self, q, page_table, num_pages, summaries, scale):
            sh = self.shared
            if sh is None or not sh.covers(page_table, num_pages):
                return super().cluster_logits(q, page_table, num_pages, summaries, scale)
            b, hq, d = q.shape
            w, c = page_table.shape[2], self.n_clusters
            rows = sh.page_rows(w)
            cent = summaries["cent"][rows].float().view(sh.hkv, w, c, d)
            cnt = summaries["count"][rows].float()  # [Hkv, w, C]
            x = torch.einsum("bhgd,hwcd->bhgwc", q.float().view(b, sh.hkv, hq // sh.hkv, d),
                             cent)
            logn = torch.where(cnt > 0, cnt.clamp(min=1).log(), float("-inf"))
            x = x * scale + logn.view(1, sh.hkv, 1, w, c)
            ok = torch.arange(w).view(1, 1, w) < num_pages.long().unsqueeze(-1)
            x = x.masked_fill(~ok.view(b, sh.hkv, 1, w, 1), float("-inf"))
            ids = rows.unsqueeze(0)  # [1, Hkv, w]: the same pages for every row
            if not self.checked:
                ref, _ = super().cluster_logits(q, page_table, num_pages, summaries, scale)
                torch.testing.assert_close(x, ref, rtol=1e-5, atol=1e-5)
                type(self).checked = True
            return x, ids

    SharedRetroInfer.__name__ = f"Shared{cls.__name__}"
    return SharedRetroInfer


fidelity_tail.register_fast(RetroInfer, shared_retroinfer_class)

if __name__ == "__main__":
    from sparseserve.bench.fidelity_cli import main

    argv = sys.argv[1:]
    sys.exit(main(argv if argv[:1] == ["fidelity"] else ["fidelity"] + argv))
