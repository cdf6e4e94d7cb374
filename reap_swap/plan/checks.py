"""The semantic pass of plan validation: what a JSON Schema cannot express.

Ids within ``numExperts``, duplicates, slice id uniqueness, byte costs, the budget, the summary,
the cartridges and, given a model's config, the model's shape. Defensive about types (the
schema pass reports those); every problem carries the JSON path of the offender.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from reap_swap.plan import active_set
from reap_swap.plan.model import Plan, as_int, format_ranges, swappable_budget
from reap_swap.plan.report import PlanIssue
from reap_swap.sizing.contiguous_groups import plan_contiguous_groups
from reap_swap.sizing.groups import plan_groups
from reap_swap.sizing.model_shape import ModelShape

LAYER_KEY = re.compile(r"^layer_(0|[1-9][0-9]*)$")


def _ints(value: Any) -> list[int]:
    """The ints in a list (the schema pass reports anything else)."""
    if not isinstance(value, list | tuple):
        return []
    return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]


def _check_ids(path: str, ids: Any, num_experts: int | None, errors: list[PlanIssue]) -> None:
    seen: set[int] = set()
    if not isinstance(ids, list | tuple):
        return
    for i, expert in enumerate(ids):
        if as_int(expert) is None:
            continue
        if num_experts is not None and not 0 <= expert < num_experts:
            errors.append(
                PlanIssue(
                    f"{path}[{i}]",
                    f"{expert} is not < numExperts {num_experts}" if expert >= 0 else f"{expert} is negative",
                )
            )
        if expert in seen:
            errors.append(PlanIssue(f"{path}[{i}]", f"duplicate expert id {expert}"))
        seen.add(expert)


def _raw_layer_index(raw: str) -> int | None:
    numbers = re.findall(r"\d+", raw)
    return int(numbers[-1]) if numbers else None


@dataclass
class _Tally:
    """What the semantic pass has counted and found so far, over all layers."""

    errors: list[PlanIssue] = field(default_factory=list)
    warnings: list[PlanIssue] = field(default_factory=list)
    total_core: int = 0
    total_slices: int = 0
    covered: int = 0
    total_experts: int = 0
    candidate_experts: int = 0
    experts_per_layer: set[int] = field(default_factory=set)
    layer_indices: list[int] = field(default_factory=list)


def semantic_issues(
    doc: Mapping, shape: ModelShape | None, summary: dict, schema_clean: bool
) -> tuple[list[PlanIssue], list[PlanIssue]]:
    """(errors, warnings) of the semantic pass; fills ``summary`` as it goes."""
    t = _Tally()
    budget = doc.get("budget") if isinstance(doc.get("budget"), Mapping) else {}
    per_layer = doc.get("perLayer") if isinstance(doc.get("perLayer"), Mapping) else {}
    pe = as_int(budget.get("per_expert_bytes"))
    for key, layer in per_layer.items():
        match = LAYER_KEY.match(key)
        if match and isinstance(layer, Mapping):
            _layer_issues(key, int(match.group(1)), layer, pe, shape, t)
    core_bytes = t.total_core * pe if pe else 0
    swappable = swappable_budget(budget, core_bytes, t.candidate_experts * (pe or 0))
    _budget_issues(budget, pe, core_bytes, t)
    if shape is not None:
        _model_issues(shape, pe, t)
    _summary_issues(doc, schema_clean, t)
    group_issues(doc, shape, t.errors, t.warnings)
    summary.update(
        model=doc.get("model") if isinstance(doc.get("model"), str) else None,
        layers=len(t.layer_indices),
        layer_indices=format_ranges(sorted(t.layer_indices)),
        experts_per_layer=(
            next(iter(t.experts_per_layer)) if len(t.experts_per_layer) == 1 else sorted(t.experts_per_layer)
        ),
        core_experts=t.total_core,
        slices=t.total_slices,
        per_expert_bytes=pe,
        core_bytes=core_bytes,
        candidate_bytes=t.candidate_experts * (pe or 0),
        swappable_budget_bytes=swappable,
        covered_experts=t.covered,
        total_experts=t.total_experts,
        coverage=t.covered / t.total_experts if t.total_experts else 0.0,
    )
    return t.errors, t.warnings


def _layer_issues(
    key: str, index: int, layer: Mapping, pe: int | None, shape: ModelShape | None, t: _Tally
) -> None:
    """One perLayer entry: its raw key, core, slice catalog and (given a model) its shape."""
    t.layer_indices.append(index)
    path = f"perLayer.{key}"
    num = as_int(layer.get("numExperts"))
    if num is not None:
        t.experts_per_layer.add(num)
        t.total_experts += num
    raw = layer.get("rawLayerKey")
    if isinstance(raw, str) and _raw_layer_index(raw) != index:
        t.errors.append(
            PlanIssue(f"{path}.rawLayerKey", f"{raw!r} does not name layer {index} (key {key!r})")
        )
    core = _ints(layer.get("coreExperts"))
    _check_ids(f"{path}.coreExperts", layer.get("coreExperts"), num, t.errors)
    t.total_core += len(set(core))
    cost = as_int(layer.get("coreByteCost"))
    if pe and cost is not None and "coreExperts" in layer and cost != len(set(core)) * pe:
        t.warnings.append(
            PlanIssue(
                f"{path}.coreByteCost",
                f"{cost:,} != {len(set(core))} core experts x per_expert_bytes {pe:,} = {len(set(core)) * pe:,}",
            )
        )
    candidates = set(core) | _catalog_issues(path, layer, num, pe, t)
    t.covered += len({e for e in candidates if num is None or 0 <= e < num})
    t.candidate_experts += len(candidates)
    if shape is not None:
        if index not in shape.moe_layers:
            t.errors.append(
                PlanIssue(
                    path,
                    f"model {shape.architecture} has no MoE layer {index} "
                    f"(MoE layers: {format_ranges(shape.moe_layers)})",
                )
            )
        if num is not None and num != shape.num_experts:
            t.errors.append(
                PlanIssue(f"{path}.numExperts", f"{num} != model's {shape.num_experts} experts per layer")
            )


def _catalog_issues(path: str, layer: Mapping, num: int | None, pe: int | None, t: _Tally) -> set[int]:
    """One layer's sliceCatalog: ids, unique slice ids, byte costs; returns the slices' experts."""
    experts_seen: set[int] = set()
    slice_ids: dict[str, int] = {}
    catalog = layer.get("sliceCatalog") if isinstance(layer.get("sliceCatalog"), list) else []
    t.total_slices += len(catalog)
    for s, item in enumerate(catalog):
        if not isinstance(item, Mapping):
            continue
        spath = f"{path}.sliceCatalog[{s}]"
        experts = _ints(item.get("experts"))
        _check_ids(f"{spath}.experts", item.get("experts"), num, t.errors)
        experts_seen.update(experts)
        sid = item.get("sliceId")
        if isinstance(sid, str):
            if sid in slice_ids:
                t.errors.append(
                    PlanIssue(
                        f"{spath}.sliceId", f"duplicate sliceId {sid!r} (also sliceCatalog[{slice_ids[sid]}])"
                    )
                )
            slice_ids.setdefault(sid, s)
        cost = as_int(item.get("byteCost"))
        if pe and cost is not None and cost != len(set(experts)) * pe:
            t.warnings.append(
                PlanIssue(
                    f"{spath}.byteCost",
                    f"{cost:,} != {len(set(experts))} experts x per_expert_bytes "
                    f"{pe:,} = {len(set(experts)) * pe:,}",
                )
            )
    return experts_seen


def _budget_issues(budget: Mapping, pe: int | None, core_bytes: int, t: _Tally) -> None:
    """The core must fit every declared budget."""
    for name in ("core_budget_bytes", "swappable_expert_budget_bytes"):
        limit = as_int(budget.get(name))
        if pe and limit is not None and core_bytes > limit:
            t.errors.append(
                PlanIssue(
                    f"budget.{name}",
                    f"core experts need {core_bytes:,} bytes "
                    f"({t.total_core:,} x {pe:,}), over this budget of {limit:,} "
                    f"by {core_bytes - limit:,}",
                )
            )


def _weight_size(shape: ModelShape) -> str:
    if shape.quant.kind == "unquantized":
        return f"{shape.dtype_bytes} bytes"
    return f"{shape.quant.bits} bits, {shape.quant_method} weights as stored"


def _replan_hint(shape: ModelShape, pe: int) -> str:
    """A plan made on the bf16 sibling of a quantized checkpoint: say so (plans count experts in
    the served checkpoint's bytes; sizing/quant/budget.py)."""
    unquantized = 3 * shape.hidden_size * shape.moe_intermediate_size * shape.dtype_bytes
    if shape.quant.kind != "unquantized" and pe == unquantized:
        return (
            f"; the plan was made on the unquantized model: re-plan against this {shape.quant_method} "
            "checkpoint (reap-swap plan --model it), or serve the bf16 checkpoint with --quantization fp8"
        )
    return ""


def _model_issues(shape: ModelShape, pe: int | None, t: _Tally) -> None:
    """The plan against the model's config: expert size and the set of MoE layers."""
    if pe is not None and pe != shape.expert_bytes:
        t.errors.append(
            PlanIssue(
                "budget.per_expert_bytes",
                f"{pe:,} != model's expert size {shape.expert_bytes:,} "
                f"(3 x hidden {shape.hidden_size} x moe_intermediate "
                f"{shape.moe_intermediate_size} x {_weight_size(shape)})" + _replan_hint(shape, pe),
            )
        )
    missing = sorted(set(shape.moe_layers) - set(t.layer_indices))
    if len(t.layer_indices) != len(shape.moe_layers) or missing:
        t.errors.append(
            PlanIssue(
                "perLayer",
                f"plan has {len(t.layer_indices)} layers, model "
                f"{shape.architecture} has {len(shape.moe_layers)} MoE layers"
                + (f" (missing: {format_ranges(missing)})" if missing else ""),
            )
        )


def _summary_issues(doc: Mapping, schema_clean: bool, t: _Tally) -> None:
    """The declared summary against the counts; only on a clean schema pass (a broken layer would
    make every count disagree)."""
    declared = doc.get("summary") if schema_clean and isinstance(doc.get("summary"), Mapping) else {}
    for name, actual in (
        ("layerCount", len(t.layer_indices)),
        ("totalCoreExperts", t.total_core),
        ("totalSlices", t.total_slices),
    ):
        if name in declared and declared[name] != actual:
            t.errors.append(PlanIssue(f"summary.{name}", f"says {declared[name]!r}, plan has {actual}"))
    lo, hi = declared.get("residentFractionPctMin"), declared.get("residentFractionPctMax")
    if isinstance(lo, int | float) and isinstance(hi, int | float) and lo > hi:
        t.errors.append(PlanIssue("summary.residentFractionPctMin", f"{lo} > residentFractionPctMax {hi}"))


def group_issues(doc: Mapping, shape: ModelShape | None, errors: list, warnings: list) -> None:
    """groupSize b > 1: cores and slices in whole groups (warnings: a boundary group carries a
    passenger), the grouped budget (errors: groups x group_hbm_bytes over a budget) and, given a
    model, group_hbm_bytes against the engine's layout of its experts (error)."""
    b = as_int(doc.get("groupSize"))
    if b is None or b <= 1:
        return
    per_layer = doc.get("perLayer") if isinstance(doc.get("perLayer"), Mapping) else {}
    core_groups = specialist_groups = 0
    for key, layer in per_layer.items():
        if not isinstance(layer, Mapping):
            continue
        path = f"perLayer.{key}"
        core = set(_ints(layer.get("coreExperts")))
        core_groups += -(-len(core) // b)
        specialist_groups += -(-(as_int(layer.get("specialistActiveExpertTarget")) or 0) // b)
        num = as_int(layer.get("numExperts"))
        if num is not None and num % b:
            warnings.append(PlanIssue(f"{path}.numExperts", f"{num} experts are not whole groups of {b}"))
        if len(core) % b:
            warnings.append(_passenger(f"{path}.coreExperts", f"{len(core)} core experts", b))
        catalog = layer.get("sliceCatalog") if isinstance(layer.get("sliceCatalog"), list) else []
        for s, item in enumerate(catalog):
            n = len(set(_ints(item.get("experts")))) if isinstance(item, Mapping) else 0
            if n % b:
                warnings.append(_passenger(f"{path}.sliceCatalog[{s}].experts", f"a slice of {n}", b))
    budget = doc.get("budget") if isinstance(doc.get("budget"), Mapping) else {}
    gb = as_int(budget.get("group_hbm_bytes"))
    if gb is None:
        return
    for name, groups in (
        ("core_budget_bytes", core_groups),
        ("swappable_expert_budget_bytes", core_groups + specialist_groups),
    ):
        limit = as_int(budget.get(name))
        if limit is not None and groups * gb > limit:
            errors.append(
                PlanIssue(
                    f"budget.{name}",
                    f"{groups} groups of {b} x group_hbm_bytes {gb:,} = {groups * gb:,} HBM bytes, over "
                    f"this budget of {limit:,}",
                )
            )
    if shape is not None:
        _group_model_issue(shape, b, gb, errors)


def _passenger(path: str, what: str, b: int) -> PlanIssue:
    return PlanIssue(
        path, f"{what} is not whole groups of groupSize {b}: a boundary group carries a passenger"
    )


def _group_model_issue(shape: ModelShape, b: int, gb: int, errors: list) -> None:
    fmt = shape.expert_format
    if fmt.kernel not in ("strided", "contiguous"):
        errors.append(
            PlanIssue("groupSize", f"{b}: the model's {shape.quant_method} experts run on an opaque kernel")
        )
        return
    plan = plan_contiguous_groups if fmt.kernel == "contiguous" else plan_groups
    try:
        want = plan((("w13_weight", fmt.w13), ("w2_weight", fmt.w2)), shape.num_experts, b).group_bytes
    except ValueError as exc:
        errors.append(PlanIssue("groupSize", f"{b}: {exc}"))
        return
    if gb != want:
        errors.append(
            PlanIssue(
                "budget.group_hbm_bytes",
                f"{gb:,} != {want:,}, the HBM of a group of {b} of the model's experts "
                f"(w13 {fmt.w13:,} + w2 {fmt.w2:,} bytes each, 2 MiB pages)",
            )
        )


def cartridge_issues(plan: Plan) -> list[PlanIssue]:
    """Each named active set must resolve against the plan and fit its budget."""

    issues = []
    for name, cartridge in plan.cartridges.items():
        try:
            resident = active_set.resident_sets(plan, active_set.normalize_active_set(plan, cartridge))
            active_set.check_budget(plan, resident, None)
        except active_set.ActiveSetError as exc:
            where = exc.field.removeprefix("active_set")
            issues.append(PlanIssue(f"cartridges.{name}{where}", exc.message))
    return issues
