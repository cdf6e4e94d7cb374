"""The plan: which experts stay resident (core) and which may be swapped in (slices), per layer.

Loading a plan is two passes. The JSON Schema (schemas/reap_plan.schema.json) refuses unknown
or mistyped keys wherever the runtime reads, so a misspelled ``coreExpert`` cannot silently
produce an empty core. The semantic pass then checks what a schema cannot express: ids within
``numExperts``, duplicates, slice id uniqueness, byte costs, the budget, the summary and, given
a model's config, the model's shape. Every problem carries the JSON path of the offender.

A valid plan becomes one immutable :class:`Plan`; its identity is the SHA-256 of the canonical
JSON (sorted keys, no spaces), so two servers can tell whether they serve the same plan.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

import jsonschema
import orjson

from reap_swap.model_shape import ModelShape

MODE = "dynamic_core_specialist"
GIB = 1 << 30
_LAYER_KEY = re.compile(r"^layer_(0|[1-9][0-9]*)$")
_PATTERN_NAMES = {_LAYER_KEY.pattern: "layer_<N> (N a layer index without leading zeros)"}


# ----------------------------------------------------------------------------- report


class PlanIssue(NamedTuple):
    path: str  # JSON path such as "perLayer.layer_5.sliceCatalog[3].experts[2]"; "$" is the root
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


@dataclass(frozen=True)
class ValidationReport:
    errors: tuple[PlanIssue, ...]
    warnings: tuple[PlanIssue, ...]
    summary: Mapping[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "errors": [{"path": i.path, "message": i.message} for i in self.errors],
            "warnings": [{"path": i.path, "message": i.message} for i in self.warnings],
            "summary": dict(self.summary),
        }

    def format_text(self) -> str:
        lines = [f"error   {issue}" for issue in self.errors]
        lines += [f"warning {issue}" for issue in self.warnings]
        lines.append(
            f"{'INVALID' if self.errors else 'valid'}: "
            f"{len(self.errors)} error(s), {len(self.warnings)} warning(s)"
        )
        lines += _format_summary(self.summary)
        return "\n".join(lines)


class PlanError(ValueError):
    """Raised by load_plan for a plan that does not validate; carries the full report."""

    def __init__(self, report: ValidationReport):
        self.report = report
        first = "; ".join(str(i) for i in report.errors[:3])
        more = f" (+{len(report.errors) - 3} more)" if len(report.errors) > 3 else ""
        super().__init__(f"invalid plan: {first}{more}")


def _format_summary(s: Mapping[str, Any]) -> list[str]:
    if not s:
        return []

    def size(n: int) -> str:
        return f"{n:,} B ({n / GIB:.2f} GiB)"

    per_layer = s.get("experts_per_layer")
    per_layer = ", ".join(map(str, per_layer)) if isinstance(per_layer, list) else per_layer
    rows = [
        ("model", s.get("model") or "-"),
        ("identity", s.get("identity") or "-"),
        ("layers", f"{s['layers']:,}"),
        ("experts per layer", per_layer),
        ("core experts", f"{s['core_experts']:,}"),
        ("slices", f"{s['slices']:,}"),
        ("per-expert bytes", f"{s['per_expert_bytes']:,}" if s.get("per_expert_bytes") else "-"),
    ]
    budget = s.get("swappable_budget_bytes")
    if s.get("per_expert_bytes"):
        resident = f"core {size(s['core_bytes'])}"
        if budget:
            resident += f" of budget {size(budget)} ({100 * s['core_bytes'] / budget:.1f} %)"
        rows.append(("resident bytes", resident))
        rows.append(("core ∪ slices bytes", size(s["candidate_bytes"])))
    if s.get("total_experts"):
        rows.append(
            (
                "coverage",
                f"{s['covered_experts']:,} of {s['total_experts']:,} experts in core ∪ "
                f"slices ({100 * s['coverage']:.1f} %)",
            )
        )
    return ["summary:"] + [f"  {name:<20} {value}" for name, value in rows]


# ----------------------------------------------------------------------------- model


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
    candidates: frozenset[int]  # core | every slice's experts: all a request may make resident


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

    def core_sets(self) -> dict[int, frozenset[int]]:
        return {index: layer.core for index, layer in self.layers.items()}

    def core_bytes(self) -> int:
        return sum(len(layer.core) for layer in self.layers.values()) * self.per_expert_bytes


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


# ----------------------------------------------------------------------------- schema pass


@cache
def plan_schema() -> Mapping[str, Any]:
    """The packaged copy of schemas/reap_plan.schema.json."""
    text = resources.files("reap_swap").joinpath("schemas/reap_plan.schema.json").read_bytes()
    return orjson.loads(text)


@cache
def _validator() -> jsonschema.Draft202012Validator:
    schema = plan_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def json_path(parts: Iterable[str | int]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "$"


def _schema_issues(doc: Any) -> list[PlanIssue]:
    issues = []
    for err in sorted(_validator().iter_errors(doc), key=lambda e: list(map(str, e.absolute_path))):
        path = json_path(err.absolute_path)
        if err.validator == "additionalProperties" and isinstance(err.instance, Mapping):
            issues.extend(_unknown_keys(list(err.absolute_path), err.instance, err.schema))
        elif err.validator == "required":
            missing = [k for k in err.validator_value if k not in err.instance]
            issues.extend(PlanIssue(path, f"missing required key {k!r}") for k in missing)
        else:
            issues.append(PlanIssue(path, err.message))
    return issues


def _unknown_keys(parts: list, instance: Mapping, schema: Mapping) -> list[PlanIssue]:
    """One issue per unexpected key, naming it, the closest known key, and all expected keys."""
    known = list(schema.get("properties", {}))
    patterns = list(schema.get("patternProperties", {}))
    issues = []
    for key in instance:
        if key in known or any(re.search(p, key) for p in patterns):
            continue
        if known:
            near = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            expected = ", ".join(known)
        else:
            hint, expected = "", " or ".join(_PATTERN_NAMES.get(p, f"/{p}/") for p in patterns)
        issues.append(
            PlanIssue(json_path([*parts, key]), f"unknown key {key!r}{hint}; expected keys: {expected}")
        )
    return issues


# ----------------------------------------------------------------------------- semantic pass


def _ints(value: Any) -> list[int]:
    """The ints in a list (the schema pass reports anything else)."""
    if not isinstance(value, list | tuple):
        return []
    return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _check_ids(path: str, ids: Any, num_experts: int | None, errors: list[PlanIssue]) -> None:
    seen: set[int] = set()
    if not isinstance(ids, list | tuple):
        return
    for i, expert in enumerate(ids):
        if _int(expert) is None:
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


def _semantic_issues(
    doc: Mapping, shape: ModelShape | None, summary: dict, schema_clean: bool
) -> tuple[list[PlanIssue], list[PlanIssue]]:
    """Defensive about types (the schema pass reports those); fills ``summary`` as it goes."""
    errors: list[PlanIssue] = []
    warnings: list[PlanIssue] = []
    budget = doc.get("budget") if isinstance(doc.get("budget"), Mapping) else {}
    per_layer = doc.get("perLayer") if isinstance(doc.get("perLayer"), Mapping) else {}
    pe = _int(budget.get("per_expert_bytes"))

    total_core = total_slices = covered = total_experts = candidate_experts = 0
    experts_per_layer: set[int] = set()
    layer_indices: list[int] = []
    for key, layer in per_layer.items():
        match = _LAYER_KEY.match(key)
        if not match or not isinstance(layer, Mapping):
            continue
        index = int(match.group(1))
        layer_indices.append(index)
        path = f"perLayer.{key}"
        num = _int(layer.get("numExperts"))
        if num is not None:
            experts_per_layer.add(num)
            total_experts += num

        raw = layer.get("rawLayerKey")
        if isinstance(raw, str) and _raw_layer_index(raw) != index:
            errors.append(
                PlanIssue(f"{path}.rawLayerKey", f"{raw!r} does not name layer {index} (key {key!r})")
            )

        core = _ints(layer.get("coreExperts"))
        _check_ids(f"{path}.coreExperts", layer.get("coreExperts"), num, errors)
        total_core += len(set(core))
        cost = _int(layer.get("coreByteCost"))
        if pe and cost is not None and "coreExperts" in layer and cost != len(set(core)) * pe:
            warnings.append(
                PlanIssue(
                    f"{path}.coreByteCost",
                    f"{cost:,} != {len(set(core))} core experts x per_expert_bytes "
                    f"{pe:,} = {len(set(core)) * pe:,}",
                )
            )

        candidates = set(core)
        slice_ids: dict[str, int] = {}
        catalog = layer.get("sliceCatalog") if isinstance(layer.get("sliceCatalog"), list) else []
        total_slices += len(catalog)
        for s, item in enumerate(catalog):
            if not isinstance(item, Mapping):
                continue
            spath = f"{path}.sliceCatalog[{s}]"
            experts = _ints(item.get("experts"))
            _check_ids(f"{spath}.experts", item.get("experts"), num, errors)
            candidates.update(experts)
            sid = item.get("sliceId")
            if isinstance(sid, str):
                if sid in slice_ids:
                    errors.append(
                        PlanIssue(
                            f"{spath}.sliceId",
                            f"duplicate sliceId {sid!r} (also sliceCatalog[{slice_ids[sid]}])",
                        )
                    )
                slice_ids.setdefault(sid, s)
            cost = _int(item.get("byteCost"))
            if pe and cost is not None and cost != len(set(experts)) * pe:
                warnings.append(
                    PlanIssue(
                        f"{spath}.byteCost",
                        f"{cost:,} != {len(set(experts))} experts x per_expert_bytes "
                        f"{pe:,} = {len(set(experts)) * pe:,}",
                    )
                )
        in_range = {e for e in candidates if num is None or 0 <= e < num}
        covered += len(in_range)
        candidate_experts += len(candidates)

        if shape is not None:
            if index not in shape.moe_layers:
                errors.append(
                    PlanIssue(
                        path,
                        f"model {shape.architecture} has no MoE layer {index} "
                        f"(MoE layers: {format_ranges(shape.moe_layers)})",
                    )
                )
            if num is not None and num != shape.num_experts:
                errors.append(
                    PlanIssue(f"{path}.numExperts", f"{num} != model's {shape.num_experts} experts per layer")
                )

    core_bytes = total_core * pe if pe else 0
    swappable = _swappable_budget(budget, core_bytes, candidate_experts * (pe or 0))
    for name in ("core_budget_bytes", "swappable_expert_budget_bytes"):
        limit = _int(budget.get(name))
        if pe and limit is not None and core_bytes > limit:
            errors.append(
                PlanIssue(
                    f"budget.{name}",
                    f"core experts need {core_bytes:,} bytes "
                    f"({total_core:,} x {pe:,}), over this budget of {limit:,} "
                    f"by {core_bytes - limit:,}",
                )
            )

    if shape is not None:
        if pe is not None and pe != shape.expert_bytes:
            errors.append(
                PlanIssue(
                    "budget.per_expert_bytes",
                    f"{pe:,} != model's expert size {shape.expert_bytes:,} "
                    f"(3 x hidden {shape.hidden_size} x moe_intermediate "
                    f"{shape.moe_intermediate_size} x {shape.dtype_bytes} bytes)",
                )
            )
        missing = sorted(set(shape.moe_layers) - set(layer_indices))
        if len(layer_indices) != len(shape.moe_layers) or missing:
            errors.append(
                PlanIssue(
                    "perLayer",
                    f"plan has {len(layer_indices)} layers, model "
                    f"{shape.architecture} has {len(shape.moe_layers)} MoE layers"
                    + (f" (missing: {format_ranges(missing)})" if missing else ""),
                )
            )

    # A broken layer would make every count disagree; compare the summary only on a clean schema pass.
    declared = doc.get("summary") if schema_clean and isinstance(doc.get("summary"), Mapping) else {}
    for name, actual in (
        ("layerCount", len(layer_indices)),
        ("totalCoreExperts", total_core),
        ("totalSlices", total_slices),
    ):
        if name in declared and declared[name] != actual:
            errors.append(PlanIssue(f"summary.{name}", f"says {declared[name]!r}, plan has {actual}"))
    lo, hi = declared.get("residentFractionPctMin"), declared.get("residentFractionPctMax")
    if isinstance(lo, int | float) and isinstance(hi, int | float) and lo > hi:
        errors.append(PlanIssue("summary.residentFractionPctMin", f"{lo} > residentFractionPctMax {hi}"))

    summary.update(
        model=doc.get("model") if isinstance(doc.get("model"), str) else None,
        layers=len(layer_indices),
        layer_indices=format_ranges(sorted(layer_indices)),
        experts_per_layer=(
            next(iter(experts_per_layer)) if len(experts_per_layer) == 1 else sorted(experts_per_layer)
        ),
        core_experts=total_core,
        slices=total_slices,
        per_expert_bytes=pe,
        core_bytes=core_bytes,
        candidate_bytes=candidate_experts * (pe or 0),
        swappable_budget_bytes=swappable,
        covered_experts=covered,
        total_experts=total_experts,
        coverage=covered / total_experts if total_experts else 0.0,
    )
    return errors, warnings


def _swappable_budget(budget: Mapping, core_bytes: int, candidate_bytes: int) -> int:
    """The byte budget for resident experts: declared, else core + specialist, else everything
    the plan offers (a minimal plan without a budget constrains nothing beyond its candidates)."""
    declared = _int(budget.get("swappable_expert_budget_bytes"))
    if declared is not None:
        return declared
    core, specialist = _int(budget.get("core_budget_bytes")), _int(budget.get("specialist_budget_bytes"))
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


def _cartridge_issues(plan: Plan) -> list[PlanIssue]:
    """Each named active set must resolve against the plan and fit its budget."""
    from reap_swap import active_set  # active_set builds on Plan; import here to avoid a cycle

    issues = []
    for name, selection in plan.cartridges.items():
        try:
            keep = active_set.resident_sets(plan, active_set.normalize_active_set(plan, selection))
            active_set.check_budget(plan, keep, None)
        except active_set.ActiveSetError as exc:
            where = exc.field.removeprefix("active_set")
            issues.append(PlanIssue(f"cartridges.{name}{where}", exc.message))
    return issues


# ----------------------------------------------------------------------------- entry points


def validate_plan_document(doc: Mapping, model_shape: ModelShape | None = None) -> ValidationReport:
    """Schema pass, then semantic pass; both always run so one report lists every problem."""
    return _validate(doc, model_shape, build=False)[0]


def _validate(doc: Any, model_shape: ModelShape | None, build: bool) -> tuple[ValidationReport, Plan | None]:
    """The report and, when the document is valid and `build` (or its cartridges need checking
    against the built plan), the plan: built at most once."""
    if not isinstance(doc, Mapping):
        return ValidationReport(
            (PlanIssue("$", f"a plan is a JSON object, not {type(doc).__name__}"),), ()
        ), None
    if not isinstance(doc, dict):
        doc = _thaw(doc)  # a frozen Plan.document: jsonschema's "object" and "array" mean dict and list
    errors = _schema_issues(doc)
    summary: dict[str, Any] = {"identity": hashlib.sha256(canonical_json(doc)).hexdigest()}
    semantic_errors, warnings = _semantic_issues(doc, model_shape, summary, schema_clean=not errors)
    errors = sorted(errors + semantic_errors, key=_path_order)
    plan = None
    if not errors and (build or doc.get("cartridges")):
        plan = _build_plan(doc, summary["identity"])
        if doc.get("cartridges"):
            errors += _cartridge_issues(plan)
    return ValidationReport(tuple(errors), tuple(warnings), MappingProxyType(summary)), plan


def _path_order(issue: PlanIssue) -> list:
    """Natural order: layer_5 before layer_10, [3] before [12]."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", issue.path)]


def _thaw(obj: Any) -> Any:
    """Plain dicts/lists again (a frozen document or tuples from Python callers)."""
    if isinstance(obj, Mapping):
        return {k: _thaw(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_thaw(v) for v in obj]
    return obj


def _build_plan(doc: Mapping, identity: str) -> Plan:
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
        layers[index] = LayerPlan(
            index=index,
            key=key,
            num_experts=raw["numExperts"],
            core=core,
            slices=slices,
            slice_by_id=MappingProxyType({s.slice_id: s for s in slices}),
            candidates=core.union(*(s.experts for s in slices)),
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
        swappable_budget_bytes=_swappable_budget(budget, core_bytes, candidate_bytes),
        max_refreshes_per_request=budget.get("max_refreshes_per_request", 1),
        cartridges=_freeze(doc.get("cartridges", {})),
    )


def read_plan_document(source: str | os.PathLike) -> dict:
    """Parse a plan file; a JSON syntax error becomes a PlanError with a report like any other."""
    data = Path(source).read_bytes()
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise PlanError(ValidationReport((PlanIssue("$", f"not valid JSON: {exc}"),), ())) from exc


def load_plan(source: str | os.PathLike | Mapping, model_shape: ModelShape | None = None) -> Plan:
    """Validate and build the immutable plan; raises PlanError (with the report) when invalid."""
    doc = source if isinstance(source, Mapping) else read_plan_document(source)
    report, plan = _validate(doc, model_shape, build=True)
    if not report.ok:
        raise PlanError(report)
    return plan
