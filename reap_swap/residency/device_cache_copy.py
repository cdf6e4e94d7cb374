"""Copy admitted experts into their cache slots, inside one layer range (issue 17, step 3 of 4).

The range holds E expert units then N slot units (device_cache.py). After ``DeviceCache.step``,
``copy_expert[s]`` names the expert to copy into slot ``s`` this step (-1: nothing). One Triton
launch with a fixed grid (N slots x chunks of a unit) copies unit ``e`` to unit ``E + s`` for
every active entry; inactive entries load and store nothing (masked), so the launch has the same
shape every step and a CUDA graph captures it. On the GPU the source unit is host memory mapped
into the range (pinned, read over PCIe by the SMs, exactly like the read-through path reads it);
the destination is HBM. Stream order puts the copy before the fused-MoE kernel of the same step.

``copy_units_torch`` is the reference (any device; moves all N slots, for tests only).
"""

from __future__ import annotations

import torch

BLOCK = 4096  # int64 elements per program (32 KiB)
_kernel = None


def _build():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["num_experts", "unit_elems"])
    def copy_into_slots(units_ptr, copy_ptr, num_experts, unit_elems, BLOCK: tl.constexpr):
        slot = tl.program_id(0)
        chunk = tl.program_id(1)
        expert = tl.load(copy_ptr + slot)
        offs = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inb = offs < unit_elems
        ok = inb & ((offs * 0 + expert) >= 0)  # the slot's entry, broadcast over the block
        src = units_ptr + tl.maximum(expert, 0).to(tl.int64) * unit_elems + offs
        dst = units_ptr + (num_experts + slot).to(tl.int64) * unit_elems + offs
        vals = tl.load(src, mask=ok, other=0)
        tl.store(dst, vals, mask=ok)

    return copy_into_slots


def unit_view(range_bytes: torch.Tensor, num_units: int, unit_bytes: int) -> torch.Tensor:
    """The range as int64 [units, unit_bytes // 8] (units are multiples of the 2 MiB granularity)."""
    if unit_bytes % 8:
        raise ValueError(f"unit of {unit_bytes} B is not a multiple of 8 B")
    return range_bytes[: num_units * unit_bytes].view(torch.int64).view(num_units, unit_bytes // 8)


def copy_units(units: torch.Tensor, copy_expert: torch.Tensor, num_experts: int) -> None:
    """One launch: ``units[E + s] = units[copy_expert[s]]`` where ``copy_expert[s] >= 0``.
    ``units``: unit_view over E + N units."""
    global _kernel
    num_slots = copy_expert.shape[0]
    if num_slots == 0:
        return
    if _kernel is None:
        _kernel = _build()
    unit_elems = units.shape[1]
    grid = (num_slots, -(-unit_elems // BLOCK))
    _kernel[grid](units, copy_expert, num_experts, unit_elems, BLOCK=BLOCK)


def copy_units_torch(units: torch.Tensor, copy_expert: torch.Tensor, num_experts: int) -> None:
    """Reference: the same result with torch ops (reads every slot's source; tests only)."""
    src = units[copy_expert.clamp(min=0)]
    slots = units[num_experts:]
    slots.copy_(torch.where((copy_expert >= 0).unsqueeze(1), src, slots))
