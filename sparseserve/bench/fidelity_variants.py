"""Scoring variants evaluated next to the registered algorithms (baselines, not engine code).
Same summaries, same kept pages, the generic select; only ``from_bounds`` (per-query-head
bounds -> page scores) differs from Quest / ArkVale's:

* ``*-sum``: the bounds summed raw over the GQA group (``sum_g sum_c max(q_gc M_c, q_gc m_c)``)
  — how Quest and ArkVale scored pages before the estimated-attention-mass scoring
  (``ref.mass_from_bounds``) replaced it;
* ``*-massscored``: mass scoring whose per-head softmax runs over the scored pages only (not
  the always-kept sink / local-window pages), the alternative to the engine's normalisation
  over every full page.
"""
from __future__ import annotations

from sparseserve.kernels.ref import mass_from_bounds
from sparseserve.sparse.algorithms import ArkVale, Quest

# variant -> base algorithm (whose summaries and index() it uses)
VARIANTS = {"quest-sum": "quest", "arkvale-sum": "arkvale", "quest-massscored": "quest",
            "arkvale-massscored": "arkvale"}


class QuestSum(Quest):
    def from_bounds(self, bounds, num_pages, scale):
        """[B, Hkv, W]: the group's summed bounds (-inf past num_pages, as the bounds)."""
        return bounds.sum(2)


class QuestMassScored(Quest):
    def from_bounds(self, bounds, num_pages, scale):
        """[B, Hkv, W]: mass normalised over the scored pages only."""
        return mass_from_bounds(bounds, num_pages, self.sink_pages, self.local_pages, scale,
                                normalise_kept=False)


class ArkValeSum(ArkVale, QuestSum):  # ArkVale's index (the c -/+ r box), QuestSum's scores
    from_bounds = QuestSum.from_bounds


class ArkValeMassScored(ArkVale, QuestMassScored):
    from_bounds = QuestMassScored.from_bounds


CLASSES = {"quest-sum": QuestSum, "arkvale-sum": ArkValeSum,
           "quest-massscored": QuestMassScored, "arkvale-massscored": ArkValeMassScored}
