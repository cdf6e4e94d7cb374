"""Copy admitted experts into their cache slots, inside one layer range.

The range holds E expert units then N slot units (device_cache.py). After ``DeviceCache.step``,
``copy_expert[s]`` names the expert to copy into slot ``s`` this step (-1: nothing). On the GPU
the source unit is host memory mapped into the range (pinned, read over PCIe by the SMs, exactly
like the read-through path reads it); the destination is HBM. Stream order puts the copy before
the fused-MoE kernel of the same step.

``copy_units`` (the default, branch ``copynoop``): a *persistent* launch of a fixed grid of P
programs (``PROGRAMS_PER_SM`` per SM, at most N x chunks). Every program loads the N entries of
``copy_expert`` (one vector, L2-resident), counts the admitted ones (``count``) and ranks them
(an exclusive scan), then loops over the work items (k-th admitted slot, chunk c) assigned to it
-- item ``k * chunks + c`` goes to program ``(k * chunks + c) % P`` -- copying 32 KiB per item.
With nothing admitted the loop is empty: P programs read 8N bytes and exit, instead of the
N x chunks programs (18 432 for 64 slots of a 9.4 MB unit) of the dense launch that each read
their flag. The grid is fixed (from N, the unit size and the SM count), no value reaches the
host, so a CUDA graph captures it and a replay copies whatever the replayed step admitted.

``copy_units_dense``: the first kernel (one program per (slot, chunk), masked when inactive), kept
for the side-by-side bench (research/gpu/bench_device_cache.py) and as a second implementation in the
tests. ``copy_units_torch`` is the reference (any device; moves all N slots, for tests only).
"""

from __future__ import annotations

import torch

BLOCK = 4096  # int64 elements per work item / program (32 KiB)
PROGRAMS_PER_SM = 2  # persistent grid: programs per SM (H200: 132 SMs -> 264)
CPU_PROGRAMS = 4  # grid on CPU tensors (TRITON_INTERPRET=1 tests): small, to exercise the loop
NUM_WARPS = 4
_kernels: dict[str, object] = {}
_sm_count: dict[int, int] = {}


def _build_dense():
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


def _build_persistent():
    import triton
    import triton.language as tl

    # unit_elems is left specialised (divisible by 16 for every real unit: 2 MiB multiples), so
    # Triton knows every chunk start is 16 B aligned and issues 16 B vector loads/stores
    @triton.jit(do_not_specialize=["num_experts", "num_slots", "chunks"])
    def copy_admitted(
        units_ptr, copy_ptr, num_experts, num_slots, unit_elems, chunks, BN: tl.constexpr, BLOCK: tl.constexpr
    ):
        pid = tl.program_id(0)
        progs = tl.num_programs(0)
        lanes = tl.arange(0, BN)
        entry = tl.load(copy_ptr + lanes, mask=lanes < num_slots, other=-1).to(tl.int64)
        act = (entry >= 0).to(tl.int32)
        count = tl.sum(act, 0)
        rank = tl.cumsum(act, 0) - act  # exclusive: the k of each admitted slot
        cols = tl.arange(0, BLOCK).to(tl.int64)
        for k in range(0, count):
            sel = (act > 0) & (rank == k)
            slot = tl.sum(tl.where(sel, lanes, 0), 0).to(tl.int64)
            expert = tl.sum(tl.where(sel, entry, 0), 0)
            src_unit = units_ptr + expert * unit_elems
            dst_unit = units_ptr + (num_experts + slot) * unit_elems
            first = (pid - (k * chunks) % progs + progs) % progs  # this program's first chunk of k
            for c in range(first, chunks, progs):
                offs = cols + c * BLOCK  # c * BLOCK < unit_elems: int32 is enough
                inb = offs < unit_elems
                vals = tl.load(src_unit + offs, mask=inb, other=0)
                tl.store(dst_unit + offs, vals, mask=inb)

    return copy_admitted


def _kernel(name: str):
    if name not in _kernels:
        _kernels[name] = _build_persistent() if name == "persistent" else _build_dense()
    return _kernels[name]


def unit_view(range_bytes: torch.Tensor, num_units: int, unit_bytes: int) -> torch.Tensor:
    """The range as int64 [units, unit_bytes // 8] (units are multiples of the 2 MiB granularity)."""
    if unit_bytes % 8:
        raise ValueError(f"unit of {unit_bytes} B is not a multiple of 8 B")
    return range_bytes[: num_units * unit_bytes].view(torch.int64).view(num_units, unit_bytes // 8)


def programs_for(units: torch.Tensor, num_slots: int, programs: int | None = None) -> int:
    """The persistent grid: ``programs`` if given, else PROGRAMS_PER_SM x SMs (CUDA) or
    CPU_PROGRAMS; never more than the N x chunks work items of a step admitting every slot."""
    chunks = -(-units.shape[1] // BLOCK)
    if programs is None:
        if units.is_cuda:
            dev = units.device.index if units.device.index is not None else torch.cuda.current_device()
            if dev not in _sm_count:
                _sm_count[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
            programs = PROGRAMS_PER_SM * _sm_count[dev]
        else:
            programs = CPU_PROGRAMS
    return max(1, min(programs, num_slots * chunks))


def copy_units(
    units: torch.Tensor, copy_expert: torch.Tensor, num_experts: int, programs: int | None = None
) -> None:
    """One persistent launch: ``units[E + s] = units[copy_expert[s]]`` where ``copy_expert[s] >= 0``
    (this module's docstring). ``units``: unit_view over E + N units; N <= 4096."""
    num_slots = copy_expert.shape[0]
    if num_slots == 0:
        return
    if num_slots > 4096:
        raise ValueError(f"{num_slots} cache slots: the copy kernel ranks at most 4096 in one block")
    unit_elems = units.shape[1]
    grid = (programs_for(units, num_slots, programs),)
    bn = max(16, 1 << (num_slots - 1).bit_length())
    _kernel("persistent")[grid](
        units, copy_expert, num_experts, num_slots, unit_elems, -(-unit_elems // BLOCK),
        BN=bn, BLOCK=BLOCK, num_warps=NUM_WARPS,
    )  # fmt: skip


def copy_units_dense(units: torch.Tensor, copy_expert: torch.Tensor, num_experts: int) -> None:
    """The first kernel: one program per (slot, chunk), N x chunks programs every step."""
    num_slots = copy_expert.shape[0]
    if num_slots == 0:
        return
    unit_elems = units.shape[1]
    grid = (num_slots, -(-unit_elems // BLOCK))
    _kernel("dense")[grid](units, copy_expert, num_experts, unit_elems, BLOCK=BLOCK)


def copy_units_torch(units: torch.Tensor, copy_expert: torch.Tensor, num_experts: int) -> None:
    """Reference: the same result with torch ops (reads every slot's source; tests only)."""
    src = units[copy_expert.clamp(min=0)]
    slots = units[num_experts:]
    slots.copy_(torch.where((copy_expert >= 0).unsqueeze(1), src, slots))
