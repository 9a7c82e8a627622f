"""The sparse-algorithm interface (DESIGN.md §4).

An algorithm writes two operations and declares its summaries:

* ``index``  — fold pages that just filled into the algorithm's per-page summaries;
* ``score``  — score a request's candidate pages from those summaries (the algorithm half of
  ``select``); the shared ``select`` adds the always-kept pages (sink, local window, partial
  last page) and takes a fixed-size top-k, all on the device with fixed shapes.

``attend`` (paged decode over the selected pages), ``retrieve`` (map selected pages to device
slots, loading misses) and ``offload`` belong to the engine. Summaries are allocated by the
engine from ``summary_names``: one ``[num_pages + 1, head_dim]`` tensor each per layer, in the
KV dtype (the extra row is a scratch page for masked lanes).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_REGISTRY: dict[str, type["SparseAlgorithm"]] = {}


def register(name: str):
    def deco(cls):
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return deco


def get_algorithm_class(name: str) -> type["SparseAlgorithm"]:
    if name not in _REGISTRY:
        raise ValueError(f"Unknown sparse_algorithm {name!r}; available: {sorted(_REGISTRY)}.")
    return _REGISTRY[name]


def available_algorithms() -> list[str]:
    return sorted(_REGISTRY)


@dataclass
class LayerSummaries:
    """Per-layer summary tensors, by name: each [num_pages + 1, head_dim]."""

    tensors: dict[str, torch.Tensor]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]


@dataclass
class Selection:
    """What attend reads: per (request, KV head) a list of pages, the partial last page last."""

    page_table: torch.Tensor  # [B, Hkv, budget_pages] int32 physical page ids
    num_pages: torch.Tensor  # [B, Hkv] int32 valid entries
    last_page_len: torch.Tensor  # [B] int32 tokens in entry num_pages - 1
    blocks: torch.Tensor  # [B, Hkv, budget_pages] int64 logical page index of each entry


class SparseAlgorithm:
    name = "base"
    summary_names: tuple[str, ...] = ()
    uses_queries = False  # index() wants the queries of the tokens that filled each page

    def __init__(self, page_size: int, budget_pages: int, sink_pages: int,
                 local_pages: int) -> None:
        self.page_size = page_size
        self.budget_pages = budget_pages
        self.sink_pages = sink_pages
        self.local_pages = local_pages
        # one scratch row per summary name, shared by all layers (e.g. ArkVale's radius)
        self.scratch: dict[str, torch.Tensor] = {}

    # ---- algorithm operations -------------------------------------------------------------
    def index(self, k_cache: torch.Tensor, page_ids: torch.Tensor, num_tokens: torch.Tensor,
              summaries: LayerSummaries, queries: torch.Tensor | None) -> None:
        """Fold filled pages into summaries.

        page_ids [N] int32 (< 0 = masked lane), num_tokens [N] int32 (valid tokens, usually
        page_size); queries [N, G, D] or None: the queries of the KV head's group at the
        position that filled each page (InfLLM-style algorithms use them)."""

    def score(self, q: torch.Tensor, page_table: torch.Tensor, num_pages: torch.Tensor,
              last_page_len: torch.Tensor, summaries: LayerSummaries,
              k_cache: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, D], page_table [B, Hkv, W] physical pages, num_pages [B, Hkv],
        last_page_len [B] -> scores [B, Hkv, W] float32 (-inf past num_pages)."""
        raise NotImplementedError

    # ---- shared select --------------------------------------------------------------------
    def select(self, q: torch.Tensor, page_table: torch.Tensor, num_pages: torch.Tensor,
               last_page_len: torch.Tensor, summaries: LayerSummaries,
               k_cache: torch.Tensor) -> Selection:
        """page_table [B, Hkv, W]: all of each request's pages in order; num_pages [B, Hkv]
        (all pages); last_page_len [B]. Fixed shapes, no host sync."""
        B, hkv, W = page_table.shape
        scores = self.score(q, page_table, num_pages, last_page_len, summaries, k_cache)
        n = num_pages.long().unsqueeze(-1)  # [B, Hkv, 1]
        blk = torch.arange(W, device=q.device).view(1, 1, W)
        forced = ((blk < self.sink_pages) | (blk >= n - self.local_pages)) & (blk < n)
        scores = torch.where(forced, torch.full_like(scores, float("inf")), scores)
        # the last page is appended at the end of the list (attend needs it there)
        scores = torch.where(blk == n - 1, torch.full_like(scores, float("-inf")), scores)
        k = max(1, min(self.budget_pages - 1, W))
        vals, idx = scores.topk(k, dim=-1)  # [B, Hkv, k]
        num_sel = (vals > float("-inf")).sum(-1) + 1  # [B, Hkv]
        blocks = torch.cat([idx, torch.zeros_like(idx[..., :1])], dim=-1)
        blocks.scatter_(2, (num_sel - 1).unsqueeze(-1), n - 1)
        phys = page_table.gather(2, blocks.to(page_table.dtype).long())
        return Selection(phys.to(torch.int32), num_sel.to(torch.int32), last_page_len, blocks)
