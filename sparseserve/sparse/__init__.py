"""Dynamic sparse attention: the five-operation interface and its algorithms."""
from sparseserve.sparse import algorithms  # noqa: F401  (registers the algorithms)
from sparseserve.sparse import subpage  # noqa: F401  (sub-page box variants)
from sparseserve.sparse.base import (LayerSummaries, Selection, SparseAlgorithm,
                                     available_algorithms, get_algorithm_class, register)

__all__ = ["LayerSummaries", "Selection", "SparseAlgorithm", "available_algorithms",
           "get_algorithm_class", "register"]
