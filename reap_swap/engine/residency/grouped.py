"""Grouped residency units on CUDA: one unit per group of b physical experts, per re-homed tensor.

Why (research.md "Padding", `reap_swap.sizing.groups`): FP8 experts in private 2 MiB units waste
33 %; groups of b = 2 physically adjacent experts waste 11.1 %. The layout: each re-homed tensor
t gets its own host-backed MixedRange whose units are groups (a_t pages each) and whose view has
the uniform expert stride `s_t = G * a_t / b`, so the unchanged Triton kernel reads physical
expert p at `base_t + p * s_t`. The weights are copied into the ranges in *physical* order, every
per-expert kept-whole tensor (FP8 scales, biases: leading dim E) is permuted in place once --
the PR #50562 lesson: every tensor indexed by expert id follows the same permutation -- and the
routing ids are mapped logical -> physical right before the kernel (`remap_ids`), after the
router counters have counted the model's own ids. A swap makes whole groups resident: a group is
resident if any member is wanted (`group_layout.groups_for`); the SlotTable is keyed by
(layer, group), one slot = one group's pages in each tensor's pool.

Status: the data path (rehome, permute, swap, remap); its GPU test,
tests/gpu/test_grouped_engine.py (vLLM 0.26.0's fused_experts), passed on the H200.
Wired into CudaEngine by `grouped_engine` (--reap-group-size; served through
`grouped_backend.GroupedResidency`): served on the H200 (FP8 block b = 2, identical to stock).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from reap_swap.cache.slot_table import SlotTable
from reap_swap.engine import vmm
from reap_swap.engine.residency.swap import SwapResult, apply_swap
from reap_swap.engine.residency.vmm_store import StoreBase
from reap_swap.sizing.groups import GroupLayout, Permutation, group_target, layer_status, set_cost


@dataclass
class GroupedLayer:
    index: int
    layout: GroupLayout
    perm: Permutation
    ranges: dict[str, vmm.MixedRange]
    views: dict[str, torch.Tensor]
    id_map: torch.Tensor  # [E] logical -> physical, int32, on the device
    why: str = ""
    kept: tuple[str, ...] = ()  # the per-expert kept-whole tensors permuted at load
    module: Any = None  # the RoutedExperts whose parameters are `views` (engine-attached layers)
    aliases: dict[str, str] = field(default_factory=dict)  # alias name -> re-homed name
    kept_bytes: int = 0  # HBM of the kept-whole tensors (fixed, outside the pools)


@dataclass
class GroupedState:
    device: int
    granularity: int
    # the engine's --reap-swap-publish (swap.publish_mode); None: the default
    publish_every: int | None = None
    layers: dict[int, GroupedLayer] = field(default_factory=dict)
    pools: dict[str, vmm.DeviceSlotPool] = field(default_factory=dict)  # tensor -> group slots
    table: SlotTable | None = None  # (layer, group) -> slot
    copy_stream: torch.cuda.Stream | None = None
    swaps: int = 0
    bytes_copied_total: int = 0


def permute_rows_(t: torch.Tensor, perm: Permutation) -> bool:
    """Put row `to_logical[p]` at row p, in place (aliases and vLLM's quant config, which hold
    this tensor, see the permuted rows). False (untouched) when the leading dim is not E."""
    if t.dim() == 0 or t.shape[0] != perm.num_experts or t.numel() == 0:
        return False
    index = torch.tensor(perm.to_logical, device=t.device, dtype=torch.long)
    t.copy_(t.index_select(0, index))
    return True


def rehome_grouped(
    tensors: Mapping[str, torch.Tensor], layout: GroupLayout, perm: Permutation, device: int
) -> tuple[dict[str, vmm.MixedRange], dict[str, torch.Tensor]]:
    """Copy [E, ...] tensors into one host-backed range per tensor (units = groups), in physical
    order; return the ranges and the strided views the kernel reads (physical expert ids)."""
    ranges, views = {}, {}
    try:
        for i, name in enumerate(layout.names):
            t = tensors[name]
            elem = t.element_size()
            rng = vmm.MixedRange.create_host_backed(layout.num_groups, layout.unit_bytes[i], device)
            ranges[name] = rng
            strides = (layout.strides[i] // elem, *t.stride()[1:])
            view = rng.as_bytes().view(t.dtype).as_strided(tuple(t.shape), strides, 0)
            for p, e in enumerate(perm.to_logical):
                view[p].copy_(t[e])
            views[name] = view
        torch.cuda.synchronize(device)
    except Exception:
        for rng in ranges.values():
            rng.release()
        raise
    return ranges, views


def to_physical(id_map: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Logical routing ids -> physical ids through `id_map` ([E], logical -> physical): one gather,
    no host sync, graph-capturable; shape and dtype of `topk_ids` kept."""
    flat = torch.index_select(id_map, 0, topk_ids.reshape(-1).to(torch.long))
    return flat.view(topk_ids.shape).to(topk_ids.dtype)


def remap_ids(layer: GroupedLayer, topk_ids: torch.Tensor) -> torch.Tensor:
    """Logical routing ids -> physical ids of `layer` (see to_physical)."""
    return to_physical(layer.id_map, topk_ids)


class GroupedStore(StoreBase):
    """swap.ExpertStore over groups: `expert` is a physical group id, a slot holds one group."""

    def __init__(self, st: GroupedState, publish_every: int | None = None) -> None:
        first = next(iter(st.layers.values()), None)
        super().__init__(st, publish_every, first.layout.group_payload_bytes if first else 0)  # per group

    def map_host(self, layer: int, group: int) -> None:
        for rng in self.st.layers[layer].ranges.values():
            rng.map_host(group, defer_access=True)

    def start_copy(self, layer: int, group: int, slot: int) -> Any:
        entry, stream = self.st.layers[layer], self.st.copy_stream
        for i, name in enumerate(entry.layout.names):
            rng = entry.ranges[name]
            src = rng.master_address(group) if self.copies_read_masters else rng.unit_address(group)
            dst = self.st.pools[name].unit_address(slot)
            vmm.copy_async(dst, src, entry.layout.payload(i), stream.cuda_stream)
        return self._landed_event()

    def map_slot(self, layer: int, group: int, slot: int) -> None:
        for name, rng in self.st.layers[layer].ranges.items():
            rng.map_device(group, self.st.pools[name].slot_handle(slot), defer_access=True)

    def publish(self) -> None:
        """Set access on every pending remap (flush_access returns at once where none is); also
        called while later copies are in flight (swap.py's module docstring says why it is safe)."""
        for entry in self.st.layers.values():
            for rng in entry.ranges.values():
                rng.flush_access()


def apply_logical(
    st: GroupedState, target: Mapping[int, Iterable[int]], store: Any = None, count: bool = True
) -> dict:
    """Make the groups holding `target` (layer -> logical experts) resident, exactly those.
    `store`: the data path (default the VMM GroupedStore; CPU tests pass a fake); `count`: add
    the swap to `swaps` / `bytes_copied_total` (False: the load-time core fill)."""
    target = {int(l): [int(e) for e in v] for l, v in target.items()}
    perms = {i: e.perm for i, e in st.layers.items()}
    sizes = {i: e.layout.group_size for i, e in st.layers.items()}
    groups = group_target(target, perms, sizes)
    result: SwapResult = apply_swap(st.table, store or GroupedStore(st), groups)
    if count:
        st.swaps += 1
        st.bytes_copied_total += result.bytes_copied
    costs = {l: set_cost(target[l], st.layers[l].perm, st.layers[l].layout) for l in groups}
    return {
        "bytes_copied": result.bytes_copied,
        "admitted_groups": len(result.plan.admit),
        "evicted_groups": len(result.plan.evict),
        "reused_groups": result.plan.reused,
        "phases": result.phases,
        "hbm_bytes": sum(c.hbm_bytes for c in costs.values()),
        "wanted_experts": sum(c.wanted for c in costs.values()),
        "resident_experts": sum(c.resident for c in costs.values()),
    }


def resident_groups(st: GroupedState) -> dict[int, frozenset[int]]:
    return st.table.resident()


def status(st: GroupedState) -> dict:
    """Per layer: layout, b, why, groups resident (what /reap/status would show)."""
    resident = st.table.resident() if st.table is not None else {}
    return {
        str(i): {**layer_status(e.layout, e.perm, e.why), "resident_groups": sorted(resident.get(i, ()))}
        for i, e in sorted(st.layers.items())
    }


def release(st: GroupedState) -> None:
    for entry in st.layers.values():
        for rng in entry.ranges.values():
            rng.release()
    for pool in st.pools.values():
        pool.release()
    st.layers.clear()
    st.pools.clear()


def standalone_grouped(
    layers: Mapping[int, Mapping[str, torch.Tensor]],
    kept: Mapping[int, Mapping[str, torch.Tensor]],
    perms: Mapping[int, Permutation],
    layouts: Mapping[int, GroupLayout],
    num_group_slots: int,
    device: int = 0,
) -> GroupedState:
    """Grouped engine over plain tensors (GPU tests, benchmarks): re-home `layers` (name -> [E, ...]
    in layout order), permute `kept` in place, reserve one pool per tensor of `num_group_slots`."""
    st = GroupedState(device=device, granularity=vmm.ensure_available(device))
    st.copy_stream = torch.cuda.Stream(device=device)
    try:
        for index, tensors in layers.items():
            layout, perm = layouts[index], perms[index]
            if layout.granule % st.granularity:
                raise ValueError(f"layout granule {layout.granule} is not a multiple of {st.granularity}")
            if not st.pools:
                for i, name in enumerate(layout.names):
                    st.pools[name] = vmm.DeviceSlotPool.create(num_group_slots, layout.unit_bytes[i], device)
                st.table = SlotTable(num_group_slots)
            elif tuple(p.unit_bytes for p in st.pools.values()) != layout.unit_bytes:
                raise ValueError(f"layer {index}: group units differ from the first layer's")
            ranges, views = rehome_grouped(tensors, layout, perm, device)
            permuted = tuple(n for n, t in kept.get(index, {}).items() if permute_rows_(t, perm))
            id_map = torch.tensor(perm.to_physical, dtype=torch.int32, device=f"cuda:{device}")
            st.layers[index] = GroupedLayer(
                index, layout, perm, ranges, views, id_map, "standalone", permuted
            )
    except Exception:
        release(st)
        raise
    return st
