"""A swap keeps the HBM pool full (`--reap-budget auto | GiB`).

Why: with `auto` the pool grows after startup and is filled with the core plus the best prefix of
the plan's fill order (engine/residency/budget.py). A swap that made exactly core ∪ active set resident
would evict that prefix again. So the controller resolves a swap to

    resident = core ∪ active set ∪ the longest prefix of the plan's fill order that fits the pool,

where the pool is the one the workers actually have (`pool_slots` / `layers_rehomed` in their
status; tensor-parallel ranks have identical pools) or, without a device pool (accounting
residency, the CPU build), the plan's budget over every plan layer; and it accepts an active set
up to that pool rather than the plan's budget. With `--reap-budget plan` nothing here applies: a
swap makes exactly core ∪ active set resident, as before.

Pure (no torch, no vLLM); the fill itself is memory_split.ranked_fill, the same function the
startup fill uses, so core + nothing requested resolves to what startup filled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from reap_swap.plan.active_set import (
    ResidentSets,
    check_budget,
    normalize_active_set,
    pin_within,
    resident_bytes,
    resident_sets,
)
from reap_swap.plan.model import Plan
from reap_swap.sizing.cache_tail import plan_pool_slots
from reap_swap.sizing.memory_split import ranked_fill


@dataclass(frozen=True)
class Pool:
    """`slots` expert slots shared by the pooled `layers`; `source` says where the size came from."""

    slots: int
    layers: frozenset[int]
    source: str

    def nbytes(self, plan: Plan) -> int:
        return self.slots * plan.per_expert_bytes


def plan_pool(plan: Plan) -> Pool:
    """The pool of accounting residency: the plan's budget over every plan layer."""
    slots = plan_pool_slots(plan)
    return Pool(slots, frozenset(plan.layers), "the plan's budget (no HBM pool on the workers)")


def pool_from_workers(plan: Plan, backends: Sequence[Mapping]) -> Pool:
    """The pool the workers report (their status' `backend`), else `plan_pool`. Raises ValueError
    when ranks report different pools (TP ranks must hold identical resident sets)."""
    sizes = [b.get("pool_slots") for b in backends]
    if not backends or any(s is None for s in sizes):
        return plan_pool(plan)
    rehomed = [tuple(sorted(int(x) for x in b.get("layers_rehomed", plan.layers))) for b in backends]
    if len(set(sizes)) > 1 or len(set(rehomed)) > 1:
        raise ValueError(f"workers report different HBM pools: slots {sizes}, pooled layers {rehomed}")
    layers = frozenset(set(plan.layers) & set(rehomed[0]))
    return Pool(int(sizes[0]), layers, f"the workers' HBM pool ({len(backends)} rank(s))")


def fill_pool(
    resident: ResidentSets, order: Sequence[tuple[int, int]], pool: Pool, slots: int | None = None
) -> tuple[ResidentSets, int]:
    """(`resident` plus the first experts of `order` that fit `slots` (default: the pool) on the
    pooled layers, how many were added). Layers outside the pool are left as they are."""
    limit = pool.slots if slots is None else min(pool.slots, slots)
    filled = ranked_fill(order, resident, limit, pool.layers)
    out = {layer: filled.get(layer, ids) for layer, ids in resident.items()}
    return out, sum(len(out[layer]) - len(ids) for layer, ids in resident.items())


def resolve_swap(
    plan: Plan,
    active_set: Mapping[str, list],
    budget_bytes: int | None,
    pool: Pool | None,
    order: Sequence[tuple[int, int]] = (),
    capacity: Mapping[int, int] | None = None,
) -> tuple[ResidentSets, int, dict]:
    """(resident set, budget applied, validation details) of a swap. With `pool` (budget auto |
    GiB) the active set may use the whole pool and the rest of the pool is filled from `order`;
    without it, exactly core ∪ active set under the plan's budget. `capacity` (layer -> what the
    workers can pin there: the device cache's slots) cuts a wider layer by the plan's rank
    (active_set.pin_within) before the budget is checked; details["unpinned"] lists the cut.
    Raises ActiveSetError."""
    requested = normalize_active_set(plan, active_set)
    resident, unpinned = pin_within(plan, resident_sets(plan, requested), capacity or {})
    budget = check_budget(plan, resident, budget_bytes, None if pool is None else pool.slots)
    details = {
        "requested_layers": sorted(requested),
        "requested_experts": sum(len(v) for v in requested.values()),
        "budget_bytes": budget,
        "budget_source": "request" if budget_bytes is not None else ("plan" if pool is None else "pool"),
    }
    if pool is not None:
        resident, added = fill_pool(resident, order, pool, plan_pool_slots(plan, budget))
        details.update(pool_slots=pool.slots, pool_source=pool.source, fill_experts=added)
    if unpinned:
        details["unpinned"] = {plan.layers[l].key: v for l, v in sorted(unpinned.items())}
    details.update(
        resident_experts=sum(len(v) for v in resident.values()),
        resident_bytes=resident_bytes(plan, resident),
    )
    return resident, budget, details
