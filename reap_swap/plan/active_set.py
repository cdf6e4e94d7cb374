"""Active sets: what a request asks to have resident, checked against the plan.

A client names, per layer, expert ids and/or sliceIds of the plan. The server must refuse anything
the plan does not offer (an id outside core ∪ slices would be a weight that is not even staged),
expand slices, add the always-resident core, check the byte budget, and then move only the
difference from what is resident now. The signature is a short, order-independent fingerprint of
the resulting resident sets, so "same set again" is recognised as a no-op.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from reap_swap.plan.bare import NO_PLAN_HINT
from reap_swap.plan.bounded_map import DEFAULT_MAX_ENTRIES, LRUDict
from reap_swap.plan.model import Plan, canonical_json, format_ranges

ResidentSets = dict[
    int, frozenset[int]
]  # the resident set: experts in HBM per plan layer (glossary: docs/architecture.md)
_LAYER = re.compile(r"^(?:layer_)?([0-9]+)$")


class SwapRequest(BaseModel):
    """Body of POST /swap_active_set and /warm_active_set. Strict types: 3.0 or true is not an id."""

    model_config = ConfigDict(extra="forbid")

    request_id: StrictStr = Field(min_length=1)
    phase: Literal["prefill", "decode_refresh"] = "prefill"
    active_set: dict[StrictStr, list[StrictInt | StrictStr]]
    budget_bytes: StrictInt | None = Field(default=None, ge=0)
    reset_router_stats: StrictBool = False
    warm_start_only: StrictBool = False


class ActiveSetError(ValueError):
    """A request the plan cannot serve; ``field`` is the JSON path of the offender."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class BudgetExceeded(ActiveSetError):
    error_type = "budget_exceeded"  # the HTTP error's type (routes.py)

    def __init__(self, field: str, needed_bytes: int, budget_bytes: int):
        self.needed_bytes = needed_bytes
        self.budget_bytes = budget_bytes
        self.overflow_bytes = needed_bytes - budget_bytes
        super().__init__(
            field,
            f"resident set needs {needed_bytes:,} bytes, budget is {budget_bytes:,} "
            f"bytes: {self.overflow_bytes:,} bytes over",
        )

    def numbers(self) -> dict[str, int]:
        return {
            "needed_bytes": self.needed_bytes,
            "budget_bytes": self.budget_bytes,
            "overflow_bytes": self.overflow_bytes,
        }


class RefreshLimitExceeded(ValueError):
    def __init__(self, request_id: str, limit: int):
        super().__init__(f"request {request_id!r} already used its {limit} decode refresh(es)")
        self.request_id = request_id
        self.limit = limit


def layer_index(plan: Plan, key: str) -> int:
    """'layer_3' or '3' -> 3, if the plan has that layer."""
    match = _LAYER.match(key)
    if match is None or int(match.group(1)) not in plan.layers:
        raise ActiveSetError(
            f"active_set.{key}",
            f"unknown layer {key!r}; the plan has layers "
            f"{format_ranges(plan.layers)} (keys 'layer_N' or 'N')",
        )
    return int(match.group(1))


def normalize_active_set(
    plan: Plan, active_set: Mapping[str, Sequence[int | str]]
) -> dict[int, frozenset[int]]:
    """Requested experts per mentioned layer, slice ids expanded.

    A layer given both as 'layer_3' and '3' gets the union of both lists.
    """
    requested: dict[int, set[int]] = {}
    for key, items in active_set.items():
        index = layer_index(plan, str(key))
        layer = plan.layers[index]
        chosen = requested.setdefault(index, set())
        for i, item in enumerate(items):
            where = f"active_set.{key}[{i}]"
            if isinstance(item, str):
                if plan.bare:
                    raise ActiveSetError(where, f"sliceId {item!r}: slices come from a plan; {NO_PLAN_HINT}")
                if item not in layer.slice_by_id:
                    raise ActiveSetError(where, f"unknown sliceId {item!r} in layer {index}")
                chosen.update(layer.slice_by_id[item].experts)
            elif isinstance(item, int) and not isinstance(item, bool):
                if item not in layer.candidates:
                    raise ActiveSetError(
                        where,
                        f"expert {item} of layer {index} is in neither the core nor any slice of the plan",
                    )
                chosen.add(item)
            else:
                raise ActiveSetError(
                    where, f"expected an expert id (int) or sliceId (str), got {type(item).__name__}"
                )
    return {index: frozenset(ids) for index, ids in requested.items()}


def resident_sets(plan: Plan, requested: Mapping[int, frozenset[int]]) -> ResidentSets:
    """Dense: every plan layer, its core plus whatever was requested there."""
    return {index: layer.core | requested.get(index, frozenset()) for index, layer in plan.layers.items()}


def pin_within(
    plan: Plan, resident: ResidentSets, capacity: Mapping[int, int]
) -> tuple[ResidentSets, dict[int, list[int]]]:
    """Cut each layer's set to what that layer can pin (``capacity``: layer -> slots; a layer not
    named is not cut), keeping the plan's rank: the core first, then the plan's fill order (best
    first). Returns (the pinned sets, layer -> the experts left to the cache, ascending). A swap
    wider than a layer's slots is therefore served, not refused: the cache keeps adapting around
    the pins, and the client learns what was not pinned."""
    if not capacity or not any(len(v) > capacity.get(l, len(v)) for l, v in resident.items()):
        return resident, {}
    rank: dict[tuple[int, int], int] = {}
    for i, (layer, e) in enumerate(plan.fill_order()[0]):
        rank.setdefault((layer, e), i)
    out: dict[int, frozenset[int]] = {}
    left: dict[int, list[int]] = {}
    for layer, experts in resident.items():
        cap = capacity.get(layer)
        if cap is None or len(experts) <= cap:
            out[layer] = experts
            continue
        core = plan.layers[layer].core if layer in plan.layers else frozenset()
        order = sorted(experts, key=lambda e: (e not in core, rank.get((layer, e), len(rank)), e))
        out[layer] = frozenset(order[: max(cap, 0)])
        left[layer] = sorted(order[max(cap, 0) :])
    return out, left


def resident_bytes(plan: Plan, resident: ResidentSets) -> int:
    return sum(len(ids) for ids in resident.values()) * plan.per_expert_bytes


def check_budget(
    plan: Plan, resident: ResidentSets, budget_bytes: int | None, pool_slots: int | None = None
) -> int:
    """Returns the budget applied (the request's, else the pool's); raises BudgetExceeded.

    The pool is the plan's budget, or with `pool_slots` (--reap-budget auto | GiB: the HBM pool the
    workers have, pool_fill.py) that many experts. A request may lower the budget, never raise it
    above the pool: more could not be made resident.
    """
    if pool_slots is None:
        cap, what = plan.swappable_budget_bytes, "the plan's budget of"
    else:
        cap, what = pool_slots * plan.per_expert_bytes, f"the HBM pool of {pool_slots} expert slots,"
    if budget_bytes is not None and budget_bytes > cap:
        raise ActiveSetError(
            "budget_bytes", f"{budget_bytes:,} bytes is above {what} {cap:,} bytes (the HBM pool's size)"
        )
    budget = cap if budget_bytes is None else budget_bytes
    needed = resident_bytes(plan, resident)
    if needed > budget:
        raise BudgetExceeded("budget_bytes" if budget_bytes is not None else "active_set", needed, budget)
    return budget


def signature(resident: ResidentSets) -> str:
    """16 hex chars of SHA-256 over [[layer, sorted ids], ...] sorted by layer."""
    canonical = [[int(layer), sorted(ids)] for layer, ids in sorted(resident.items())]
    return hashlib.sha256(canonical_json(canonical)).hexdigest()[:16]


@dataclass(frozen=True)
class LayerDelta:
    added: tuple[int, ...]
    removed: tuple[int, ...]
    reused: tuple[int, ...]


def delta(old: ResidentSets, new: ResidentSets) -> dict[int, LayerDelta]:
    """Per layer (union of both), what a swap must copy in, may evict, and keeps."""
    out = {}
    for layer in sorted(set(old) | set(new)):
        before, after = old.get(layer, frozenset()), new.get(layer, frozenset())
        out[layer] = LayerDelta(
            added=tuple(sorted(after - before)),
            removed=tuple(sorted(before - after)),
            reused=tuple(sorted(before & after)),
        )
    return out


def delta_summary(d: Mapping[int, LayerDelta]) -> dict:
    """JSON-able counts per layer (keys as strings) and totals."""
    layers = {
        str(layer): {"added": len(x.added), "removed": len(x.removed), "reused": len(x.reused)}
        for layer, x in sorted(d.items())
    }
    totals = {name: sum(row[name] for row in layers.values()) for name in ("added", "removed", "reused")}
    return {
        "layers": layers,
        "totals": totals,
        "changed_layers": sum(1 for x in d.values() if x.added or x.removed),
    }


class RefreshLedger:
    """Decode-time refreshes per request, bounded by the plan's max_refreshes_per_request.

    A prefill swap (re)opens the request with zero refreshes; each decode_refresh counts, and
    the one that would exceed the limit is refused without being counted.
    """

    def __init__(self, limit: int, max_entries: int = DEFAULT_MAX_ENTRIES):
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        self.limit = limit
        self._counts: LRUDict[str, int] = LRUDict(max_entries)

    def record(self, request_id: str, phase: str) -> int:
        """Count one swap of ``phase``; returns the request's refresh count after it."""
        if phase == "prefill":
            self._counts[request_id] = 0
            return 0
        if phase != "decode_refresh":
            raise ValueError(f"unknown phase {phase!r}")
        used = self._counts.get(request_id, 0)
        if used + 1 > self.limit:
            raise RefreshLimitExceeded(request_id, self.limit)
        self._counts[request_id] = used + 1
        return used + 1

    def count(self, request_id: str) -> int:
        return self._counts.get(request_id, 0)

    def __len__(self) -> int:
        return len(self._counts)
