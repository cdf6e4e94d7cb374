"""Which slices a request gets: the plan's core plus slices chosen per prompt, within the budget.

Pure (no torch, no vLLM, no HTTP): the client feeds it prompts and the server's miss counters.

Every strategy ends in the same greedy fill: each (layer, slice) has a value; slices are taken in
order of value per *marginal* byte (experts already resident cost nothing) while the resident set
still fits the budget, across all layers at once, because one byte spent on a flat layer buys
less than one spent on a peaked one. A slice worth nothing is never taken. Ties are broken by
(layer, catalog position), so equal inputs give equal selections. The result is checked with the
server's own functions (active_set.normalize_active_set / resident_sets / check_budget), so "fits
here" means "the server accepts it".

Strategies (client/strategies.py names them and dispatches on the name):
- ``static``: the core only (no slices); the baseline every other choice is measured against.
- ``prior``: prompt features, a keyword classifier's task family and the prompt's length, weigh
  the plan's per-slice ``taskPriors`` (or, for plans that only rank slices per family, the
  ``scorerArtifacts`` lists ``taskFamilySlicePriors`` / ``promptClusterPriors``) against the
  ``global`` prior; a short or ambiguous prompt leans on the global prior.
- ``probe``: from the router misses of a prefill-only pass (``max_tokens=1``) run with only the
  core resident, slices ranked by the missed mass they would have covered per byte; budget left
  after every slice with a miss goes by the prior.
- decode refresh (:func:`refresh`): re-select from the running request's misses, at most
  ``max_refreshes_per_request`` times.

Router-miss payloads give each layer's ``inactive_experts`` and per-expert ``expert_counts``;
the values are shares of the layer's routed selections (see :func:`missed_mass`).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from reap_swap.client.prompt_features import (
    PromptFeatures,
    classify,
    plan_families,
    prompt_features,
    prompt_text,
)
from reap_swap.client.slice_values import (
    MissedMass,
    miss_then_prior_value,
    missed_mass,
    prior_value,
    routed_share,
    slice_priors,
)
from reap_swap.plan.active_set import (
    ResidentSets,
    SwapRequest,
    check_budget,
    normalize_active_set,
    resident_bytes,
    resident_sets,
    signature,
)
from reap_swap.plan.document import Plan


class SelectionError(ValueError):
    """A selection that cannot be made (e.g. the budget does not even hold the core)."""


# ----------------------------------------------------------------------------- the greedy fill


@dataclass(frozen=True)
class Selection:
    """Core ∪ chosen slices: the payload for /swap_active_set and what it will cost."""

    strategy: str
    phase: Literal["prefill", "decode_refresh"]
    slices: Mapping[int, tuple[str, ...]]  # layer -> chosen sliceIds, in the order taken
    resident: ResidentSets  # what will be resident: core | chosen, every plan layer
    resident_bytes: int
    budget_bytes: int  # the budget the selection was made for
    request_budget_bytes: int | None  # what goes into the payload's budget_bytes (None: the plan's)
    signature: str  # active_set.signature(resident): what the server will report
    values: Mapping[str, float] = field(default_factory=dict)  # sliceId -> value it was taken for
    features: PromptFeatures | None = None
    # layer -> experts the server can pin there (/reap/status cache.pin_capacity), None: no limit
    capacity: Mapping[int, int] | None = None

    @property
    def slice_count(self) -> int:
        return sum(len(v) for v in self.slices.values())

    def active_set(self) -> dict[str, list[str]]:
        """{"layer_N": [sliceIds]} for the layers with chosen slices (the core is implied)."""
        return {f"layer_{layer}": list(ids) for layer, ids in sorted(self.slices.items()) if ids}

    def payload(self, request_id: str, *, phase: str | None = None, reset_router_stats: bool = False) -> dict:
        """A SwapRequest body (validated here, so a bad one fails before it reaches the server)."""
        body: dict[str, Any] = {
            "request_id": request_id,
            "phase": phase or self.phase,
            "active_set": self.active_set(),
        }
        if self.request_budget_bytes is not None:  # as applied: never above the plan's (the pool)
            body["budget_bytes"] = self.budget_bytes
        if reset_router_stats:
            body["reset_router_stats"] = True
        SwapRequest.model_validate(body)
        return body

    def to_dict(self) -> dict:
        return {
            "strategy": self.strategy,
            "phase": self.phase,
            "signature": self.signature,
            "slices": {f"layer_{k}": list(v) for k, v in sorted(self.slices.items()) if v},
            "slice_count": self.slice_count,
            "resident_experts": sum(len(v) for v in self.resident.values()),
            "resident_bytes": self.resident_bytes,
            "budget_bytes": self.budget_bytes,
            "values": {k: round(v, 8) for k, v in self.values.items()},
            "features": self.features.to_dict() if self.features else None,
        }


def effective_budget(plan: Plan, budget_bytes: int | None) -> int:
    """The request's budget, never above the plan's; must hold the core."""
    budget = (
        plan.swappable_budget_bytes
        if budget_bytes is None
        else min(int(budget_bytes), plan.swappable_budget_bytes)
    )
    if budget < plan.core_bytes():
        raise SelectionError(
            f"budget {budget:,} bytes does not hold the plan's core ({plan.core_bytes():,} bytes)"
        )
    return budget


Value = tuple[float, ...]  # compared lexicographically, per marginal byte


def _greedy(
    plan: Plan, budget: int, value: Any, capacity: Mapping[int, int] | None = None
) -> tuple[dict[int, list[str]], dict[str, float]]:
    """Take slices by value per marginal byte while they fit the budget and the layer's capacity
    (the experts the server can pin there; the budget left goes to other layers' slices).
    ``value(layer, i, new_experts)`` -> a tuple (all zero: worthless). Lazy heap: a popped slice
    whose marginal cost or value changed since it was pushed (an overlapping slice was taken) is
    re-scored and pushed again."""
    caps = capacity or {}
    pe = plan.per_expert_bytes
    resident = {index: set(layer.core) for index, layer in plan.layers.items()}
    used = resident_bytes(plan, resident)
    chosen: dict[int, list[str]] = {}
    values: dict[str, float] = {}
    heap: list = []

    def score(index: int, i: int) -> tuple[Value, int, frozenset[int]]:
        new = frozenset(plan.layers[index].slices[i].experts) - resident[index]
        if not new:
            return (), 0, new
        v = tuple(value(index, i, new))
        return v, len(new) * pe, new

    def push(index: int, i: int) -> None:
        """Score slice i of the layer now and queue it if it is worth anything."""
        v, cost, _ = score(index, i)
        if cost and any(x > 0 for x in v):
            heapq.heappush(heap, (tuple(-x / cost for x in v), index, i, v, cost))

    for index, layer in plan.layers.items():
        for i in range(len(layer.slices)):
            push(index, i)
    deferred: list[tuple[int, int]] = []
    while heap:
        _key, index, i, v, cost = heapq.heappop(heap)
        v2, cost2, new = score(index, i)
        if not cost2 or not any(x > 0 for x in v2):
            continue
        if (v2, cost2) != (v, cost):
            push(index, i)
            continue
        if used + cost > budget or len(resident[index]) + len(new) > caps.get(
            index, len(plan.layers[index].candidates)
        ):
            deferred.append((index, i))  # may fit later if an overlapping slice makes it cheaper
            continue
        resident[index] |= new
        used += cost
        sid = plan.layers[index].slices[i].slice_id
        chosen.setdefault(index, []).append(sid)
        values[sid] = v[0]
        for dl, di in [d for d in deferred if d[0] == index]:
            deferred.remove((dl, di))
            push(dl, di)
    return chosen, values


def _finish(
    plan: Plan,
    strategy: str,
    phase: str,
    chosen: Mapping[int, Sequence[str]],
    budget: int,
    request_budget: int | None,
    values: Mapping[str, float],
    features: PromptFeatures | None,
    capacity: Mapping[int, int] | None = None,
) -> Selection:
    """Build the resident set exactly as the server will and check it against the budget."""
    slices = {index: tuple(ids) for index, ids in sorted(chosen.items()) if ids}
    requested = normalize_active_set(plan, {f"layer_{k}": list(v) for k, v in slices.items()})
    resident = resident_sets(plan, requested)
    check_budget(plan, resident, budget)
    return Selection(
        strategy=strategy,
        phase=phase,
        slices=slices,
        resident=resident,
        resident_bytes=resident_bytes(plan, resident),
        budget_bytes=budget,
        request_budget_bytes=request_budget,
        signature=signature(resident),
        values=dict(values),
        features=features,
        capacity=dict(capacity) if capacity else None,
    )


def select_static(plan: Plan, budget_bytes: int | None = None) -> Selection:
    budget = effective_budget(plan, budget_bytes)
    return _finish(plan, "static", "prefill", {}, budget, budget_bytes, {}, None)


def select_prior(
    plan: Plan,
    prompt: str | Sequence[Mapping[str, Any]],
    budget_bytes: int | None = None,
    capacity: Mapping[int, int] | None = None,
) -> Selection:
    budget = effective_budget(plan, budget_bytes)
    features = prompt_features(plan, prompt)
    value = prior_value(slice_priors(plan, features.weights), plan)
    chosen, values = _greedy(plan, budget, value, capacity)
    return _finish(plan, "prior", "prefill", chosen, budget, budget_bytes, values, features, capacity)


def select_probe(
    plan: Plan,
    misses: MissedMass,
    prompt: str | Sequence[Mapping[str, Any]] = "",
    budget_bytes: int | None = None,
    capacity: Mapping[int, int] | None = None,
) -> Selection:
    """``misses``: :func:`missed_mass` of a prefill-only pass run with only the core resident."""
    budget = effective_budget(plan, budget_bytes)
    features = prompt_features(plan, prompt)
    value = miss_then_prior_value(plan, misses, slice_priors(plan, features.weights))
    chosen, values = _greedy(plan, budget, value, capacity)
    return _finish(plan, "probe", "prefill", chosen, budget, budget_bytes, values, features, capacity)


def refresh(
    plan: Plan,
    current: Selection,
    misses: MissedMass,
    refresh_count: int,
    prompt: str | Sequence[Mapping[str, Any]] = "",
    routed: MissedMass | None = None,
) -> Selection | None:
    """Decode-time re-selection from what the running request has routed so far.

    With ``routed`` (:func:`routed_share`: every expert's share, resident or not) slices are
    valued by the request's own demand, the prior breaking ties. With only ``misses`` (measured
    against ``current``), the slices resident now showed no misses however much they were used, so
    they are valued at their prior and stay unless measured misses outweigh it. None when the
    request already used ``max_refreshes_per_request`` refreshes or nothing would change.
    """
    if refresh_count >= plan.max_refreshes_per_request:
        return None
    budget = current.budget_bytes
    features = current.features or prompt_features(plan, prompt)
    priors = slice_priors(plan, features.weights)
    if routed is not None:
        value = miss_then_prior_value(plan, routed, priors)
    else:
        chosen_now = {
            index: frozenset(ids) - plan.layers[index].core for index, ids in current.resident.items()
        }
        value = miss_then_prior_value(plan, misses, priors, chosen_now)
    chosen, values = _greedy(plan, budget, value, current.capacity)
    new = _finish(
        plan,
        current.strategy,
        "decode_refresh",
        chosen,
        budget,
        current.request_budget_bytes,
        values,
        features,
        current.capacity,
    )
    return None if new.signature == current.signature else new


def core_probe_payload(request_id: str) -> dict:
    """The swap that leaves only the core resident, for the probe pass."""
    body = {"request_id": request_id, "active_set": {}}
    SwapRequest.model_validate(body)
    return body


__all__ = [
    "MissedMass",
    "PromptFeatures",
    "Selection",
    "SelectionError",
    "classify",
    "core_probe_payload",
    "effective_budget",
    "missed_mass",
    "plan_families",
    "prompt_features",
    "prompt_text",
    "refresh",
    "routed_share",
    "select_prior",
    "select_probe",
    "select_static",
    "slice_priors",
]
