"""The worker's side of sparse attention: the algorithm, its per-layer summaries (owned
here, on the device), and which layers stay dense."""
from __future__ import annotations

import torch

from sparseserve.config import SparseConfig
from sparseserve.sparse import LayerSummaries, SparseAlgorithm, get_algorithm_class


class SparseRuntime:
    def __init__(self, cfg: SparseConfig, num_layers: int, num_pages: int, page_size: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device,
                 page_chunk: int = 1) -> None:
        """page_chunk: the page ids' allocation runs (CacheConfig.chunk_pages), which a
        summary layout may interleave (SparseAlgorithm.make_summaries)."""
        cls = get_algorithm_class(cfg.algorithm)
        self.algorithm: SparseAlgorithm = cls(page_size, cfg.token_budget // page_size,
                                              cfg.sink_pages, cfg.local_pages)
        self.dense_layers = cfg.dense_layers
        self.needs_queries = getattr(self.algorithm, "uses_queries", False)
        # one flat row per page (+ a scratch row) per summary and sparse layer, of the
        # algorithm's own row shape (SparseAlgorithm.summary_shapes)
        self.summaries: list[LayerSummaries | None] = [
            None if layer < cfg.dense_layers else
            self.algorithm.make_summaries(num_pages + 1, head_dim, dtype, device, page_chunk)
            for layer in range(num_layers)]

    def is_sparse(self, layer: int) -> bool:
        return layer >= self.dense_layers

    def summary_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.summaries if s is not None
                   for t in s.tensors.values())
