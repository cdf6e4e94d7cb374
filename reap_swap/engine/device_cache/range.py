"""A layer range of E expert units (host masters, swappable as before) plus N HBM slot units.

The device cache (device_cache.py) needs its slots inside the same virtual range as the experts,
so that one [E + N, ...] strided view covers both and the unchanged fused-MoE kernel reads a
remapped id ``E + s`` as slot ``s``. Units 0..E-1 behave exactly as a vmm.MixedRange (a swap maps
an expert's unit to an HBM pool slot and back); units E..E+N-1 are mapped once, at creation, to
device allocations -- fresh ones, or handles lent by the engine's pool (``slot_handles``; then
the pool keeps ownership and ``release`` does not free them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reap_swap.engine import vmm


@dataclass
class CacheRange(vmm.MixedRange):
    """vmm.MixedRange over E + N units; ``num_slots`` trailing units are HBM cache slots."""

    num_slots: int = 0
    owns_slots: bool = True

    @classmethod
    def create(
        cls, num_experts: int, num_slots: int, unit_bytes: int, device: int, slot_handles=None
    ) -> CacheRange:
        drv = vmm._drv
        rng = cls(num_experts + num_slots, unit_bytes, device, num_slots=num_slots)
        rng.owns_slots = slot_handles is None
        size = rng.num_units * unit_bytes
        rng.base = int(vmm._check(drv.cuMemAddressReserve(size, 0, 0, 0)))
        try:
            host, dev = vmm._prop("host", device), vmm._prop("device", device)
            for unit in range(rng.num_units):
                slot = unit - num_experts
                if slot < 0 or slot_handles is None:
                    handle = vmm._check(drv.cuMemCreate(unit_bytes, host if slot < 0 else dev, 0))
                    rng.handles.append(handle)
                else:
                    handle = slot_handles[slot]
                    rng.handles.append(handle)
                vmm._check(drv.cuMemMap(rng.unit_address(unit), unit_bytes, 0, handle, 0))
            vmm._check(drv.cuMemSetAccess(rng.base, size, [vmm._access_desc(device)], 1))
        except Exception:
            rng.release()
            raise
        rng.backing = [None] * num_experts + list(rng.handles[num_experts:])
        return rng

    @property
    def num_experts(self) -> int:
        return self.num_units - self.num_slots

    def host_masters(self) -> int:
        """Only the E expert units have host masters; the slot units are HBM."""
        return min(len(self.handles), self.num_experts)

    def release(self) -> None:
        drv = vmm._drv
        self._release_mirror()
        for unit, handle in enumerate(self.handles):
            try:
                drv.cuMemUnmap(self.unit_address(unit), self.unit_bytes)
            finally:
                if unit < self.num_experts or self.owns_slots:
                    drv.cuMemRelease(handle)
        if self.base:
            drv.cuMemAddressFree(self.base, self.nbytes)
        self.handles.clear()
        self.backing.clear()
        self.base = 0


def rehome_with_slots(
    w13: torch.Tensor, w2: torch.Tensor, unit_bytes: int, num_slots: int, device: int, slot_handles=None
):
    """state.rehome with N slot units behind the experts (``slot_handles``: lent by the pool, else
    fresh). Returns (range, uint8 view of the whole range, (w13, w2) views over E units, (w13, w2)
    views over E + N units)."""
    num_experts, elem = w13.shape[0], w13.element_size()
    rng = CacheRange.create(num_experts, num_slots, unit_bytes, device, slot_handles)
    range_bytes = rng.as_bytes()
    flat = range_bytes.view(w13.dtype)
    unit_elems = unit_bytes // elem

    def views(units: int):
        a = flat.as_strided((units, *w13.shape[1:]), (unit_elems, w13.shape[2], 1), 0)
        b = flat.as_strided((units, *w2.shape[1:]), (unit_elems, w2.shape[2], 1), w13[0].numel())
        return a, b

    v13, v2 = views(num_experts)
    v13.copy_(w13)
    v2.copy_(w2)
    torch.cuda.synchronize(device)
    return rng, range_bytes, (v13, v2), views(num_experts + num_slots)
