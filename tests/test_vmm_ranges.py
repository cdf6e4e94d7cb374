"""vmm's ranges against a fake CUDA driver (no GPU): what each range reserves, allocates and maps.

Run 17 (H200, 2026-12-03) found every swap failing with CUDA_ERROR_INVALID_VALUE: `_UnitRange._create`
called `grow(upto)` to allocate its units, and `DeviceSlotPool.grow(extra_slots)` overrode it, so a
pool's own slots were never mapped (its staging addresses pointed at nothing) and the pool counted
twice its slots. These tests fail on that code and pass on the fix.
"""

from types import SimpleNamespace

import pytest

from reap_swap.engine import vmm


class FakeDriver:
    """The driver calls vmm makes, each returning (err, value) as cuda-python does; records the
    reservations, allocations and mappings so a test can ask what is mapped where."""

    def __init__(self) -> None:
        self.next_va = 1 << 40
        self.next_handle = 1
        self.reserved: dict[int, int] = {}  # base -> size
        self.allocs: dict[int, tuple[int, str]] = {}  # handle -> (size, location type)
        self.mapped: dict[int, int] = {}  # address -> handle
        self.access: list[tuple[int, int]] = []  # (address, size)
        loc = SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE="device", CU_MEM_LOCATION_TYPE_HOST_NUMA="host")
        self.CUmemLocationType = loc
        self.CUmemAllocationType = SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED="pinned")
        self.CUmemAccess_flags = SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE="rw")

    @staticmethod
    def CUmemAllocationProp():
        return SimpleNamespace(type=None, location=SimpleNamespace(type=None, id=None))

    @staticmethod
    def CUmemAccessDesc():
        return SimpleNamespace(location=SimpleNamespace(type=None, id=None), flags=None)

    def cuMemAddressReserve(self, size, align, addr, flags):
        base = self.next_va
        self.next_va += size + (1 << 30)
        self.reserved[base] = size
        return (0, base)

    def cuMemCreate(self, size, prop, flags):
        handle = self.next_handle
        self.next_handle += 1
        self.allocs[handle] = (size, prop.location.type)
        return (0, handle)

    def cuMemMap(self, addr, size, offset, handle, flags):
        assert handle in self.allocs and addr not in self.mapped
        assert any(b <= addr and addr + size <= b + s for b, s in self.reserved.items())
        self.mapped[addr] = handle
        return (0,)

    def cuMemUnmap(self, addr, size):
        self.mapped.pop(addr)
        return (0,)

    def cuMemSetAccess(self, addr, size, descs, count):
        self.access.append((addr, size))
        return (0,)

    def cuMemRelease(self, handle):
        self.allocs.pop(handle)
        return (0,)

    def cuMemAddressFree(self, base, size):
        assert self.reserved.pop(base) == size
        return (0,)


@pytest.fixture
def drv(monkeypatch):
    fake = FakeDriver()
    monkeypatch.setattr(vmm, "_drv", fake)
    return fake


UNIT = 2 << 20


def test_a_pool_maps_every_one_of_its_slots(drv):
    pool = vmm.DeviceSlotPool.create(4, UNIT, 0)
    assert pool.num_slots == 4 and pool.nbytes == 4 * UNIT
    assert len(pool.handles) == 4 and not pool.extra
    for slot in range(4):  # a swap copies into the staging address, then maps the same handle
        assert drv.mapped[pool.unit_address(slot)] == pool.slot_handle(slot)
        assert drv.allocs[pool.slot_handle(slot)] == (UNIT, "device")


def test_a_pool_grows_in_a_reservation_of_its_own(drv):
    pool = vmm.DeviceSlotPool.create(4, UNIT, 0)
    first = [pool.unit_address(s) for s in range(4)]
    assert pool.grow(2) == 6 and len(pool.extra) == 1
    assert [pool.unit_address(s) for s in range(4)] == first  # nothing moved
    assert {pool.slot_handle(s) for s in range(6)} == set(drv.allocs)
    assert all(drv.mapped[pool.unit_address(s)] == pool.slot_handle(s) for s in range(6))
    pool.release()
    assert not drv.allocs and not drv.mapped and not drv.reserved


def test_a_host_range_allocates_all_units_by_default(drv):
    rng = vmm.MixedRange.create_host_backed(6, UNIT, 0)
    assert len(rng.handles) == 6 and rng.backing == [None] * 6
    assert {drv.allocs[h][1] for h in rng.handles} == {"host"}
    assert drv.access == [(rng.base, 6 * UNIT)]


def test_a_host_range_in_blocks_allocates_as_it_grows(drv):
    # the re-home in blocks (state.rehome with on_copied): units allocated just before their copy
    rng = vmm.MixedRange.create_host_backed(6, UNIT, 0, allocate=0)
    assert rng.handles == [] and rng.base in drv.reserved and not drv.mapped
    rng.grow(4)
    assert len(rng.handles) == 4 and drv.access == [(rng.base, 4 * UNIT)]
    rng.grow(3)  # never shrinks
    rng.grow(6)
    assert drv.access[-1] == (rng.unit_address(4), 2 * UNIT)
    assert all(drv.mapped[rng.unit_address(u)] == rng.handles[u] for u in range(6))


def test_a_swap_maps_a_pool_slot_into_a_host_range_and_back(drv):
    pool = vmm.DeviceSlotPool.create(2, UNIT, 0)
    rng = vmm.MixedRange.create_host_backed(3, UNIT, 0)
    rng.map_device(1, pool.slot_handle(0), defer_access=True)
    assert drv.mapped[rng.unit_address(1)] == pool.slot_handle(0) and rng.flush_access() == 1
    rng.map_host(1)
    assert drv.mapped[rng.unit_address(1)] == rng.handles[1]
