"""One expert's private mapping unit: the re-homed tensors of expert e side by side, padded.

Why: the CUDA engine backs each expert's slice of a layer's virtual range by host or HBM memory
one *unit* at a time, so a unit must hold everything that moves with expert e and nothing of
another expert. The binder (`reap_swap.sizing.quant.layout.bind_layer`) says which tensors move
(REHOME: the weights, packed int4 included); this lays them out: unit e holds slab e of every
re-homed tensor in the binder's order, each slab starting at an aligned offset, the unit padded
to the mapping granularity (2 MiB on the H200). The kernel then reads tensor t of expert e at
`range base + e * unit_bytes + offset_t` (its expert stride is one unit), which is what a
stride-taking kernel (vLLM's Triton fused_moe) accepts; today's bf16 layout is the case of two
tensors (w13 then w2). A range may hold more units than experts (a device cache's extra slots):
units are addressed by index, and the views cover only the first `num_experts`.

Pure: no torch. `payload_bytes` is what a swap copies (the slabs and the alignment gaps between
them, never the padding after the last slab).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SLAB_ALIGN = 4096  # bytes: every slab starts page-aligned inside its unit (>= any kernel's vector load)


@dataclass(frozen=True)
class UnitLayout:
    names: tuple[str, ...]  # re-homed tensors, in unit order
    slab_bytes: tuple[int, ...]  # one expert's slab of each
    offsets: tuple[int, ...]  # byte offset of each slab inside the unit
    payload_bytes: int  # end of the last slab: the bytes a swap copies per expert
    unit_bytes: int  # payload padded to the granularity: the HBM slot size

    @property
    def expert_bytes(self) -> int:
        """The bytes of expert data in one unit (the slabs alone)."""
        return sum(self.slab_bytes)

    @property
    def padding_overhead(self) -> float:
        return self.unit_bytes / max(self.expert_bytes, 1) - 1

    def offset_of(self, name: str) -> int:
        return self.offsets[self.names.index(name)]


def round_up(x: int, to: int) -> int:
    """`x` rounded up to a multiple of `to`."""
    return -(-x // to) * to


def plan_unit(slabs: Sequence[tuple[str, int]], granularity: int, align: int = SLAB_ALIGN) -> UnitLayout:
    """Lay out one expert's slabs (name, bytes) at `align`-aligned offsets in a granularity unit."""
    if not slabs:
        raise ValueError("no tensor to re-home: a unit needs at least one slab")
    if granularity <= 0 or align <= 0 or granularity % align:
        raise ValueError(f"granularity {granularity} must be a positive multiple of the alignment {align}")
    names, sizes, offsets, end = [], [], [], 0
    for name, nbytes in slabs:
        if nbytes <= 0:
            raise ValueError(f"{name}: slab of {nbytes} B")
        if name in names:
            raise ValueError(f"{name}: listed twice")
        start = round_up(end, align)
        names.append(name)
        sizes.append(int(nbytes))
        offsets.append(start)
        end = start + int(nbytes)
    return UnitLayout(tuple(names), tuple(sizes), tuple(offsets), end, round_up(end, granularity))
