"""Group-aware planning (`reap-swap plan --group-size auto|1|2|4|8`; research.md "Padding").

Why: the grouped engine (`--reap-group-size`) makes groups of b consecutive *physical* experts
resident together, physical order = the plan's core (ascending), then each slice in catalog order
(`group_layout.physical_order`). A core or slice whose size is not a multiple of b leaves a
boundary group holding an expert nobody asked for (FP8 b = 2 at Qwen3-30B-A3B shape: 5.1-5.8 MiB
per wanted expert instead of 5.00). So with a group size the planner:

- prices an expert at the HBM it takes in whole groups, `group_bytes / b`, by the engine's own
  math (`group_layout.choose_group_size` and `plan_groups` over the checkpoint's w13 / w2 bytes,
  `ModelShape.expert_format`): the budget's core and specialist bytes become whole groups;
- rounds each layer's core to whole groups: a forced expert (super expert, REAP guard) that opens
  a group is joined by the layer's next-best experts in the value order the core fill uses, and
  the rest of the core is filled one group at a time (the next b experts of a layer by value),
  greedily across layers by the value a group adds;
- makes every slice whole groups (slice size a multiple of b; with numExperts and the core in
  whole groups, the last slice of a layer is too).

Without `--group-size` the planner is today's (experts priced at checkpoint bytes, no rounding) and
the plan has no `groupSize` (read as 1). Pure.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass

from reap_swap.planner.allocation import LayerWork, Slots
from reap_swap.planner.config import PlannerConfig, PlannerError
from reap_swap.sizing.contiguous_groups import (
    ContiguousLayoutError,
    contiguous_group_size,
    plan_contiguous_groups,
)
from reap_swap.sizing.groups import GROUP_SIZES, GroupLayout, choose_group_size, plan_groups
from reap_swap.sizing.model_shape import ModelShape
from reap_swap.sizing.quant.padding import GRANULE


@dataclass(frozen=True)
class GroupPricing:
    """The group size the plan is made for and what one resident group costs in HBM."""

    requested: str  # the --group-size value
    group_size: int  # b
    why: str
    layout: GroupLayout  # the engine's layout of one layer at this b

    @property
    def group_bytes(self) -> int:
        """HBM of one resident group (its pages of every re-homed tensor)."""
        return self.layout.group_bytes

    @property
    def bytes_per_expert(self) -> float:
        return self.layout.bytes_per_expert

    def artifact(self) -> dict:
        """scorerArtifacts.grouping: how the group size and its price were chosen."""
        lay = self.layout
        return {
            "requested": self.requested,
            "groupSize": self.group_size,
            "why": self.why,
            "granuleBytes": lay.granule,
            "tensors": list(lay.names),
            "slabBytes": list(lay.slab_bytes),
            "strideBytes": list(lay.strides),
            "groupHbmBytes": lay.group_bytes,
            "hbmBytesPerExpert": lay.bytes_per_expert,
            "paddingOverhead": round(lay.padding_overhead, 6),
        }


def group_pricing(shape: ModelShape, requested: str, granule: int = GRANULE) -> GroupPricing:
    """b and the HBM of one group for `shape`'s experts, as the grouped engine would lay them out."""
    if requested not in GROUP_SIZES:
        raise PlannerError(f"--group-size {requested!r}: expected one of {', '.join(GROUP_SIZES)}")
    fmt = shape.expert_format
    slabs = (("w13_weight", fmt.w13), ("w2_weight", fmt.w2))
    if fmt.kernel == "contiguous":  # INT4 / MXFP4 on Marlin or moe_wna16: stride = slab, whole pages
        return _contiguous_pricing(shape, requested, slabs, granule)
    if fmt.kernel != "strided":
        raise PlannerError(f"--group-size {requested}: {shape.quant_method} experts run on an opaque kernel")
    b, why = choose_group_size(slabs, requested, granule)
    if shape.num_experts % b:
        raise PlannerError(
            f"--group-size {requested}: {shape.num_experts} experts per layer are not whole groups of {b}"
        )
    try:
        layout = plan_groups(slabs, shape.num_experts, b, granule)
    except ValueError as exc:
        raise PlannerError(f"--group-size {requested}: {exc}") from exc
    return GroupPricing(requested, b, why, layout)


def _contiguous_pricing(shape: ModelShape, requested: str, slabs, granule: int) -> GroupPricing:
    """The engine's contiguous group layout (reap_swap.sizing.contiguous_groups): the same b it will pick."""
    try:
        b, why = contiguous_group_size(slabs, shape.num_experts, requested, granule)
        layout = plan_contiguous_groups(slabs, shape.num_experts, b, granule)
    except ContiguousLayoutError as exc:
        raise PlannerError(
            f"--group-size {requested}: {shape.quant_method or shape.quant.kind} experts run on a contiguous "
            f"kernel: {exc}"
        ) from exc
    return GroupPricing(requested, b, why, layout)


def split_budget_grouped(
    total_bytes: int, pricing: GroupPricing, n_layers: int, num_experts: int, config: PlannerConfig
) -> Slots:
    """As planner_allocation.split_budget, in whole groups at the grouped HBM price: core and
    specialist slots are multiples of b, the slice size too (derived: rounded up to b)."""
    b, gb = pricing.group_size, pricing.group_bytes
    core_bytes = int(math.floor(total_bytes * config.core_fraction))
    specialist_bytes = total_bytes - core_bytes
    core = min(core_bytes // gb, n_layers * (num_experts // b)) * b
    specialist = (specialist_bytes // gb) * b
    if config.slice_size is not None and config.slice_size % b:
        raise PlannerError(f"--slice-size {config.slice_size} is not a multiple of --group-size b = {b}")
    derived = max(1, math.ceil(specialist / (n_layers * config.slices_per_request)))
    slice_size = config.slice_size or b * math.ceil(derived / b)
    return Slots(total_bytes, core_bytes, specialist_bytes, core, specialist, slice_size)


def round_forced_to_groups(work: Mapping[int, LayerWork], b: int) -> dict[int, list[int]]:
    """Fill each layer's partial core group (forced experts) with its next-best experts in value
    order; returns the experts added per layer."""
    added: dict[int, list[int]] = {}
    for i, w in sorted(work.items()):
        need = -len(w.core) % b
        for e in w.order:
            if need <= 0:
                break
            if e not in w.core:
                w.core.add(e)
                added.setdefault(i, []).append(e)
                need -= 1
    return added


def _next_group(w: LayerWork, b: int) -> list[int]:
    return [e for e in w.order if e not in w.core][:b]


def allocate_core_grouped(work: dict[int, LayerWork], slots: int, uniform: bool, b: int) -> None:
    """Fill the core up to `slots` experts in whole groups of b. Forced experts are already in and
    rounded to groups (`round_forced_to_groups`)."""
    used = sum(len(w.core) for w in work.values())
    if used > slots:
        raise PlannerError(
            f"forced core experts (super experts, REAP guard) rounded to groups of {b} take {used} "
            f"slots, over the core's {slots}; raise the budget or pass --no-reap-guard"
        )
    groups_left = (slots - used) // b
    if uniform:  # the same number of groups per layer (remainder to the lowest layers)
        n, total = len(work), slots // b
        for k, w in enumerate(sorted(work.values(), key=lambda w: w.index)):
            want = (total // n + (1 if k < total % n else 0)) * b
            while len(w.core) < want and groups_left > 0:
                w.core.update(_next_group(w, b))
                groups_left -= 1
        return
    heap: list[tuple[float, float, int]] = []

    def push(w: LayerWork) -> None:
        group = _next_group(w, b)
        if len(group) == b:
            heapq.heappush(heap, (-float(w.values[group].sum()), -float(w.secondary[group].sum()), w.index))

    for w in sorted(work.values(), key=lambda w: w.index):
        push(w)
    while heap and groups_left > 0:
        *_, layer = heapq.heappop(heap)
        work[layer].core.update(_next_group(work[layer], b))
        groups_left -= 1
        push(work[layer])


def grouped_budget_fields(slots: Slots, pricing: GroupPricing) -> dict:
    """The budget section's grouped keys (schema: budget.group_hbm_bytes)."""
    return {
        "group_hbm_bytes": pricing.group_bytes,
        "total_active_expert_capacity": (slots.total_bytes // pricing.group_bytes) * pricing.group_size,
    }
