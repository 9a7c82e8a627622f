"""The worked example in sparse/base.py's docstring runs as written and scores exactly like the
registered two-boxes-per-page Quest (quest-b16 at page 32)."""
import textwrap

import torch

import sparseserve.sparse.base as base
from sparseserve.sparse import get_algorithm_class


def test_worked_example_equals_quest_b16():
    src = base.__doc__.split("::\n\n", 1)[1].split("\n\n(A partial")[0]
    src = textwrap.dedent(src).replace('@register("quest-half")\n', "")  # keep the registry
    ns = dict(SparseAlgorithm=base.SparseAlgorithm)
    exec(src, ns)
    a, b = ns["QuestHalf"](32, 4, 1, 1), get_algorithm_class("quest-b16")(32, 4, 1, 1)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(41, 32, 16, generator=gen)
    sa, sb = a.make_summaries(42, 16), b.make_summaries(42, 16)
    ids, nt = torch.arange(40, dtype=torch.int32), torch.full((40,), 32, dtype=torch.int32)
    a.index(k, ids, nt, sa, None)
    b.index(k, ids, nt, sb, None)
    q = torch.randn(2, 4, 16, generator=gen)
    pt = torch.arange(40, dtype=torch.int32).view(2, 1, 20).repeat(1, 2, 1)
    n = torch.tensor([[20, 19], [7, 1]], dtype=torch.int32)
    assert torch.equal(a.score(q, pt, n, None, sa, None), b.score(q, pt, n, None, sb, None))
    sel = a.select(q, pt, n, torch.tensor([5, 9], dtype=torch.int32), sa, None)
    assert sel.num_pages.tolist() == [[4, 4], [4, 1]]
