"""Selection reuse as the fidelity evaluation models it (benchmarks/fidelity_reuse.py): each
teacher-forced row takes the scores of the row at its anchor position (its position rounded
down to a multiple of k), without the pages the anchor did not have yet; and the generic
select over those scores keeps the row's own sink and local pages."""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from fidelity_reuse import anchored_scores, reuse_class  # noqa: E402

from sparseserve.sparse.base import SparseAlgorithm  # noqa: E402


def rows_at(positions, page_size, hkv=2, w=12):
    ntok = torch.tensor(positions) + 1
    num_pages = ((ntok + page_size - 1) // page_size).view(-1, 1).repeat(1, hkv).int()
    last = (ntok - (num_pages[:, 0].long() - 1) * page_size).int()
    return num_pages, last


def test_rows_take_their_anchor_rows_scores_and_lose_pages_born_after_it():
    ps, k = 4, 4
    positions = list(range(13, 13 + 9))  # 13..21: anchors 12 (not in the batch), 16, 20
    num_pages, last = rows_at(positions, ps)
    scores = torch.randn(len(positions), 2, 12)
    out = anchored_scores(scores, num_pages, last, ps, k)
    for r, p in enumerate(positions):
        a = p - p % k
        src = r - (p - a) if a >= positions[0] else r  # anchor outside the batch: itself
        n = int(num_pages[src, 0])
        assert torch.equal(out[r, :, :n], scores[src, :, :n]), (r, p)
        assert torch.isinf(out[r, :, n:]).all() and (out[r, :, n:] < 0).all()


class _Fixed(SparseAlgorithm):
    """Scores given by the test (the inner algorithm's)."""
    fixed: torch.Tensor

    def score(self, q, page_table, num_pages, last_page_len, summaries, k_cache):
        return self.fixed


def test_generic_select_over_reused_scores_keeps_the_rows_own_local_pages():
    ps, k, budget = 4, 4, 4
    a = reuse_class(_Fixed, k)(ps, budget, 1, 1)
    positions = [16, 17, 18, 19, 20]  # 20 opens page 5 after the anchor 16 (pages 0..4)
    num_pages, last = rows_at(positions, ps, hkv=1, w=8)
    a.fixed = torch.full((5, 1, 8), float("-inf"))
    for r in range(5):  # row r's own favourite pages differ; the anchor's must win
        n = int(num_pages[r, 0])
        a.fixed[r, 0, :n] = torch.arange(n).float() * (1 if r % 2 else -1)
    table = torch.arange(8).view(1, 1, 8).repeat(5, 1, 1).int()
    sel = a.select(torch.zeros(5, 1, 8), table, num_pages, last, None, None)
    anchor_pick = set(sel.blocks[0, 0, :int(sel.num_pages[0, 0])].tolist())
    for r in range(5):
        blocks = set(sel.blocks[r, 0, :int(sel.num_pages[r, 0])].tolist())
        n = int(num_pages[r, 0])
        assert {0, n - 1} <= blocks  # sink and the row's own last (local) page
        assert len(blocks) == min(budget, n)
        if r < 4:  # rows 16..19 share the anchor's pages exactly
            assert blocks == anchor_pick, r
