"""The cache tail (``--cache-tail``): per-layer core caps that leave the device cache room beside the core.

The pinned cache form serves the core in its own units and runs the cache on the slots the core
leaves, so a large core can leave fewer tail slots per layer than one token routes. build_plan asks
this module for the caps before filling the core (:func:`tail_caps`) and records what the capped
fill kept afterwards (:func:`finish_tail_record`); both write the ``scorerArtifacts.cacheTail``
record and the plan's notes. Kept apart from build.py because it is one optional step with its own
arithmetic and wording, and build.py is the orchestration of all the steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from reap_swap.planner.allocation import LayerWork, Slots, cap_core, core_caps, tail_core_limit
from reap_swap.planner.config import PlannerConfig
from reap_swap.planner.inputs import PlannerInputs
from reap_swap.sizing.model_shape import ModelShape


def tail_caps(
    inputs: PlannerInputs,
    shape: ModelShape,
    config: PlannerConfig,
    slots: Slots,
    notes: list[str],
    supers: Mapping[int, list[int]],
) -> tuple[dict[int, int], Slots, dict[str, Any]]:
    """--cache-tail: (per-layer core caps, the slots with the core lowered to what leaves the tail,
    the scorerArtifacts.cacheTail record so far). ``supers``: build_plan's super experts, which stay
    resident above the limits (a note says the tail is then short)."""
    tail = config.tail_slots(shape.top_k)
    total = slots.total_bytes // shape.expert_bytes
    layers = sorted(inputs.layers)
    caps = core_caps(layers, tail, shape.num_experts)
    limit = tail_core_limit(total, len(layers), tail)
    for i, experts in sorted(supers.items()):  # none with --no-super-experts
        if len(experts) > caps[i]:
            notes.append(
                f"cache tail: layer {i}'s {len(experts)} super experts stay in its core, over its cap "
                f"of {caps[i]}: that layer's slots hold fewer than {tail} beside its core"
            )
            caps[i] = len(experts)
    n_super = sum(len(v) for v in supers.values())
    if n_super > limit:  # limit >= 0 (tail_core_limit): no note without super experts
        notes.append(
            f"cache tail: the {n_super} super experts stay in the core, over the limit of {limit}: "
            f"the pinned form's tail is below {tail} per layer"
        )
        limit = n_super
    record = {
        "setting": config.cache_tail,
        "tailSlotsPerLayer": tail,
        "topK": shape.top_k,
        "rule": "core <= budgetSlots - layers x tailSlotsPerLayer (the pinned form's tail, (pool - core) // "
        "layers, is then >= tailSlotsPerLayer); each layer's core <= its experts - tailSlotsPerLayer; "
        "the greedy core order within those",
        "budgetSlots": total,
        "coreLimit": limit,
        "coreCap": {f"layer_{i}": caps[i] for i in layers},
        "coreSlotsBeforeCap": slots.core,
    }
    if total < len(layers) * tail:
        notes.append(
            f"cache tail: the budget's {total} slots are fewer than {len(layers)} layers x {tail}: the core "
            f"is empty and the pinned form's tail is the whole budget, {total // max(len(layers), 1)} per layer"
        )
    capped = cap_core(
        slots, min(slots.core, limit, sum(caps.values())), shape.expert_bytes, len(layers), config
    )
    return caps, capped, record


def finish_tail_record(
    record: dict[str, Any], work: Mapping[int, LayerWork], slots: Slots, pe: int, notes: list[str]
) -> None:
    """The cacheTail record's outcome: the core kept, the tail the pinned form would get."""
    used = sum(len(w.core) for w in work.values())
    n = max(len(work), 1)
    record["coreSlots"] = used
    record["pinnedFormTailPerLayer"] = (slots.total_bytes // pe - used) // n
    before = record["coreSlotsBeforeCap"]
    notes.append(
        f"cache tail {record['tailSlotsPerLayer']} per layer (--cache-tail {record['setting']}, top_k "
        f"{record['topK']}): core {before} -> {used} experts"
        + (f", {before - used} core slots to the specialists" if used < before else " (no cap bound)")
        + f"; the pinned cache form's tail: {record['pinnedFormTailPerLayer']} slots per layer"
    )


__all__ = ["finish_tail_record", "tail_caps"]
