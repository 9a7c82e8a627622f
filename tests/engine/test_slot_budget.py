"""SlotBudget (engine/slot_budget.py): per-layer slot accounting of one step."""
from sparseserve.engine.slot_budget import SlotBudget


def budget() -> SlotBudget:
    # 1,000 slots per layer, 4 KV heads, 32-token pages, a 16-page token budget, 8 rows
    return SlotBudget(1000, 4, 32, 16, 8, working_set_control=True)


def test_extend_charges_the_growth_over_pinned_slots_once():
    """A slot-free prompt reserves its first decode selection (64 slots, unpinned), then keeps
    R resident pages (pinned next step). Next step its reservation is discounted by what it
    pinned, once: the charge is max(0, 64 + R2 - R1), not max(0, 64 - R1) + max(0, R2 - R1)."""
    b = budget()
    reserve = b.reserve
    b.start_step()
    assert b.try_take(0, "a", 64, False)
    assert b.extend(0, "a", 200)
    assert b.left == 1000 - reserve - 264
    assert b.prefill_now == {"a": 200} and b.needs == {0: 264}
    b.start_step()  # "a" pinned 200 (its resident pages of the last step's layers)
    assert b.left == 1000 - reserve - 200
    assert b.try_take(0, "a", 64, False)  # covered by the pinned slots: charged 0
    assert b.left == 1000 - reserve - 200
    assert b.extend(0, "a", 180)  # total 244 over 200 pinned: 44 more, not 0
    assert b.left == 1000 - reserve - 244
    assert b.needs == {0: 244}


def test_extend_refuses_what_does_not_fit():
    b = budget()
    b.start_step()
    assert b.try_take(0, "a", 64, False)
    left = b.left
    assert not b.extend(0, "a", left + 1)
    assert b.left == left and b.needs == {0: 64} and b.prefill_now == {}
    assert b.extend(0, "a", left) and b.left == 0
