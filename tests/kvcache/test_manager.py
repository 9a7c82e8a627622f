"""KVCacheManager with page chunks (first level of the two-level page table): pages of a
(request, KV head) come in runs of C consecutive ids, the per-page view matches the chunk
table, capacity is counted in whole chunks, nothing leaks."""
import numpy as np
import pytest

from sparseserve.kvcache.manager import KVCacheManager, expand_chunks
from sparseserve.kvcache.page_pool import OutOfPagesError


@pytest.mark.parametrize("chunk_pages", [1, 4, 16])
def test_pages_come_in_chunks(chunk_pages):
    m = KVCacheManager(num_pages=16 * 40 + 3, page_size=8, num_kv_heads=2,
                       chunk_pages=chunk_pages)
    assert m.num_pages == (16 * 40 + 3) // chunk_pages * chunk_pages
    grown = {}
    for step, n in enumerate([1, 17, 54, 97, 97, 130]):
        rid = f"r{step % 3}"
        grown[rid] = max(grown.get(rid, 0), n)
        m.allocate(rid, grown[rid])
        pt = m.page_table(rid)
        assert pt.shape == (-(-grown[rid] // 8), 2)
        ch = m.chunk_table(rid)
        for j in range(pt.shape[0]):
            assert np.all(pt[j] == ch[j // chunk_pages] * chunk_pages + j % chunk_pages)
    all_pages = np.concatenate([m.page_table(r).ravel() for r in grown])
    assert len(np.unique(all_pages)) == all_pages.size  # no page shared between requests
    m.check_invariants()
    for r in grown:
        m.free(r)
    m.check_invariants()
    assert m.num_free_pages == m.num_pages


def test_capacity_in_whole_chunks():
    m = KVCacheManager(num_pages=64, page_size=8, num_kv_heads=2, chunk_pages=16)
    # 4 chunks = 2 per head = 32 pages of 8 tokens per head
    assert m.can_allocate("a", 256) and not m.can_allocate("a", 257)
    assert m.pages_needed("a", 1) == 32  # one chunk per head
    m.allocate("a", 100)
    assert m.num_free_pages == 32 and m.pages_needed("a", 200) == 32
    m.allocate("a", 200)
    assert m.num_free_pages == 0 and not m.can_allocate("b", 1)
    with pytest.raises(OutOfPagesError):
        m.allocate("b", 1)
    m.free("a")
    assert m.num_free_pages == 64


def test_expand_chunks_truncates_to_blocks():
    ch = np.array([[3, 5]], np.int32)
    assert expand_chunks(ch, 4, 3).tolist() == [[12, 20], [13, 21], [14, 22]]
    with pytest.raises(ValueError):
        KVCacheManager(num_pages=3, page_size=8, num_kv_heads=1, chunk_pages=4)
