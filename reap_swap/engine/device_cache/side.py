"""Slot rows of a cached layer's per-expert side tensors (FP8 / INT scales, zero points, biases).

After the device cache's remap the fused-MoE kernel reads an expert held in slot s as unit E + s,
and it indexes every per-expert side tensor by that same id. vLLM PR #50562 went wrong exactly
there: it moved weights into slots and remapped ids but kept indexing the FP8 scales by expert, so
slot s read expert s's scales. Here each side tensor T [E, ...] is replaced by T' [E + N, ...]:
rows [0, E) are T (the kernel's reads by expert id, pinned experts and read-through misses, are
unchanged) and row E + s is the row of the expert slot s holds. ``refresh`` rewrites the N slot
rows from ``slot_expert`` every step, after the policy step and before the kernel, inside the
captured graph (fixed shapes, no host sync); a slot holding nothing gets expert 0's row, which no
remapped id reads. N rows of a few hundred bytes each per step: FP8 block scales of a
Qwen3-30B-A3B expert are 1,152 B. Pure torch: runs on CPU tensors (tests/test_device_cache_side.py)
and on CUDA (tests/gpu/test_device_cache_quant.py). Which tensors, and where the kernel finds them,
is vLLM's business: compat.moe_cache.slot_row_places.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


class SlotRows:
    """The [E + N, ...] copies of one layer's side tensors and their per-step slot-row refresh."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], num_experts: int, num_slots: int) -> None:
        self.num_experts, self.num_slots = int(num_experts), int(num_slots)
        self.ext: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if t.dim() < 1 or t.shape[0] != self.num_experts:
                raise ValueError(f"{name}: leading dimension {tuple(t.shape)[:1]} is not E = {num_experts}")
            ext = torch.empty(
                (self.num_experts + self.num_slots, *t.shape[1:]), dtype=t.dtype, device=t.device
            )
            ext[: self.num_experts].copy_(t)
            ext[self.num_experts :].copy_(t[:1].expand(self.num_slots, *t.shape[1:]))
            self.ext[name] = ext

    @property
    def names(self) -> list[str]:
        return sorted(self.ext)

    def refresh(self, slot_expert: torch.Tensor) -> None:
        """Row E + s := row slot_expert[s] of every side tensor (slot_expert < 0: expert 0's row)."""
        if not self.ext:
            return
        src = slot_expert.to(torch.int64).clamp(min=0)
        e = self.num_experts
        for ext in self.ext.values():
            ext[e:].copy_(ext[:e].index_select(0, src))
