"""The residency engine's state and what is done to it below vLLM's layers: re-homing, swaps, release.

`EngineState` (one per worker process) holds each re-homed layer's `LayerEntry` (its mixed range
and unit layout), the HBM slot pool and the slot table. `rehome` copies [E, ...] expert tensors
into a new host-backed range, `swap_state` / `release_state` swap and free a state, and
`standalone_state` / `standalone_tensors_state` build one over plain tensors. None of it needs a
vLLM layer, so it lives apart from engine.py (CudaEngine's load-time hooks): the worker's backend
(cuda_backend.py), the GPU tests and the research benchmarks use the state without the load path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from reap_swap.cache.slot_table import SlotTable
from reap_swap.engine import vmm
from reap_swap.engine.residency import grouped as grouped_units
from reap_swap.engine.residency.swap import apply_swap
from reap_swap.engine.residency.vmm_store import VmmStore
from reap_swap.sizing.host_memory import RELEASE_BLOCK_BYTES
from reap_swap.sizing.unit_layout import UnitLayout, plan_unit


@dataclass
class LayerEntry:
    index: int
    name: str
    num_experts: int
    unit_bytes: int
    expert_bytes: int  # bytes a swap copies per expert (the unit's payload)
    rng: vmm.MixedRange
    range_bytes: torch.Tensor  # uint8 view over the whole range (copy source)
    module: torch.nn.Module | None = None  # the RoutedExperts whose weights live in `rng`
    layout: UnitLayout | None = None  # where each re-homed tensor's slab sits in a unit
    aliases: dict[str, str] = field(default_factory=dict)  # alias name -> re-homed name
    kept_bytes: int = 0  # HBM of the tensors kept whole (scales, biases): fixed, every expert


@dataclass
class EngineState:
    """The device-side state: one per worker process (one GPU)."""

    device: int
    plan: Any | None
    budget_bytes: int
    granularity: int
    layers: dict[int, LayerEntry] = field(default_factory=dict)
    pool: vmm.DeviceSlotPool | None = None
    table: SlotTable | None = None
    copy_stream: torch.cuda.Stream | None = None
    swaps: int = 0
    bytes_copied_total: int = 0
    load_seconds: float = 0.0
    host_cache_release: str | None = None  # the torch call that returned vLLM's old pinned copies
    exact_pinned_released: int = 0  # bytes of --reap-exact-pinning copies unregistered after re-homing
    grouped: grouped_units.GroupedState | None = None  # --reap-group-size b > 1 layers (grouped_engine)
    layouts: dict[int, dict] = field(default_factory=dict)  # per layer: layout, b, why (/reap/status)
    publish_every: int | None = None  # --reap-swap-publish as swap.py's value; None: swap.PUBLISH_EVERY

    @property
    def kept_hbm_bytes(self) -> int:
        """HBM held by kept-whole per-layer tensors of the re-homed layers (outside the pool)."""
        return sum(e.kept_bytes for e in self.layers.values())


def rehome(
    tensors: Mapping[str, torch.Tensor],
    layout: UnitLayout,
    device: int,
    num_units: int | None = None,
    on_copied: Callable[[int, int], int] | None = None,
) -> tuple[vmm.MixedRange, torch.Tensor, dict[str, torch.Tensor]]:
    """Copy [E, ...] expert tensors into a new host-backed mixed range; return it and the views.

    Unit e holds slab e of each tensor at `layout.offset_of(name)`; each view keeps its tensor's
    shape and inner strides, with an expert stride of one unit. `num_units` >= E leaves room for
    extra units after the experts' (a device cache's slots); the views cover the first E.
    `on_copied(e0, e1)`: called once experts [e0, e1) are copied (blocks of ~RELEASE_BLOCK_BYTES, each
    block's units allocated just before it), so their source can be given back during the copy
    (--reap-exact-pinning: the sources are then vLLM's CPU copies, unregistered by compat/pinning.py
    `drain`; each block is one pageable copy).
    """
    num_experts = next(iter(tensors.values())).shape[0]
    total = num_units or num_experts
    if on_copied is None:
        rng = vmm.MixedRange.create_host_backed(total, layout.unit_bytes, device)
    else:  # in blocks, a unit's host bytes are allocated just before its expert is copied (rng.grow)
        rng = vmm.MixedRange.create_host_backed(total, layout.unit_bytes, device, allocate=0)
    range_bytes = rng.as_bytes()
    views = {}
    for name, t in tensors.items():
        elem = t.element_size()
        flat = range_bytes.view(t.dtype)
        strides = (layout.unit_bytes // elem, *t.stride()[1:])
        views[name] = flat.as_strided(tuple(t.shape), strides, layout.offset_of(name) // elem)
    per_expert = sum(t[0].numel() * t.element_size() for t in tensors.values()) if num_experts else 1
    step = num_experts if on_copied is None else max(1, RELEASE_BLOCK_BYTES // max(per_expert, 1))
    for e0 in range(0, num_experts, max(step, 1)):
        e1 = min(num_experts, e0 + step)
        if on_copied is not None:
            rng.grow(e1)
        for name, t in tensors.items():
            views[name][e0:e1].copy_(t[e0:e1])
        if on_copied is not None:
            torch.cuda.synchronize(device)  # the source is read by the copy until here
            on_copied(e0, e1)
    if on_copied is not None:
        rng.grow(total)  # a device cache's extra units
    torch.cuda.synchronize(device)
    return rng, range_bytes, views


def swap_state(st: EngineState, target: Mapping[int, Any]):
    """apply_swap over an engine state's VMM store (CudaResidency.apply minus the bookkeeping)."""
    return apply_swap(st.table, VmmStore(st), target)


def release_state(st: EngineState) -> None:
    """Unmap and free every layer range and the slot pool (nothing may read them afterwards)."""
    for entry in st.layers.values():
        entry.rng.release()
    if st.pool is not None:
        st.pool.release()
    st.layers.clear()
    st.pool = None
    if st.grouped is not None:
        grouped_units.release(st.grouped)
        st.grouped = None


def standalone_state(
    layers: Mapping[int, tuple[torch.Tensor, torch.Tensor]], num_slots: int, device: int = 0
) -> tuple[EngineState, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """An engine over plain [E, ...] weight tensors, outside vLLM (GPU tests and benchmarks).

    Returns the state and, per layer, the (w13, w2) views that a kernel should read.
    """
    named = {i: {"w13_weight": w13, "w2_weight": w2} for i, (w13, w2) in layers.items()}
    st, views = standalone_tensors_state(named, num_slots, device)
    return st, {i: (v["w13_weight"], v["w2_weight"]) for i, v in views.items()}


def standalone_tensors_state(
    layers: Mapping[int, Mapping[str, torch.Tensor]], num_slots: int, device: int = 0
) -> tuple[EngineState, dict[int, dict[str, torch.Tensor]]]:
    """As standalone_state for any set of re-homed [E, ...] tensors per layer (name -> tensor,
    in unit order): the quantized layouts' GPU tests re-home FP8 weights this way."""
    st = EngineState(device=device, plan=None, budget_bytes=0, granularity=vmm.ensure_available(device))
    st.copy_stream = torch.cuda.Stream(device=device)
    views = {}
    for index, tensors in layers.items():
        slabs = [(n, t[0].numel() * t.element_size()) for n, t in tensors.items()]
        layout = plan_unit(slabs, st.granularity)
        if st.pool is None:
            st.pool = vmm.DeviceSlotPool.create(num_slots, layout.unit_bytes, device)
            st.table = SlotTable(num_slots)
        rng, range_bytes, views[index] = rehome(tensors, layout, device)
        num_experts = next(iter(tensors.values())).shape[0]
        st.layers[index] = LayerEntry(
            index, f"layer{index}", num_experts, layout.unit_bytes, layout.payload_bytes, rng, range_bytes,
            layout=layout,
        )  # fmt: skip
    return st, views
