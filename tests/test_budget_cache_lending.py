"""Branch cachebug: growing the pool (--reap-budget auto | GiB) after a device cache borrowed
slots [K, P) must not hand those slots to the swap table (SlotTable.grow numbers new slots from
its own end K: plan experts would be swapped onto cache slots, one HBM page with two owners)."""

from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

from reap_swap.cache.slot_table import SlotTable  # noqa: E402
from reap_swap.engine.residency import budget  # noqa: E402
from reap_swap.sizing.memory_split import BudgetError  # noqa: E402


class _Pool:
    def __init__(self, n):
        self.num_slots, self.grown = n, 0

    def grow(self, extra):
        self.num_slots += extra
        self.grown += extra


def test_growth_with_lent_cache_slots_is_refused_before_anything_moves():
    st = SimpleNamespace(pool=_Pool(768), table=SlotTable(384), plan=None, layers={})
    growth = SimpleNamespace(extra_slots=64)
    with pytest.raises(BudgetError, match="lent to the cache tails"):
        budget.grow_and_fill(st, growth, 64)
    assert st.pool.grown == 0 and st.table.num_slots == 384  # nothing half-applied
    assert budget.lent_slots(st) == 384


def test_what_the_refusal_prevents():
    table = SlotTable(384)  # slots [384, 768) are lent to the caches
    table.grow(64)
    assert set(range(384, 448)) <= set(table._free)  # the grown table would hand out lent slots


def test_no_lending_no_refusal():
    st = SimpleNamespace(pool=_Pool(384), table=SlotTable(384))
    assert budget.lent_slots(st) == 0
