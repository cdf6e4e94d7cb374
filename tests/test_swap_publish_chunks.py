"""Publishing access in chunks while later copies are in flight (issue 17's swap guard), against
a fake store that models in-flight copies (no GPU): order, counts, and failure behaviour."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_residency_swap import EXPERTS, LAYERS, FakeStore, _check_consistent

from reap_swap.cache.slot_table import SlotTable
from reap_swap.engine.residency import swap
from reap_swap.engine.residency.fault import SwapFault
from reap_swap.engine.residency.swap import SwapStepFailed, apply_swap


class InFlightStore(FakeStore):
    """A copy is in flight from start_copy until wait_copy of its token; every publish records
    what it made readable and which copies were still in flight then, and checks the two are
    disjoint (a publish never touches a unit an in-flight copy reads) and that no published
    admission's copy is still in flight."""

    def __init__(self, num_slots: int, publish_every: int, fail_at_map: int | None = None):
        super().__init__(num_slots, fail_at_map)
        self.publish_every = publish_every
        self.in_flight: set[tuple[int, int]] = set()
        self.publishes: list[dict] = []

    def quiesce(self):  # a device synchronize: every copy still in flight lands
        self.in_flight.clear()
        super().quiesce()

    def start_copy(self, layer, expert, slot):
        token = super().start_copy(layer, expert, slot)
        self.in_flight.add((layer, expert))
        return token

    def wait_copy(self, token):
        self.in_flight.discard(token[:2])
        self.events.append(("landed", *token[:2]))

    def map_slot(self, layer, expert, slot):
        assert (layer, expert) not in self.in_flight, f"remap of {layer}.{expert} before its copy landed"
        super().map_slot(layer, expert, slot)

    def publish(self):
        made = set(self.unpublished)
        assert not made & self.in_flight, (
            f"publish of units whose copies are in flight: {made & self.in_flight}"
        )
        self.publishes.append({"units": made, "in_flight": set(self.in_flight)})
        super().publish()


def _admit_n(n: int) -> dict[int, set[int]]:
    """n experts in layer order: layer 0's first, then layer 1's..."""
    keys = [(l, e) for l in range(LAYERS) for e in range(EXPERTS)][:n]
    out: dict[int, set[int]] = {}
    for l, e in keys:
        out.setdefault(l, set()).add(e)
    return out


@pytest.mark.parametrize(
    ("n", "every", "chunks"), [(20, 8, 2), (16, 8, 1), (17, 8, 2), (5, 8, 0), (20, 0, 0)]
)
def test_chunk_count_and_the_final_publish(n, every, chunks):
    table, store = SlotTable(24), InFlightStore(24, every)
    result = apply_swap(table, store, _admit_n(n))
    assert result.phases["publish_chunks"] == chunks
    assert len(store.publishes) == chunks + 1  # the final publish always runs
    assert store.events[-1] == ("publish",) and not store.unpublished
    for p in store.publishes[:-1]:  # every overlapped publish ran while later copies were in flight
        assert p["in_flight"] and len(p["units"]) == every
    assert store.publishes[-1]["in_flight"] == set()
    assert result.phases["publish_overlapped"] >= 0.0 and (chunks or result.phases["publish_overlapped"] == 0)
    _check_consistent(table, store)


def test_overlapped_publish_follows_landed_copies_and_precedes_later_ones():
    table, store = SlotTable(24), InFlightStore(24, publish_every=4)
    apply_swap(table, store, _admit_n(12))
    kinds = [e[0] for e in store.events]
    first = kinds.index("publish")
    assert kinds[:first].count("landed") == 4  # after the 4th landed copy ...
    assert kinds[first:].count("landed") == 8  # ... while 8 were still in flight
    assert store.publishes[0]["units"] == {(0, e) for e in range(4)}


def test_the_first_chunk_also_publishes_the_swaps_evictions():
    table, store = SlotTable(12), InFlightStore(12, publish_every=2)
    apply_swap(table, store, {0: set(range(6))})
    store.publishes.clear()
    apply_swap(table, store, {1: set(range(6))})  # evict 0.0-0.5, admit 1.0-1.5
    evicted = {(0, e) for e in range(6)}
    assert evicted <= store.publishes[0]["units"]  # hidden behind the copies still in flight
    assert store.publishes[0]["in_flight"]
    _check_consistent(table, store)


def test_default_publish_every_applies_to_a_store_without_the_attribute(monkeypatch):
    table, store = SlotTable(24), FakeStore(24)  # no publish_every: swap.PUBLISH_EVERY
    assert swap.PUBLISH_EVERY == swap.PUBLISH_AHEAD  # the default since run 24; this store's copies
    result = apply_swap(table, store, _admit_n(20))  # read the units themselves: only the final publish
    assert result.phases["publish_chunks"] == 0 and store.events.count(("publish",)) == 1
    monkeypatch.setattr(swap, "PUBLISH_EVERY", 0)  # off: only the final publish
    table, store = SlotTable(24), FakeStore(24)
    result = apply_swap(table, store, _admit_n(20))
    assert result.phases["publish_chunks"] == 0 and store.events.count(("publish",)) == 1
    monkeypatch.setattr(swap, "PUBLISH_EVERY", 8)
    table, store = SlotTable(24), FakeStore(24)
    result = apply_swap(table, store, _admit_n(20))
    assert result.phases["publish_chunks"] == (20 - 1) // 8
    assert store.events.count(("publish",)) == result.phases["publish_chunks"] + 1


@pytest.mark.parametrize("fail_at", [1, 3, 5, 8])
def test_failure_after_overlapped_publishes_publishes_before_rollback(fail_at):
    """A remap fails after some chunks were published: the finally publishes the rest before the
    rollback copies (which read the evicted units), and the previous set comes back."""
    table, store = SlotTable(10), InFlightStore(10, publish_every=2)
    apply_swap(table, store, {0: set(range(6))})
    before = table.resident()
    store.fail_at_map = store.maps + fail_at
    with pytest.raises(SwapStepFailed) as err:
        apply_swap(table, store, {0: {0}, 1: set(range(8))})
    assert err.value.rolled_back and table.resident() == before == err.value.resident
    assert store.events[-1] == ("publish",) and not store.unpublished
    _check_consistent(table, store)


def test_faulty_store_passes_publish_every_through():
    table, store = SlotTable(10), InFlightStore(10, publish_every=2)
    wrapped = SwapFault(rank=0, after_admissions=5).wrap(store)
    assert wrapped.publish_every == 2
    with pytest.raises(SwapStepFailed) as err:
        apply_swap(table, wrapped, {0: set(range(8))})
    assert err.value.rolled_back and table.resident() == {}
    assert len(store.publishes) >= 3  # two overlapped chunks before the fault, then the final one
    _check_consistent(table, store)


class IdleStore(InFlightStore):
    """publish_every = PUBLISH_WHEN_IDLE: `copy_landed` says the copy started i-th (i in
    `landed_at`) has landed before its wait."""

    def __init__(self, num_slots: int, landed_at: set[int] | None = None):
        super().__init__(num_slots, swap.PUBLISH_WHEN_IDLE)
        self.landed_at = landed_at or set()
        self.started: list[tuple[int, int]] = []

    def start_copy(self, layer, expert, slot):
        self.started.append((layer, expert))
        return super().start_copy(layer, expert, slot)

    def copy_landed(self, token):
        return self.started.index(token[:2]) in self.landed_at


def test_idle_publishing_publishes_before_each_wait_on_a_copy_still_in_flight():
    table, store = SlotTable(24), IdleStore(24)  # no copy has landed when its wait comes
    result = apply_swap(table, store, _admit_n(6))
    # nothing pending before the first wait; then one publish before each later wait
    assert result.phases["publish_chunks"] == 5 and len(store.publishes) == 6
    assert [p["units"] for p in store.publishes[:-1]] == [{(0, e)} for e in range(5)]
    assert all(p["in_flight"] for p in store.publishes[:-1])  # while copies were still in flight
    kinds = [e[0] for e in store.events]
    assert kinds.index("publish") > kinds.index("landed")
    _check_consistent(table, store)


def test_idle_publishing_hides_the_evictions_behind_the_first_copy():
    table, store = SlotTable(12), IdleStore(12, landed_at=set(range(100)))
    apply_swap(table, store, {0: set(range(6))})
    store.publishes.clear()
    store.landed_at, store.started = set(), []
    apply_swap(table, store, {1: set(range(6))})  # evict 0.0-0.5, admit 1.0-1.5
    assert store.publishes[0]["units"] == {(0, e) for e in range(6)}  # before the first wait
    assert store.publishes[0]["in_flight"] == {(1, e) for e in range(6)}
    _check_consistent(table, store)


def test_idle_publishing_waits_for_no_copy_that_has_landed():
    table, store = SlotTable(24), IdleStore(24, landed_at=set(range(1, 20)))  # only the first was late
    result = apply_swap(table, store, _admit_n(20))
    assert result.phases["publish_chunks"] == 0  # the CPU never idled with remaps pending
    everything = {(l, e) for l, es in _admit_n(20).items() for e in es}
    assert len(store.publishes) == 1 and store.publishes[0]["units"] == everything
    table, store = SlotTable(24), IdleStore(24, landed_at={1, 2, 4, 5})  # late at 0, 3, 6 and 7
    apply_swap(table, store, _admit_n(8))
    assert [len(p["units"]) for p in store.publishes] == [3, 3, 1, 1]  # before 3, 6, 7; the final
    _check_consistent(table, store)


def test_idle_publishing_without_copy_landed_publishes_only_at_the_end():
    table, store = SlotTable(24), InFlightStore(24, swap.PUBLISH_WHEN_IDLE)
    result = apply_swap(table, store, _admit_n(20))
    assert result.phases["publish_chunks"] == 0 and len(store.publishes) == 1
    _check_consistent(table, store)


targets = st.dictionaries(
    st.integers(0, LAYERS - 1), st.frozensets(st.integers(0, EXPERTS - 1), max_size=EXPERTS), max_size=LAYERS
)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 12), st.integers(0, 5), st.lists(targets, min_size=1, max_size=5), st.integers(0, 9))
def test_chunked_swaps_keep_table_and_store_consistent(num_slots, every, sequence, fail_after):
    """Any chunk size, any swap sequence, one remap failure somewhere: table == device, every
    expert reads its own bytes, HBM use within the pool, nothing left unpublished."""
    store = InFlightStore(num_slots, every)
    store.fail_at_map = fail_after + 1
    _swap_through(SlotTable(num_slots), store, sequence)


def _swap_through(table: SlotTable, store: InFlightStore, sequence) -> None:
    """Apply every target that fits; after each, a failed swap has rolled back, the table equals
    the device, HBM use is within the pool, nothing is unpublished and no copy is in flight
    (InFlightStore keeps in flight only what the swap never waited for)."""
    for target in sequence:
        if sum(len(v) for v in target.values()) > table.num_slots:
            continue
        try:
            apply_swap(table, store, target)
        except SwapStepFailed as err:
            assert err.rolled_back
        assert table.used <= table.num_slots and not store.unpublished and not store.in_flight
        _check_consistent(table, store)


class AheadStore(InFlightStore):
    """publish_every = PUBLISH_AHEAD with copies that read the masters' second mapping: a remap
    may come before its copy lands (the copy's source is not the remapped unit), a publish may
    cover admissions still in flight; a kernel may read nothing until every copy landed."""

    copies_read_masters = True

    def __init__(self, num_slots: int, fail_at_map: int | None = None):
        super().__init__(num_slots, swap.PUBLISH_AHEAD, fail_at_map)
        self.remapped_in_flight = 0

    def map_slot(self, layer, expert, slot):
        self.remapped_in_flight += (layer, expert) in self.in_flight
        FakeStore.map_slot(self, layer, expert, slot)

    def publish(self):
        self.publishes.append({"units": set(self.unpublished), "in_flight": set(self.in_flight)})
        FakeStore.publish(self)

    def read(self, layer, expert):
        assert not self.in_flight, f"kernel read while copies are in flight: {self.in_flight}"
        return super().read(layer, expert)


def test_ahead_remaps_and_publishes_every_admission_while_the_copies_run():
    table, store = SlotTable(24), AheadStore(24)
    result = apply_swap(table, store, _admit_n(20))
    everything = {(l, e) for l, es in _admit_n(20).items() for e in es}
    assert store.remapped_in_flight == 20  # no remap waited for its copy
    assert result.phases["publish_chunks"] == 1 and len(store.publishes) == 2
    assert store.publishes[0] == {"units": everything, "in_flight": everything}
    kinds = [e[0] for e in store.events]
    assert kinds.index("landed") > kinds.index("publish")  # the waits come after the publish
    assert kinds.count("landed") == 20 and not store.in_flight  # the swap returns after every copy
    assert store.publishes[-1]["units"] == set()  # the final publish has nothing left
    _check_consistent(table, store)


def test_ahead_publishes_the_evictions_with_the_admissions():
    table, store = SlotTable(12), AheadStore(12)
    apply_swap(table, store, {0: set(range(6))})
    store.publishes.clear()
    apply_swap(table, store, {1: set(range(6))})  # evict 0.0-0.5, admit 1.0-1.5
    assert store.publishes[0]["units"] == {(0, e) for e in range(6)} | {(1, e) for e in range(6)}
    _check_consistent(table, store)


def test_ahead_without_master_copies_waits_and_publishes_only_at_the_end():
    table, store = SlotTable(24), InFlightStore(24, swap.PUBLISH_AHEAD)  # its copies read the units
    result = apply_swap(table, store, _admit_n(20))  # InFlightStore asserts no remap before landing
    assert result.phases["publish_chunks"] == 0 and len(store.publishes) == 1
    _check_consistent(table, store)


@pytest.mark.parametrize(
    ("make", "fail_at"),
    [(IdleStore, 2), (IdleStore, 4), (AheadStore, 1), (AheadStore, 4), (AheadStore, 8)],
    ids=["idle-2", "idle-4", "ahead-1", "ahead-4", "ahead-8"],
)
def test_idle_or_ahead_failure_rolls_back_after_the_copies_land(make, fail_at):
    table, store = SlotTable(10), make(10)
    apply_swap(table, store, {0: set(range(6))})
    before = table.resident()
    store.fail_at_map = store.maps + fail_at
    with pytest.raises(SwapStepFailed) as err:
        apply_swap(table, store, {0: {0}, 1: set(range(8))})
    assert err.value.rolled_back and table.resident() == before
    assert store.events[-1] == ("publish",) and not store.unpublished
    assert not store.in_flight  # the rollback's quiesce landed every copy of the failed swap
    _check_consistent(table, store)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 12), st.lists(targets, min_size=1, max_size=5), st.integers(0, 9))
def test_ahead_swaps_keep_table_and_store_consistent(num_slots, sequence, fail_after):
    _swap_through(SlotTable(num_slots), AheadStore(num_slots, fail_at_map=fail_after + 1), sequence)


class FakeDriver:
    """The few driver calls the masters' second mapping makes, recorded; `fail_map_at` makes the
    cuMemMap of that address fail (CUDA_ERROR_OUT_OF_MEMORY = 2)."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.fail_map_at: int | None = None
        self.CUmemLocationType = SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE=1)
        self.CUmemAccess_flags = SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)

    def CUmemAccessDesc(self):  # noqa: N802 - the driver's name
        return SimpleNamespace(location=SimpleNamespace(type=None, id=None), flags=None)

    def cuMemAddressReserve(self, size, *_):  # noqa: N802
        self.calls.append(("reserve", size))
        return (0, 1 << 40)

    def cuMemMap(self, addr, size, offset, handle, flags):  # noqa: N802
        if addr == self.fail_map_at:
            return (2,)
        self.calls.append(("map", addr, handle))
        return (0,)

    def cuMemSetAccess(self, addr, size, desc, count):  # noqa: N802
        self.calls.append(("access", addr, size))
        return (0,)

    def cuMemUnmap(self, addr, size):  # noqa: N802
        self.calls.append(("unmap", addr))
        return (0,)

    def cuMemAddressFree(self, addr, size):  # noqa: N802
        self.calls.append(("free", addr, size))
        return (0,)

    def cuGetErrorName(self, err):  # noqa: N802
        return (0, b"CUDA_ERROR_OUT_OF_MEMORY")


def test_a_cache_range_mirrors_only_its_expert_units(monkeypatch):
    from reap_swap.engine import vmm
    from reap_swap.engine.device_cache.range import CacheRange

    drv = FakeDriver()
    monkeypatch.setattr(vmm, "_drv", drv)
    unit = 2**21
    rng = CacheRange(num_units=10, unit_bytes=unit, device=0, num_slots=4)
    rng.handles = [f"h{u}" for u in range(10)]  # 6 host masters, then 4 HBM slot units (lent handles)
    assert rng.master_address(5) == (1 << 40) + 5 * unit
    assert [c[2] for c in drv.calls if c[0] == "map"] == [f"h{u}" for u in range(6)]  # no slot unit
    assert ("access", 1 << 40, 6 * unit) in drv.calls
    with pytest.raises(IndexError):
        rng.master_address(6)  # a slot unit has no master
    rng._release_mirror()
    assert [c for c in drv.calls if c[0] == "unmap"] == [("unmap", (1 << 40) + u * unit) for u in range(6)]
    assert drv.calls[-1] == ("free", 1 << 40, 10 * unit) and rng.mirrored == 0


def test_a_failed_mirror_extension_keeps_the_units_mapped_before_it(monkeypatch):
    """A range that grew after its masters were mirrored: extending the mirror fails at unit 6, so
    units 4 and 5 (mapped by this call) are unmapped again, units 0-3 (which copies may be reading)
    stay, and the reservation stays."""
    from reap_swap.engine import vmm

    drv = FakeDriver()
    monkeypatch.setattr(vmm, "_drv", drv)
    unit = 2**21
    rng = vmm.MixedRange(num_units=8, unit_bytes=unit, device=0)
    rng.handles = [f"h{u}" for u in range(4)]
    rng.master_address(3)
    rng.handles += [f"h{u}" for u in range(4, 8)]  # grew
    drv.fail_map_at = (1 << 40) + 6 * unit
    with pytest.raises(RuntimeError, match="CUDA driver error 2"):
        rng.master_address(7)
    assert rng.mirrored == 4 and rng.mirror_base == 1 << 40
    assert [c for c in drv.calls if c[0] in ("unmap", "free")] == [
        ("unmap", (1 << 40) + 4 * unit),
        ("unmap", (1 << 40) + 5 * unit),
    ]


def test_masters_mapped_at_load_and_a_refusal_only_logged(monkeypatch, caplog):
    """engine._seed / grouped_engine.attach map the masters' second mapping when a layer loads
    (run 25: a first swap from an empty core no longer pays it). Every master is mapped once; a
    driver refusal there is logged and undone, and the first swap's master_address tries again."""
    from reap_swap.engine import vmm

    drv = FakeDriver()
    monkeypatch.setattr(vmm, "_drv", drv)
    unit = 2**21
    rng = vmm.MixedRange(num_units=4, unit_bytes=unit, device=0)
    rng.handles = [f"h{u}" for u in range(4)]
    assert rng.map_masters() == 4 and rng.map_masters() == 4
    assert [c[2] for c in drv.calls if c[0] == "map"] == ["h0", "h1", "h2", "h3"]  # once each

    failing = vmm.MixedRange(num_units=4, unit_bytes=unit, device=0)
    failing.handles = [f"g{u}" for u in range(4)]
    drv.calls.clear()
    drv.fail_map_at = (1 << 40) + 2 * unit
    with caplog.at_level("WARNING", logger=vmm.logger.name):
        vmm.map_masters_at_load(failing, "layer 3")
    assert "layer 3: the masters' second mapping failed at load" in caplog.text
    assert failing.mirrored == 0 and failing.mirror_base == 0  # undone, reservation freed
    drv.fail_map_at = None
    assert failing.master_address(2) == (1 << 40) + 2 * unit  # the swap maps it after all


@pytest.mark.parametrize("default", [8, swap.PUBLISH_AHEAD])
def test_the_cuda_stores_follow_the_default_when_built_without_an_argument(monkeypatch, default):
    """What production builds (VmmStore(st), GroupedStore(st)): the mode is the default's, and so is
    where the copies read. Run 23's GPU tests set the default and the stores ignored it."""
    from reap_swap.engine.residency.grouped import GroupedStore
    from reap_swap.engine.residency.vmm_store import VmmStore

    monkeypatch.setattr(swap, "PUBLISH_EVERY", default)
    for store in (VmmStore(SimpleNamespace(layers={})), GroupedStore(SimpleNamespace(layers={}))):
        assert store.publish_every == default
        assert store.copies_read_masters == (default == swap.PUBLISH_AHEAD)
        assert swap._remaps_ahead(store) == (default == swap.PUBLISH_AHEAD)
    explicit = VmmStore(SimpleNamespace(layers={}), swap.PUBLISH_AHEAD)
    assert swap._remaps_ahead(explicit) and not swap._remaps_ahead(VmmStore(SimpleNamespace(layers={}), 8))


class TwiceFailingAheadStore(AheadStore):
    """Fails the n-th remap of the swap and the m-th of its rollback."""

    def __init__(self, num_slots: int, fail_at: set[int]):
        super().__init__(num_slots)
        self.fail_at = fail_at

    def map_slot(self, layer, expert, slot):
        if self.maps + 1 in self.fail_at:
            self.maps += 1
            raise RuntimeError("injected remap failure")
        super().map_slot(layer, expert, slot)


def test_ahead_swap_whose_rollback_fails_too_lands_its_copies_before_publishing():
    """No rollback restores the set, so nothing else quiesces: the swap itself lands every copy
    before its final publish makes the remapped units readable, and the next kernel reads whole
    experts (the table says what the device holds)."""
    table, store = SlotTable(10), TwiceFailingAheadStore(10, set())
    apply_swap(table, store, {0: set(range(6))})
    store.fail_at = {store.maps + 3, store.maps + 5}  # the 3rd remap of the swap, the 2nd of its rollback
    with pytest.raises(SwapStepFailed) as err:
        apply_swap(table, store, {0: {0}, 1: set(range(8))})
    assert not err.value.rolled_back
    kinds = [e[0] for e in store.events]
    assert kinds[-2:] == ["quiesce", "publish"]  # the rollback's copies landed, then the publish
    assert not store.in_flight and not store.unpublished
    _check_consistent(table, store)


def test_the_cuda_stores_take_the_servers_setting_from_their_state(monkeypatch):
    """--reap-swap-publish reaches the stores through the engine's state (EngineState /
    GroupedState.publish_every); a store's own argument still wins, and a state without one
    follows swap.PUBLISH_EVERY."""
    from reap_swap.engine.residency.grouped import GroupedState, GroupedStore
    from reap_swap.engine.residency.vmm_store import VmmStore

    for cls in (VmmStore, GroupedStore):
        chunked = cls(SimpleNamespace(layers={}, publish_every=8))
        assert chunked.publish_every == 8 and not chunked.copies_read_masters
        assert cls(SimpleNamespace(layers={}, publish_every=0), swap.PUBLISH_AHEAD).copies_read_masters
        monkeypatch.setattr(swap, "PUBLISH_EVERY", swap.PUBLISH_WHEN_IDLE)
        assert cls(SimpleNamespace(layers={}, publish_every=None)).publish_every == swap.PUBLISH_WHEN_IDLE
        monkeypatch.undo()
    assert GroupedState(device=0, granularity=2 << 20).publish_every is None
