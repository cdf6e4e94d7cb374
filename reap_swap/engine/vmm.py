"""CUDA virtual memory: one address range whose pieces are backed by HBM or by pinned host memory.

Why: vLLM's MoE kernels read an expert's weights at `base + expert * stride`. If that range is a
CUDA virtual-address reservation, each expert's piece ("unit") can be mapped to a host-located
allocation (read over PCIe, like UVA) or to a device allocation (HBM), and a swap remaps pieces
without changing any address, so the unchanged kernel gives bit-identical results and captured
CUDA graphs stay valid. Measured on the H200 in shared/notes/cuda-vmm.md.

Only the driver API is used (cuda-python's `cuda.bindings.driver`); everything is synchronous and
called between engine steps. Nothing here knows about vLLM or experts beyond "units".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

try:  # cuda-python >= 12.6 layout first, then the older `cuda.cuda` module
    from cuda.bindings import driver as _drv
except ImportError:  # pragma: no cover - depends on the installed cuda-python
    try:
        from cuda import cuda as _drv  # type: ignore[no-redef]
    except ImportError:
        _drv = None


class VmmUnavailable(RuntimeError):
    """The CUDA driver API or virtual memory management is not usable here."""


def _check(result: tuple) -> Any:
    err, *rest = result
    if int(err) != 0:
        name = _drv.cuGetErrorName(err)[1] if _drv is not None else err
        raise RuntimeError(f"CUDA driver error {int(err)} ({name!r})")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


def _prop(location: str, device: int) -> Any:
    prop = _drv.CUmemAllocationProp()
    prop.type = _drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    if location == "device":
        prop.location.type = _drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
    else:
        prop.location.type = _drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
        prop.location.id = 0
    return prop


def ensure_available(device: int) -> int:
    """Return the mapping granularity (bytes) or raise VmmUnavailable naming the reason."""
    if _drv is None:
        raise VmmUnavailable("cuda-python (cuda.bindings.driver) is not installed")
    if not torch.cuda.is_available():
        raise VmmUnavailable("CUDA is not available")
    torch.cuda.init()
    _check(_drv.cuInit(0))
    attrs = _drv.CUdevice_attribute
    for attr in (
        attrs.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
        attrs.CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
    ):
        if not _check(_drv.cuDeviceGetAttribute(attr, device)):
            raise VmmUnavailable(f"device {device} lacks {attr.name}")
    option = _drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    return max(
        int(_check(_drv.cuMemGetAllocationGranularity(_prop(loc, device), option)))
        for loc in ("device", "host")
    )


class _ArrayInterface:
    """Lets torch wrap a raw device address without owning it."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


def _access_desc(device: int) -> Any:
    desc = _drv.CUmemAccessDesc()
    desc.location.type = _drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = device
    desc.flags = _drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return desc


def copy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """Stream-ordered copy between two device-visible addresses (host- or HBM-backed)."""
    _check(_drv.cuMemcpyDtoDAsync(dst, src, nbytes, stream))


def contiguous_runs(units) -> list[tuple[int, int]]:
    """Sorted (first, count) runs of adjacent unit indices: {1, 2, 3, 7} -> [(1, 3), (7, 1)]."""
    runs: list[tuple[int, int]] = []
    for u in sorted(units):
        if runs and runs[-1][0] + runs[-1][1] == u:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((u, 1))
    return runs


@dataclass
class _UnitRange:
    """A reserved range of `num_units` pieces, each mapped to its own fresh allocation."""

    num_units: int
    unit_bytes: int
    device: int
    base: int = 0
    handles: list[Any] = field(default_factory=list)  # the allocation created for each unit
    location: str = "device"

    @classmethod
    def _create(
        cls, location: str, num_units: int, unit_bytes: int, device: int, allocate: int | None = None
    ):
        """Reserve `num_units` units and allocate the first `allocate` of them (all by default; the
        rest come with `grow`, so a re-home need not hold a layer's host bytes before it copies them)."""
        rng = cls(num_units, unit_bytes, device, location=location)
        if num_units == 0:
            return rng
        rng.base = int(_check(_drv.cuMemAddressReserve(num_units * unit_bytes, 0, 0, 0)))
        rng._allocate_upto(num_units if allocate is None else allocate)
        return rng

    def _allocate_upto(self, upto: int) -> None:
        """Allocate, map and open to the device units [allocated so far, upto); on a failure the
        whole range is released and the error raised. Private on purpose: `DeviceSlotPool.grow`
        means something else (new slots in a new reservation), and when this was called `grow`
        the pool's override ran in `_create`, left the pool's own units unmapped and every swap
        failed with CUDA_ERROR_INVALID_VALUE."""
        first = len(self.handles)
        if upto <= first:
            return
        prop = _prop(self.location, self.device)
        try:
            for unit in range(first, upto):
                handle = _check(_drv.cuMemCreate(self.unit_bytes, prop, 0))
                self.handles.append(handle)
                _check(_drv.cuMemMap(self.unit_address(unit), self.unit_bytes, 0, handle, 0))
            size = (upto - first) * self.unit_bytes
            _check(_drv.cuMemSetAccess(self.unit_address(first), size, [_access_desc(self.device)], 1))
        except Exception:
            self.release()
            raise

    @property
    def nbytes(self) -> int:
        return self.num_units * self.unit_bytes

    def unit_address(self, unit: int) -> int:
        return self.base + unit * self.unit_bytes

    def release(self) -> None:
        """Unmap every unit, release the allocations made for them, free the reservation."""
        for unit, handle in enumerate(self.handles):
            try:
                _drv.cuMemUnmap(self.unit_address(unit), self.unit_bytes)
            finally:
                _drv.cuMemRelease(handle)
        if self.base:
            _drv.cuMemAddressFree(self.base, self.nbytes)
        self.handles.clear()
        self.base = 0


@dataclass
class MixedRange(_UnitRange):
    """A layer's expert range: every unit backed by its host master or by a device slot.

    `handles[u]` is unit u's pinned host allocation (the master, kept for the range's lifetime);
    `backing[u]` is None while the host master is mapped, else the device handle mapped there.
    """

    backing: list[Any] = field(default_factory=list)
    pending_access: set[int] = field(default_factory=set)  # remapped units awaiting flush_access()
    mirror_base: int = 0  # a second reservation where the host masters stay mapped (master_address)
    mirrored: int = 0  # units [0, mirrored) are mapped there

    @classmethod
    def create_host_backed(
        cls, num_units: int, unit_bytes: int, device: int, allocate: int | None = None
    ) -> MixedRange:
        rng = cls._create("host", num_units, unit_bytes, device, allocate)
        rng.backing = [None] * num_units
        return rng

    def grow(self, upto: int) -> None:
        """Allocate the host units [allocated so far, upto) of a range created with `allocate`
        (a re-home in blocks: each block's host bytes just before it is copied)."""
        self._allocate_upto(upto)

    def host_masters(self) -> int:
        """How many units have a host master allocated (all of them, once the range is built)."""
        return len(self.handles)

    def master_address(self, unit: int) -> int:
        """Where unit's host master is always mapped, whatever backs the unit itself.

        A copy that reads its source here may run while `unit_address(unit)` is remapped to a
        slot (swap.PUBLISH_AHEAD). The second mapping is made on first use, for every master
        allocated by then (no memory, only address space; an allocation may be mapped at several
        addresses), and extended when the range has grown."""
        if unit >= self.mirrored:
            self._mirror_upto(self.host_masters())
        if not 0 <= unit < self.mirrored:
            raise IndexError(f"unit {unit} has no host master (masters: {self.mirrored})")
        return self.mirror_base + unit * self.unit_bytes

    def map_masters(self) -> int:
        """Make the masters' second mapping now (at load, where remapping ahead is on), so that a
        layer's first request-time swap does not pay it (mapping takes time per unit, which would
        otherwise slow the layer's first swap: research.md). Returns how many masters are mapped there."""
        self._mirror_upto(self.host_masters())
        return self.mirrored

    def _mirror_upto(self, upto: int) -> None:
        first = self.mirrored
        if upto <= first:
            return
        try:
            if not self.mirror_base:
                self.mirror_base = int(_check(_drv.cuMemAddressReserve(self.nbytes, 0, 0, 0)))
            for unit in range(first, upto):
                _check(
                    _drv.cuMemMap(
                        self.mirror_base + unit * self.unit_bytes, self.unit_bytes, 0, self.handles[unit], 0
                    )
                )
                self.mirrored = unit + 1
            size = (upto - first) * self.unit_bytes
            _check(
                _drv.cuMemSetAccess(
                    self.mirror_base + first * self.unit_bytes, size, [_access_desc(self.device)], 1
                )
            )
        except Exception:  # undo this call's units only: copies may be reading the earlier ones
            for unit in range(first, self.mirrored):
                _drv.cuMemUnmap(self.mirror_base + unit * self.unit_bytes, self.unit_bytes)
            self.mirrored = first
            if first == 0 and self.mirror_base:
                _drv.cuMemAddressFree(self.mirror_base, self.nbytes)
                self.mirror_base = 0
            raise

    def _release_mirror(self) -> None:
        """Unmap the second mapping of the masters and free its reservation (the allocations stay)."""
        for unit in range(self.mirrored):
            _drv.cuMemUnmap(self.mirror_base + unit * self.unit_bytes, self.unit_bytes)
        if self.mirror_base:
            _drv.cuMemAddressFree(self.mirror_base, self.nbytes)
        self.mirror_base, self.mirrored = 0, 0

    def as_bytes(self) -> torch.Tensor:
        """A uint8 CUDA tensor over the whole range (the caller views/strides it)."""
        return torch.as_tensor(_ArrayInterface(self.base, self.nbytes), device=f"cuda:{self.device}")

    def _remap(self, unit: int, handle: Any, defer_access: bool) -> None:
        addr = self.unit_address(unit)
        _check(_drv.cuMemUnmap(addr, self.unit_bytes))
        _check(_drv.cuMemMap(addr, self.unit_bytes, 0, handle, 0))
        if defer_access:
            self.pending_access.add(unit)
        else:
            _check(_drv.cuMemSetAccess(addr, self.unit_bytes, [_access_desc(self.device)], 1))

    def map_device(self, unit: int, handle: Any, *, defer_access: bool = False) -> None:
        """Back `unit` by a device allocation that already holds the unit's bytes.

        With `defer_access` the unit is not readable until flush_access(): a swap remaps many
        units between engine steps (nothing reads them meanwhile) and then sets access once per
        run of adjacent units, since cuMemSetAccess costs about as much as the unmap and map.
        """
        self._remap(unit, handle, defer_access)
        self.backing[unit] = handle

    def map_host(self, unit: int, *, defer_access: bool = False) -> None:
        """Back `unit` by its host master again; the device allocation is left to the caller."""
        if self.backing[unit] is None:
            return
        self._remap(unit, self.handles[unit], defer_access)
        self.backing[unit] = None

    def flush_access(self) -> int:
        """Make every remapped unit readable: one cuMemSetAccess per run of adjacent units.

        swap.py also calls this while later copies are in flight: only pending units (remapped;
        their own copies landed, or, remapping ahead, still in flight into a slot nothing reads
        before the swap returns) are touched, never the units or master mappings those copies read
        nor the pool's staging addresses they write (a separate reservation)."""
        if not self.pending_access:
            return 0
        calls = 0
        for first, count in contiguous_runs(self.pending_access):
            _check(
                _drv.cuMemSetAccess(
                    self.unit_address(first), count * self.unit_bytes, [_access_desc(self.device)], 1
                )
            )
            calls += 1
        self.pending_access.clear()
        return calls

    def release(self) -> None:
        self._release_mirror()
        super().release()
        self.backing.clear()


@dataclass
class DeviceSlotPool(_UnitRange):
    """A fixed set of HBM allocations (the slots), each mapped at its own staging address.

    Reserved once at startup (the HBM budget), never freed while serving: a swap copies into a
    slot through its staging address and then maps the same allocation at the expert's address in
    a MixedRange, so HBM use never exceeds the pool.
    """

    extra: list[_UnitRange] = field(default_factory=list)  # segments added by grow()

    @classmethod
    def create(cls, num_slots: int, unit_bytes: int, device: int) -> DeviceSlotPool:
        return cls._create("device", num_slots, unit_bytes, device)

    @property
    def num_slots(self) -> int:
        return self.num_units + sum(seg.num_units for seg in self.extra)

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.unit_bytes

    def slot_handle(self, slot: int) -> Any:
        """The HBM allocation of `slot` (what a MixedRange unit is mapped to)."""
        seg, local = self._segment(slot)
        return seg.handles[local]

    def unit_address(self, unit: int) -> int:
        """The staging address of slot `unit` (copies land there; it stays mapped)."""
        seg, local = self._segment(unit)
        return seg.base + local * seg.unit_bytes

    def _segment(self, slot: int) -> tuple[_UnitRange, int]:
        if slot < self.num_units:
            return self, slot
        slot -= self.num_units
        for seg in self.extra:
            if slot < seg.num_units:
                return seg, slot
            slot -= seg.num_units
        raise IndexError("slot beyond the pool")

    def grow(self, extra_slots: int) -> int:
        """Add `extra_slots` HBM slots in a new reservation of their own (no existing address
        moves: expert ranges, earlier slots and captured CUDA graphs stay valid). Returns the new
        slot count; all or nothing (a failed allocation frees what this call made)."""
        if extra_slots <= 0:
            return self.num_slots
        self.extra.append(_UnitRange._create("device", extra_slots, self.unit_bytes, self.device))
        return self.num_slots

    def release(self) -> None:
        for seg in self.extra:
            seg.release()
        self.extra.clear()
        _UnitRange.release(self)


def map_masters_at_load(rng: MixedRange, what: str) -> None:
    """The masters' second mapping at load, for remapping ahead (MixedRange.map_masters): layers
    with a plan core made it in their first swap, this covers those without one. Only address
    space: where the driver refuses, the first swap tries again, so a failure is only logged."""
    try:
        rng.map_masters()
    except RuntimeError as exc:  # a driver error (_check); a swap maps on first use instead
        logger.warning(
            "reap-swap: %s: the masters' second mapping failed at load (%s); a swap makes it", what, exc
        )
