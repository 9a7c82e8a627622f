"""Scoring variants evaluated next to the registered algorithms (baselines, not engine code).

``*-sum``: the registered algorithm's per-query-head score bounds summed raw over the GQA
group (``sum_g sum_c max(q_gc M_c, q_gc m_c)``) — how Quest and ArkVale scored pages before
the estimated-attention-mass scoring (``ref.mass_from_bounds``) replaced it. Same summaries,
same kept pages, the generic select over this score; kept so the fidelity report can show
both scorings on the same texts.
"""
from __future__ import annotations

from sparseserve.kernels import score_pages
from sparseserve.sparse.algorithms import ArkVale, Quest

VARIANTS = {"quest-sum": "quest", "arkvale-sum": "arkvale"}  # variant -> base algorithm


class QuestSum(Quest):
    def score(self, q, page_table, num_pages, last_page_len, summaries, k_cache):
        """[B, Hkv, W] float32: the group's summed bounds, -inf past num_pages."""
        return score_pages(q, summaries["kmin"], summaries["kmax"], None, page_table, num_pages,
                           "quest")


class ArkValeSum(ArkVale, QuestSum):  # ArkVale's index (the c -/+ r box), QuestSum's score
    score = QuestSum.score


CLASSES = {"quest-sum": QuestSum, "arkvale-sum": ArkValeSum}
