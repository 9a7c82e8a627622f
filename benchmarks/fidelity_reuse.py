"""`sparseserve eval fidelity` with selection reuse registered: what re-selecting pages only
every k decode steps costs in answers (issue 11's cost lever: a request that selects every
k-th step, the batch's requests staggered, pays 1/k of the select per step on average — and on
every step, with the rows' phases spread).

* ``keycode2-sparq-reuse<k>`` (k = 2, 4, 8): at a step whose
  position is a multiple of k the pages are scored as usual; at the k - 1 steps after it the
  request keeps that step's scores: the same top pages, with the current step's always-kept
  sink and local pages (the local window moves on as tokens arrive, so every new token is
  still attended exactly). Pages that did not exist at the scoring step can only be local
  ones (k <= local_pages * page_size tokens).

Teacher-forced rows of the evaluation are consecutive positions of one text: a row takes the
scores of the row at its anchor position (the first row of a chunk whose anchor lies in the
previous chunk scores itself — one row in 64, a slight advantage to reuse).

    nice -n 5 python benchmarks/fidelity_reuse.py --lengths 8192 --budgets 512 2048 \\
        --algorithms keycode2-sparq-reuse2 keycode2-sparq-reuse4 --num-texts 2 --tail 256 \\
        --sweep-algorithms none --no-needle --no-plot --out OUT   # no settings sweep
"""
from __future__ import annotations

import sys

import torch

from sparseserve.bench import fidelity_cli
from sparseserve.sparse.base import register
from sparseserve.sparse.keycode_sparq import KeyCodeSparQ


def anchored_scores(scores: torch.Tensor, num_pages: torch.Tensor, last_page_len: torch.Tensor,
                    page_size: int, k: int) -> torch.Tensor:
    """scores [B, Hkv, W] of rows at consecutive positions -> each row's anchor row's scores
    (its position rounded down to a multiple of k), -inf on pages the anchor did not have."""
    b = scores.shape[0]
    pos = (num_pages[:, 0].long() - 1) * page_size + last_page_len.long() - 1  # [B]
    back = pos % k
    rows = torch.arange(b, device=scores.device)
    anchor = rows - back
    ok = (anchor >= 0) & (pos[anchor.clamp(min=0)] == pos - back)
    anchor = torch.where(ok, anchor, rows)
    s = scores[anchor]
    w = torch.arange(scores.shape[2], device=scores.device).view(1, 1, -1)
    return torch.where(w < num_pages[anchor].long().unsqueeze(-1), s, float("-inf"))


def reuse_class(base: type, k: int) -> type:
    class Reuse(base):
        fused_select = False  # the generic select over score(): the variant's scores

        def score(self, q, page_table, num_pages, last_page_len, summaries, k_cache):
            s = super().score(q, page_table, num_pages, last_page_len, summaries, k_cache)
            return anchored_scores(s, num_pages, last_page_len, self.page_size, k)

    Reuse.__name__ = f"{base.__name__}Reuse{k}"
    return Reuse


for _k in (2, 4, 8):
    register(f"keycode2-sparq-reuse{_k}")(reuse_class(KeyCodeSparQ, _k))


def main(argv=None) -> int:
    return fidelity_cli.main(["fidelity"] + list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
