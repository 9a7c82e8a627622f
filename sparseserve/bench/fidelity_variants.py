"""Scoring variants evaluated next to the registered algorithms (proposals, not engine code).

``*-mass``: the registered algorithm's per-head score bound, turned into an estimated
attention-mass distribution per query head (softmax over the request's pages at the
attention scale) and summed over the group's heads — the quantity ``oracle`` ranks by —
instead of summing raw logit bounds over heads. Same summaries, same interface.
"""
from __future__ import annotations

import torch

from sparseserve.kernels import score_pages
from sparseserve.sparse.algorithms import ArkVale, Quest

VARIANTS = {"quest-mass": "quest", "arkvale-mass": "arkvale"}  # variant -> base algorithm


def _mass_from_bounds(q, kmin, kmax, page_table, num_pages) -> torch.Tensor:
    b, hq, d = q.shape
    hkv, w = page_table.shape[1:]
    g = hq // hkv
    scores = [score_pages(q.view(b, hkv, g, d)[:, :, i].contiguous(), kmin, kmax, None,
                          page_table, num_pages, "quest") for i in range(g)]  # [B, Hkv, W] each
    u = torch.stack(scores, dim=2) * d ** -0.5  # [B, Hkv, G, W]
    return torch.softmax(u, dim=-1).sum(2)


class QuestMass(Quest):
    fused_select = False  # select over this score (the fused kernel scores like quest)

    def score(self, q, page_table, num_pages, last_page_len, summaries, k_cache):
        m = _mass_from_bounds(q, summaries["kmin"], summaries["kmax"], page_table, num_pages)
        w = page_table.shape[2]
        return m.masked_fill(torch.arange(w).view(1, 1, w) >= num_pages.unsqueeze(-1),
                             float("-inf"))


class ArkValeMass(ArkVale, QuestMass):
    score = QuestMass.score


CLASSES = {"quest-mass": QuestMass, "arkvale-mass": ArkValeMass}
