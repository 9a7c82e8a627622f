"""Sub-page summary boxes: Quest / ArkVale with several boxes per page (the partition is finer
than the page; pages stay the unit of selection, transfer and caching).

Why: a 32-token page's per-channel box is loose — a max over 32 keys per channel — so the bound
of the one page that holds a passage copied from far back is not far above the bounds of the
hundreds of pages whose boxes overlap it (measured in docs/results/fidelity.md: the exact top-k
oracle, choosing among the same pages, finds it). Boxes over 8 or 16 tokens are tighter; a
page's bound per query head is the max of its boxes' bounds (still a sound upper bound of its
largest logit), then the estimated-attention-mass scoring and the shared select / fused kernel
run unchanged (``kernels.select_pages(..., n_sub=...)``).

Cost: ``2 * page_size / box_tokens`` summary vectors per page instead of 2 — at 16-token boxes
4 / 32 = 12.5 % of the page's K bytes (6.25 % of its KV bytes), at 8-token boxes 12.5 % of KV
bytes — and the same factor on the summary bytes the select reads.
"""
from __future__ import annotations

from sparseserve.sparse.algorithms import ArkVale, Quest
from sparseserve.sparse.base import register


@register("quest-b16")
class QuestBox16(Quest):
    """Quest with a min/max box per 16 tokens (two per 32-token page)."""

    box_tokens = 16


@register("quest-b8")
class QuestBox8(Quest):
    """Quest with a min/max box per 8 tokens (four per 32-token page)."""

    box_tokens = 8


@register("arkvale-b16")
class ArkValeBox16(ArkVale):
    """ArkVale with a cuboid-mean box per 16 tokens (two per 32-token page)."""

    box_tokens = 16


@register("arkvale-b8")
class ArkValeBox8(ArkVale):
    """ArkVale with a cuboid-mean box per 8 tokens (four per 32-token page)."""

    box_tokens = 8
