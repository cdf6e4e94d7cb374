"""The swap bookkeeping and its failure handling, against a fake expert store (no GPU)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reap_swap.cache.slot_table import PoolCapacityError, SlotTable
from reap_swap.engine.residency.swap import SwapStepFailed, apply_swap

LAYERS, EXPERTS = 3, 8


class FakeStore:
    """Host masters, HBM slots and a per-expert mapping, like the VMM store, in Python objects.

    Like the CUDA store, a remapped expert is unreadable until publish(): a copy from it (or a
    kernel reading it) before then is a fault -- on the H200 a segfault in cuMemcpyDtoDAsync.
    """

    bytes_per_expert = 100

    def __init__(self, num_slots: int, fail_at_map: int | None = None):
        self.master = {(l, e): f"w{l}.{e}" for l in range(LAYERS) for e in range(EXPERTS)}
        self.slots: list[str | None] = [None] * num_slots
        self.mapping: dict[tuple[int, int], int | None] = {k: None for k in self.master}
        self.events: list[tuple] = []
        self.fail_at_map = fail_at_map
        self.maps = 0
        self.unpublished: set[tuple[int, int]] = set()

    def quiesce(self):
        self.events.append(("quiesce",))

    def map_host(self, layer, expert):
        self.events.append(("evict", layer, expert))
        self.mapping[(layer, expert)] = None
        self.unpublished.add((layer, expert))

    def start_copy(self, layer, expert, slot):
        # a slot that some expert is still mapped to must never be overwritten
        assert slot not in self.mapping.values(), f"copy into slot {slot} that is still mapped"
        assert (layer, expert) not in self.unpublished, f"copy from unpublished expert {layer}.{expert}"
        self.slots[slot] = self.master[(layer, expert)]
        self.events.append(("copy", layer, expert, slot))
        return (layer, expert, slot)

    def wait_copy(self, token):
        pass

    def map_slot(self, layer, expert, slot):
        self.maps += 1
        if self.fail_at_map is not None and self.maps == self.fail_at_map:
            raise RuntimeError("injected remap failure")
        assert self.slots[slot] == self.master[(layer, expert)]
        self.mapping[(layer, expert)] = slot
        self.unpublished.add((layer, expert))

    def publish(self):
        self.events.append(("publish",))
        self.unpublished.clear()

    def read(self, layer, expert):
        assert (layer, expert) not in self.unpublished, f"kernel read of unpublished expert {layer}.{expert}"
        slot = self.mapping[(layer, expert)]
        return self.master[(layer, expert)] if slot is None else self.slots[slot]

    def device_resident(self):
        out: dict[int, set] = {}
        for (l, e), slot in self.mapping.items():
            if slot is not None:
                out.setdefault(l, set()).add(e)
        return {l: frozenset(v) for l, v in out.items()}


def _check_consistent(table: SlotTable, store: FakeStore):
    assert table.resident() == store.device_resident()
    for key in store.master:
        assert store.read(*key) == store.master[key]


targets = st.dictionaries(
    st.integers(0, LAYERS - 1), st.frozensets(st.integers(0, EXPERTS - 1), max_size=EXPERTS), max_size=LAYERS
)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 12), st.lists(targets, min_size=1, max_size=6))
def test_swaps_keep_table_and_store_consistent(num_slots, sequence):
    table, store = SlotTable(num_slots), FakeStore(num_slots)
    for target in sequence:
        wanted = sum(len(v) for v in target.values())
        before = table.resident()
        if wanted > num_slots:
            with pytest.raises(PoolCapacityError) as err:
                apply_swap(table, store, target)
            assert err.value.overflow == wanted - num_slots
            assert table.resident() == before  # nothing moved
        else:
            result = apply_swap(table, store, target)
            assert table.resident() == {l: frozenset(v) for l, v in target.items() if v}
            assert result.bytes_copied == len(result.plan.admit) * store.bytes_per_expert
            assert table.used <= num_slots
        _check_consistent(table, store)


def test_evictions_happen_before_copies_into_their_slots():
    table, store = SlotTable(2), FakeStore(2)
    apply_swap(table, store, {0: {0, 1}})
    store.events.clear()
    apply_swap(table, store, {0: {1}, 1: {5}})  # evict 0.0, admit 1.5 into its slot
    kinds = [e[0] for e in store.events]
    assert kinds.index("evict") < kinds.index("copy")
    assert table.resident() == {0: frozenset({1}), 1: frozenset({5})}


def test_noop_swap_moves_nothing():
    table, store = SlotTable(4), FakeStore(4)
    apply_swap(table, store, {0: {1, 2}})
    store.events.clear()
    result = apply_swap(table, store, {0: {2, 1}})
    assert result.plan.is_noop and result.bytes_copied == 0 and store.events == []


@pytest.mark.parametrize("fail_at", [1, 2, 3])
def test_failure_mid_swap_restores_previous_set(fail_at):
    table, store = SlotTable(4), FakeStore(4)
    apply_swap(table, store, {0: {0, 1}, 1: {2}})
    before = table.resident()
    store.fail_at_map = store.maps + fail_at
    with pytest.raises(SwapStepFailed) as err:
        apply_swap(table, store, {0: {3}, 1: {4, 5}, 2: {6}})
    assert err.value.rolled_back
    assert table.resident() == before == err.value.resident
    _check_consistent(table, store)


def test_a_failed_swap_publishes_before_its_rollback_copies():
    """The H200 case: evict 0.0 (remapped to its host master, unpublished), fail on the first
    admission; the rollback re-admits 0.0 by copying from its range, which must be readable."""
    table, store = SlotTable(2), FakeStore(2)
    apply_swap(table, store, {0: {0, 1}})
    store.events.clear()
    store.fail_at_map = store.maps + 2  # the second admission fails, after one was mapped
    with pytest.raises(SwapStepFailed) as err:
        apply_swap(table, store, {0: {2, 3}})
    assert err.value.rolled_back and table.resident() == {0: frozenset({0, 1})}
    kinds = [e[0] for e in store.events]
    first_rollback_copy = next(
        i for i, e in enumerate(store.events) if e[:3] in (("copy", 0, 0), ("copy", 0, 1))
    )
    assert "publish" in kinds[:first_rollback_copy]
    assert store.events[-1] == ("publish",) and not store.unpublished
    _check_consistent(table, store)


def test_failed_rollback_still_reports_reality():
    table, store = SlotTable(4), FakeStore(4)
    apply_swap(table, store, {0: {0, 1}})

    def always_fail(*_):
        raise RuntimeError("device gone")

    store.map_slot = always_fail
    with pytest.raises(SwapStepFailed) as err:
        apply_swap(table, store, {0: {2, 3}})
    assert not err.value.rolled_back
    assert err.value.resident == table.resident() == store.device_resident()
    _check_consistent(table, store)


def test_every_swap_ends_with_one_publish():
    """Access to remapped units is set once, after every remap of the swap (CUDA: per run)."""
    store = FakeStore(num_slots=4)
    table = SlotTable(4)
    apply_swap(table, store, {0: [0, 1]})
    assert store.events[-1] == ("publish",) and store.events.count(("publish",)) == 1
    store.events.clear()
    apply_swap(table, store, {0: [2]})
    assert store.events[-1] == ("publish",) and store.events.count(("publish",)) == 1


def test_contiguous_runs():
    from reap_swap.engine.vmm import contiguous_runs

    assert contiguous_runs({7, 1, 2, 3}) == [(1, 3), (7, 1)]
    assert contiguous_runs(set()) == []
    assert contiguous_runs([5]) == [(5, 1)]


def test_a_table_beside_lent_cache_tails_says_so_when_it_refuses():
    """With the pinned device cache the table keeps K = pool - lent slots: its refusal names the
    swap table, the whole pool, the lent slots (layers x N) and the remedy, in the sentence
    accounting mode's check_swap raises too (cache_tail.swap_table_refusal)."""
    with pytest.raises(PoolCapacityError) as err:
        SlotTable(4, lent=12, lent_layers=4, lent_per_layer=3).plan({0: {0, 1, 2, 3, 4}})
    assert err.value.capacity == 4 and err.value.overflow == 1
    assert str(err.value) == (
        "resident set needs 5 expert slots but the swap table has 4 (overflow 1 experts): the HBM pool "
        "of 16 slots less 4 layers x 3 = 12 lent to the cache tails; ask for at most 4 experts, lend at "
        "most 11 (--reap-cache-slots N <= 11), or serve a plan with a larger budget"
    )
    with pytest.raises(PoolCapacityError) as err:  # seeded: the layers lend different counts C_l
        SlotTable(4, lent=12, lent_layers=3).plan({0: {0, 1, 2, 3, 4}})
    assert str(err.value).endswith(
        "the HBM pool of 16 slots less 12 lent to the cache tails of 3 layers; ask for at most 4 experts, "
        "lend 1 fewer (--reap-cache-slots N lower by 1 or more), or serve a plan with a larger budget"
    )
    with pytest.raises(PoolCapacityError, match="the HBM pool has 4 "):
        SlotTable(4).plan({0: {0, 1, 2, 3, 4}})  # nothing lent: CUDA's text as before
