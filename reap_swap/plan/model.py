"""The plan's data model: Plan, LayerPlan, Slice, built once from a valid document; its identity bytes.

Pure and free of validation, so the modules that work on plans (active_set, selection, ...)
import it without importing the validator (which checks cartridges through active_set).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import orjson

MODE = "dynamic_core_specialist"


@dataclass(frozen=True)
class Slice:
    slice_id: str
    experts: tuple[int, ...]
    byte_cost: int
    activation_mass: float
    task_priors: Mapping[str, float]


@dataclass(frozen=True)
class LayerPlan:
    index: int
    key: str
    num_experts: int
    core: frozenset[int]
    slices: tuple[Slice, ...]
    slice_by_id: Mapping[str, Slice]
    # core | every slice's experts (a bare plan: every expert): what a request may name
    candidates: frozenset[int]


@dataclass(frozen=True)
class Plan:
    document: Mapping[str, Any]  # deep read-only view of the JSON
    identity: str  # sha256 hex of canonical_json(document)
    mode: str
    model: str
    layers: Mapping[int, LayerPlan]  # sorted by index
    per_expert_bytes: int
    swappable_budget_bytes: int
    max_refreshes_per_request: int
    cartridges: Mapping[str, Mapping[str, tuple[int | str, ...]]] = field(
        default_factory=lambda: MappingProxyType({})
    )  # named active sets
    group_size: int = 1  # groupSize: the grouped engine's b the plan was made for (absent: 1)
    bare: bool = False  # made by the server for a launch without a plan (plan/bare.py)

    def core_sets(self) -> dict[int, frozenset[int]]:
        return {index: layer.core for index, layer in self.layers.items()}

    def core_bytes(self) -> int:
        return sum(len(layer.core) for layer in self.layers.values()) * self.per_expert_bytes

    def fill_order(self) -> tuple[list[tuple[int, int]], str]:
        """(experts beyond the core, best first; where the order came from): the plan's `fillOrder`
        (entries outside the plan's layers, ids or core dropped), followed by the fallback order for
        whatever it does not rank, so every expert has a place."""
        from reap_swap.sizing.memory_split import fallback_fill_order

        fallback = fallback_fill_order(
            self.core_sets(),
            {i: [e for s in layer.slices for e in s.experts] for i, layer in self.layers.items()},
            {i: layer.num_experts for i, layer in self.layers.items()},
        )
        raw = self.document.get("fillOrder")
        if not raw:
            return fallback, "fallback: round-robin over layers, slice experts first, then by id"
        seen: set[tuple[int, int]] = set()
        ranked = []
        for layer, e in ((int(a), int(b)) for a, b in raw):
            lp = self.layers.get(layer)
            if lp is None or not 0 <= e < lp.num_experts or e in lp.core or (layer, e) in seen:
                continue
            seen.add((layer, e))
            ranked.append((layer, e))
        return ranked + [x for x in fallback if x not in seen], "plan fillOrder"


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, no whitespace: the bytes whose SHA-256 is a plan's identity."""
    return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS, default=_plain)


def _plain(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return dict(obj)
    if isinstance(obj, (frozenset, set)):
        return sorted(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON-serialisable")


def _freeze(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return MappingProxyType({k: _freeze(v) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)):
        return tuple(_freeze(v) for v in obj)
    return obj


def as_int(value: Any) -> int | None:
    """The value if it is a JSON integer (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def swappable_budget(budget: Mapping, core_bytes: int, candidate_bytes: int) -> int:
    """The byte budget for resident experts: declared, else core + specialist, else everything
    the plan offers (a minimal plan without a budget constrains nothing beyond its candidates)."""
    declared = as_int(budget.get("swappable_expert_budget_bytes"))
    if declared is not None:
        return declared
    core, specialist = as_int(budget.get("core_budget_bytes")), as_int(budget.get("specialist_budget_bytes"))
    if core is not None and specialist is not None:
        return core + specialist
    return max(core_bytes, candidate_bytes)


def format_ranges(values: Iterable[int]) -> str:
    """[0, 1, 2, 5] -> '0..2, 5': compact, for messages."""
    values = sorted(values)
    parts, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            parts.append(f"{start}" if start == v else f"{start}..{v}")
            start = None
    return ", ".join(parts) or "none"


def plan_from_document(doc: Mapping, identity: str) -> Plan:
    """The immutable Plan of a document that passed validation (keys and types are not rechecked)."""
    budget = doc["budget"]
    pe = budget["per_expert_bytes"]
    layers = {}
    for key, raw in sorted(doc["perLayer"].items(), key=lambda kv: int(kv[0].removeprefix("layer_"))):
        slices = tuple(
            Slice(
                slice_id=s["sliceId"],
                experts=tuple(s["experts"]),
                byte_cost=s.get("byteCost", len(set(s["experts"])) * pe),
                activation_mass=float(s.get("activationMass", 0.0)),
                task_priors=MappingProxyType({k: float(v) for k, v in s.get("taskPriors", {}).items()}),
            )
            for s in raw.get("sliceCatalog", ())
        )
        core = frozenset(raw["coreExperts"])
        index = int(key.removeprefix("layer_"))
        # a bare plan names no candidates: every expert may be requested by id
        candidates = (
            frozenset(range(raw["numExperts"]))
            if doc.get("bare")
            else core.union(*(s.experts for s in slices))
        )
        layers[index] = LayerPlan(
            index=index,
            key=key,
            num_experts=raw["numExperts"],
            core=core,
            slices=slices,
            slice_by_id=MappingProxyType({s.slice_id: s for s in slices}),
            candidates=candidates,
        )
    core_bytes = sum(len(layer.core) for layer in layers.values()) * pe
    candidate_bytes = sum(len(layer.candidates) for layer in layers.values()) * pe
    return Plan(
        document=_freeze(doc),
        identity=identity,
        mode=doc["mode"],
        model=doc.get("model", ""),
        layers=MappingProxyType(layers),
        per_expert_bytes=pe,
        swappable_budget_bytes=swappable_budget(budget, core_bytes, candidate_bytes),
        max_refreshes_per_request=budget.get("max_refreshes_per_request", 1),
        cartridges=_freeze(doc.get("cartridges", {})),
        group_size=int(doc.get("groupSize", 1)),
        bare=bool(doc.get("bare", False)),
    )
