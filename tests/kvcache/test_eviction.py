"""Victim order of the device page cache: free slots first, then over-quota rows, then the
oldest recency bucket; slots used in the current step never come before any other slot."""
import torch

from sparseserve.kvcache.eviction import NUM_BUCKETS, victim_order


def order(last, owner, quota, step, policy):
    return victim_order(torch.tensor(last), torch.tensor(owner), torch.tensor(quota),
                        torch.tensor(step), policy).tolist()


def test_free_then_oldest_and_current_step_last():
    # slot: 0 free, 1 used now, 2 age 5, 3 age 1, 4 age 100, 5 free
    last = [-1, 1000, 995, 999, 900, -1]
    owner = [2, 0, 0, 1, 1, 2]
    quota = [100, 100, 100]
    for policy in ("category-lru", "lru"):
        o = order(last, owner, quota, 1000, policy)
        assert set(o[:2]) == {0, 5}
        assert o[2:5] == [4, 2, 3]
        assert o[-1] == 1


def test_category_lru_buckets_old_slots_together():
    step = 1000
    ages = [70, 500, 64, 3]
    last = [step - a for a in ages]
    owner = [0] * 4
    cat = order(last, owner, [100], step, "category-lru")
    lru = order(last, owner, [100], step, "lru")
    assert lru == [1, 0, 2, 3]
    # ages >= NUM_BUCKETS - 1 share the oldest bucket: any order among them, then age 3
    assert set(cat[:3]) == {0, 1, 2} and cat[3] == 3
    assert NUM_BUCKETS == 64


def test_over_quota_rows_evicted_before_older_in_quota_slots():
    step = 50
    last = [10, 11, 48, 49, 47]  # row 0 holds slots 2, 3, 4 (recent) over its quota of 2
    owner = [1, 1, 0, 0, 0]
    o = order(last, owner, [2, 10, 10], step, "lru")
    assert set(o[:3]) == {2, 3, 4}
    assert o[3:] == [0, 1]
