"""Dynamic sparse attention: the five-operation interface and its algorithms."""
from sparseserve.sparse import algorithms  # noqa: F401  (registers the algorithms)
from sparseserve.sparse import keycodes, subpage  # noqa: F401  (token key codes, sub-page boxes)
from sparseserve.sparse import keycode_shortlist  # noqa: F401  (key codes of a box shortlist)
from sparseserve.sparse import retroinfer  # noqa: F401  (RetroInfer-style clusters + estimation zone)
from sparseserve.sparse import shadowkv  # noqa: F401  (ShadowKV-style chunk landmarks)
from sparseserve.sparse import keycode_channels  # noqa: F401  (key codes on a few channels per page)
from sparseserve.sparse import keycode_sparq  # noqa: F401  (key codes on channels chosen per query)
from sparseserve.sparse.base import (LayerSummaries, Selection, SparseAlgorithm,
                                     available_algorithms, get_algorithm_class, register)

__all__ = ["LayerSummaries", "Selection", "SparseAlgorithm", "available_algorithms",
           "get_algorithm_class", "register"]
