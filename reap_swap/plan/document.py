"""The plan: which experts stay resident (core) and which may be swapped in (slices), per layer.

Loading a plan is two passes. The JSON Schema (schemas/reap_plan.schema.json) refuses unknown
or mistyped keys wherever the runtime reads, so a misspelled ``coreExpert`` cannot silently
produce an empty core. The semantic pass then checks what a schema cannot express: ids within
``numExperts``, duplicates, slice id uniqueness, byte costs, the budget, the summary and, given
a model's config, the model's shape. Every problem carries the JSON path of the offender.

A valid plan becomes one immutable :class:`Plan`; its identity is the SHA-256 of the canonical
JSON (sorted keys, no spaces), so two servers can tell whether they serve the same plan.

This module is the entry point (load, validate, read); the parts live in plan_model (Plan and its
identity bytes), plan_report (issues and the report), plan_checks (the semantic pass).
"""

from __future__ import annotations

import difflib
import hashlib
import os
import re
from collections.abc import Iterable, Mapping
from functools import cache
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any

import jsonschema
import orjson

from reap_swap.plan.checks import LAYER_KEY, cartridge_issues, semantic_issues
from reap_swap.plan.model import (
    MODE,
    LayerPlan,
    Plan,
    Slice,
    canonical_json,
    format_ranges,
    plan_from_document,
)
from reap_swap.plan.report import PlanError, PlanIssue, ValidationReport
from reap_swap.sizing.model_shape import ModelShape

__all__ = [
    "MODE",
    "LayerPlan",
    "Plan",
    "PlanError",
    "PlanIssue",
    "Slice",
    "ValidationReport",
    "canonical_json",
    "format_ranges",
    "json_path",
    "load_plan",
    "plan_schema",
    "read_plan_document",
    "validate_plan_document",
]

_PATTERN_NAMES = {LAYER_KEY.pattern: "layer_<N> (N a layer index without leading zeros)"}


# ----------------------------------------------------------------------------- schema pass


@cache
def plan_schema() -> Mapping[str, Any]:
    """The packaged copy of schemas/reap_plan.schema.json."""
    text = resources.files("reap_swap.plan").joinpath("schemas/reap_plan.schema.json").read_bytes()
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
    semantic_errors, warnings = semantic_issues(doc, model_shape, summary, schema_clean=not errors)
    errors = sorted(errors + semantic_errors, key=_path_order)
    plan = None
    if not errors and (build or doc.get("cartridges")):
        plan = plan_from_document(doc, summary["identity"])
        if doc.get("cartridges"):
            errors += cartridge_issues(plan)
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
