"""The sparse-algorithm interface (DESIGN.md §4): five operations, two of them the algorithm's.

An algorithm writes ``index`` and ``score`` (the algorithm half of ``select``) and declares its
summaries; ``attend`` (paged decode over the selected pages), ``retrieve`` (map selected pages to
device slots, loading misses) and ``offload`` belong to the engine and are page-granular for
every algorithm. What an algorithm controls:

* **Summaries at its own granularity and size.** ``summary_shapes(head_dim)`` declares, per
  summary name, the shape of one *page's* row: ``(head_dim,)`` for one vector per page (Quest's
  min/max box, the default built from ``summary_names``), ``(n_sub, head_dim)`` for several
  partitions per page (sub-page boxes, ShadowKV-style landmarks of 8-token chunks), or any
  other fixed shape (a cluster id per token: ``(page_size,)``). The engine allocates each as
  ``[num_pages + 1, numel(shape)]`` in the KV dtype — one flat row per page, so the two-tier
  cache, the scratch-table indexing under offload and every copy stay row-per-page (the extra
  row is a scratch page for masked lanes) —; ``LayerSummaries.view(name)`` gives it back as
  ``[num_pages + 1, *shape]``.
* **Partitions finer than a page, pages chosen through the shared machinery.** ``score``
  returns one score per *page* ``[B, Hkv, W]``; an algorithm with sub-page partitions reduces
  its partition scores to the page that holds them (e.g. the max over the page's sub-blocks,
  a sound bound on the page's best logit), and the shared ``select`` — kept pages, fixed-size
  top-k, the last page last — does the rest. Transfers and the device cache only ever see
  pages, whatever the partition.
* **An estimate of the unselected mass** (optional): ``estimate`` returns, per query head,
  the log-sum-exp of the estimated logits of what was *not* selected and the matching
  (unnormalised-then-normalised) value estimate; the engine merges it with the exact attention
  over the selected pages through log-sum-exp (``kernels.ref.merge_attention``). ``None`` (the
  default) means exact attention over the selection only. Value summaries need the values:
  an algorithm with ``uses_values`` gets ``index(..., v_cache=)`` (``sparse/retroinfer.py``).

Worked example — Quest with two boxes per page, complete (``sparse/subpage.py`` registers the
real ones through ``Quest.box_tokens``; their fused kernel is ``kernels.select_pages(...,
n_sub=)``; ``sparse/keycodes.py`` is a second, token-level example with int32 summaries)::

    from sparseserve.kernels import head_bounds, update_page_summaries
    from sparseserve.kernels.ref import mass_from_bounds, sub_page_rows

    @register("quest-half")
    class QuestHalf(SparseAlgorithm):
        summary_names = ("kmin", "kmax")

        def summary_shapes(self, head_dim):       # each page row: two [D] boxes
            return {n: (2, head_dim) for n in self.summary_names}

        def index(self, k_cache, page_ids, num_tokens, summaries, queries):
            P, ps, D = k_cache.shape              # the pages as twice as many half pages
            ids, ntok = sub_page_rows(page_ids, num_tokens, 2, ps // 2)  # p -> 2p, 2p + 1
            update_page_summaries(k_cache.reshape(P * 2, ps // 2, D), ids, ntok,
                                  summaries["kmin"].view(-1, D), summaries["kmax"].view(-1, D))

        def score(self, q, page_table, num_pages, last_page_len, summaries, k_cache):
            # per query head, each page's bound = the max of its two boxes' bounds
            u = head_bounds(q, summaries["kmin"], summaries["kmax"], page_table, num_pages,
                            n_sub=2)
            return mass_from_bounds(u, num_pages, self.sink_pages, self.local_pages,
                                    q.shape[-1] ** -0.5)

(A partial page's empty half keeps stale values here; ``Quest._index_boxes`` copies box 0
into empty boxes. The engine only indexes full pages.)

``score`` may return anything ordered like "more worth attending" (``-inf`` past
``num_pages``); kept pages are forced by ``select``. A new algorithm is one file plus its
``@register`` and an import in ``sparse/__init__.py``; tests/sparse runs every registered
algorithm against dense at a budget that covers every page.
"""
from __future__ import annotations

import math
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
    """Per-layer summary tensors, by name: each [num_pages + 1, numel(row shape)], one flat row
    per page (``SparseAlgorithm.summary_shapes``); ``view`` restores the row shape."""

    tensors: dict[str, torch.Tensor]
    shapes: dict[str, tuple[int, ...]] | None = None  # name -> one page's row shape
    # pages per chunk of a layout that interleaves consecutive pages' rows (keycode2-sparq's
    # records, ``sparq_records.interleave``); 1: every row is its page's
    interleave: int = 1

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def view(self, name: str) -> torch.Tensor:
        """[rows, *row shape] view of summary ``name`` (no copy)."""
        t = self.tensors[name]
        shape = (self.shapes or {}).get(name, (t.shape[1],))
        return t.view(t.shape[0], *shape)


@dataclass
class Selection:
    """What attend reads: per (request, KV head) a list of pages, the partial last page last."""

    page_table: torch.Tensor  # [B, Hkv, budget_pages] int32 physical page ids
    num_pages: torch.Tensor  # [B, Hkv] int32 valid entries
    last_page_len: torch.Tensor  # [B] int32 tokens in entry num_pages - 1
    blocks: torch.Tensor  # [B, Hkv, budget_pages] int64 logical page index of each entry


class SparseAlgorithm:
    """Stateless between calls: every tensor an algorithm uses is a summary (owned by the
    worker) or allocated inside the call. A decode step captured in a CUDA graph keeps the
    address of every buffer it touched, so a buffer kept on the algorithm and replaced by a
    later call of another size would be written through a freed address on every replay
    (tests/sparse/test_algorithm_state.py holds every registered algorithm to this)."""

    name = "base"
    summary_names: tuple[str, ...] = ()
    uses_queries = False  # index() wants the queries of the tokens that filled each page
    # index() wants the filled pages' values too: the engine passes ``v_cache=`` (the V pages,
    # laid out like k_cache) to such an algorithm only, so value summaries (e.g. the per-cluster
    # value means an estimate needs) live in summaries like any other
    uses_values = False
    estimates = False  # estimate() contributes the unselected mass (see the module docstring)
    # index() takes `write_ids` (summary of page_ids[i]'s keys written at row write_ids[i]):
    # the two-tier cache then summarises pages where they lie (device slots, the prefill's
    # K) without a scratch table and its copies (worker/offload_context.py)
    indexes_apart = False

    def __init__(self, page_size: int, budget_pages: int, sink_pages: int,
                 local_pages: int) -> None:
        self.page_size = page_size
        self.budget_pages = budget_pages
        self.sink_pages = sink_pages
        self.local_pages = local_pages

    # ---- summaries --------------------------------------------------------------------------
    def summary_shapes(self, head_dim: int) -> dict[str, tuple[int, ...]]:
        """Per summary name, one page's row shape (default: one [head_dim] vector)."""
        return {n: (head_dim,) for n in self.summary_names}

    def summary_dtypes(self) -> dict[str, torch.dtype]:
        """Summaries whose dtype is not the KV dtype (e.g. int32 packed code bits), by name."""
        return {}

    def make_summaries(self, rows: int, head_dim: int, dtype=torch.float32,
                       device=None, page_chunk: int = 1) -> LayerSummaries:
        """Zeroed summaries of one layer: [rows, numel(shape)] per name (rows = pages + 1),
        in ``dtype`` (the KV dtype) unless ``summary_dtypes`` says otherwise. ``page_chunk``:
        page ids come in aligned runs of that many consecutive ids of one (request, KV head)
        (the two-tier cache's host pages): a layout may interleave such runs (default: no)."""
        shapes, dts = self.summary_shapes(head_dim), self.summary_dtypes()
        return LayerSummaries({n: torch.zeros((rows, math.prod(s)), dtype=dts.get(n, dtype),
                                              device=device)
                               for n, s in shapes.items()}, shapes)

    def summary_bytes(self, rows: int, head_dim: int, element_size: int,
                      device_type: str = "cpu", page_chunk: int = 1) -> int:
        """Bytes of one layer's summaries as ``make_summaries`` allocates them for ``rows``
        rows on a ``device_type`` device (a layout may pad, e.g. to whole page chunks)."""
        return rows * self.summary_bytes_per_page(head_dim, element_size)

    def summary_bytes_per_page(self, head_dim: int, element_size: int) -> int:
        """Summary bytes one page costs (``element_size``: the KV dtype's)."""
        dts = self.summary_dtypes()
        return sum(math.prod(s) * (dts[n].itemsize if n in dts else element_size)
                   for n, s in self.summary_shapes(head_dim).items())

    # ---- algorithm operations -------------------------------------------------------------
    def index(self, k_cache: torch.Tensor, page_ids: torch.Tensor, num_tokens: torch.Tensor,
              summaries: LayerSummaries, queries: torch.Tensor | None) -> None:
        """Fold filled pages into summaries.

        page_ids [N] int32 (< 0 = masked lane), num_tokens [N] int32 (valid tokens, usually
        page_size); queries [N, G, D] or None: the queries of the KV head's group at the
        position that filled each page (InfLLM-style algorithms use them). An algorithm with
        ``uses_values`` takes a keyword ``v_cache`` too (the V pages, indexed like k_cache);
        one with ``indexes_apart`` a keyword ``write_ids`` [N] (write page_ids[i]'s summary
        at row write_ids[i] instead of page_ids[i])."""

    def score(self, q: torch.Tensor, page_table: torch.Tensor, num_pages: torch.Tensor,
              last_page_len: torch.Tensor, summaries: LayerSummaries,
              k_cache: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, D], page_table [B, Hkv, W] physical pages, num_pages [B, Hkv],
        last_page_len [B] -> scores [B, Hkv, W] float32 (-inf past num_pages)."""
        raise NotImplementedError

    def estimate(self, q: torch.Tensor, sel: "Selection", page_table: torch.Tensor,
                 num_pages: torch.Tensor, summaries: LayerSummaries, scale: float):
        """Optional estimate of the attention the selection leaves out (``estimates = True``):
        (o_est [B, Hq, D] float32, lse_est [B, Hq] float32) — the normalised value estimate
        and the log-sum-exp of the estimated logits (at ``scale``) of the unselected tokens,
        ``-inf`` where nothing is estimated. Merged with the exact attention over ``sel`` by
        ``kernels.ref.merge_attention``. Default: nothing (exact attention only).

        The engine calls it after attend, for an algorithm with ``estimates``, with the decode
        queries, ``select``'s Selection and the page table / num_pages ``select`` got (logical
        pages in order, the ids summaries are indexed by), then merges with the exact part's
        log-sum-exp (``ref.paged_decode_lse`` over the attended pages). The estimated tokens
        must be disjoint from the selection: with every page selected it returns -inf."""
        return None

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
