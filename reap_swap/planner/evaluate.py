"""Plan x held-out observations -> coverage: is a plan worth serving, before timing anything.

Coverage is the share of routed selections (token x top-k choices) that land on resident
experts; a selection outside the resident set is a router miss (a swap, a host read or a
degraded answer, depending on the serving mode). Three figures per layer and overall:

- ``core``: what the always-resident core covers, against ``oracle_core``, the best static
  set of the same size chosen with hindsight on the held-out data itself.
- ``core_plus_slices``: core plus, for each request (record), the best slices the plan offers
  within the layer's specialist capacity (chosen with hindsight, so an upper bound on what a
  client's slice selector can reach), against ``oracle_per_request``: per request, the best
  experts of the same total count, ignoring the plan. Needs per-record counts
  (``observe --per-request``).

A layer's specialist capacity is ``specialistActiveExpertTarget`` (else ``specialistBudgetBytes``
/ per-expert bytes); plans without either split the budget left after the core evenly over layers.
Overall figures sum selections over layers; every layer sees every token, so they are the mean
of the layer figures.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from reap_swap.plan.document import Plan
from reap_swap.planner.inputs import merge_layers
from reap_swap.planner.observation_types import LayerStats, Observations, RecordCounts


class EvaluationError(ValueError):
    """Plan and observations do not describe the same model."""


def _top_sum(counts: np.ndarray, k: int) -> np.ndarray:
    """Sum of the k largest entries along the last axis."""
    if k <= 0:
        return np.zeros(counts.shape[:-1], dtype=np.int64)
    k = min(k, counts.shape[-1])
    return np.sort(counts, axis=-1)[..., -k:].sum(axis=-1)


def best_slices_cover(counts: np.ndarray, slices: list[np.ndarray], capacity: int) -> np.ndarray:
    """Per row of `counts` [R, E]: the most selections coverable by disjoint slices whose expert
    count totals at most `capacity` (0/1 knapsack, exact; vectorised over rows)."""
    rows = counts.shape[0]
    dp = np.zeros((rows, capacity + 1), dtype=np.int64)
    for experts in slices:
        cost = len(experts)
        if cost == 0 or cost > capacity:
            continue
        gain = counts[:, experts].sum(axis=1)
        shifted = dp[:, : capacity + 1 - cost] + gain[:, None]
        dp[:, cost:] = np.maximum(dp[:, cost:], shifted)
    return dp[:, capacity]


def _capacities(plan: Plan) -> dict[int, int]:
    pe = plan.per_expert_bytes
    layers = plan.document["perLayer"]
    out: dict[int, int] = {}
    missing = []
    for index, layer in plan.layers.items():
        raw = layers[layer.key]
        if "specialistActiveExpertTarget" in raw:
            out[index] = int(raw["specialistActiveExpertTarget"])
        elif "specialistBudgetBytes" in raw:
            out[index] = int(raw["specialistBudgetBytes"]) // pe
        else:
            missing.append(index)
    if missing:
        spare = max(0, plan.swappable_budget_bytes - plan.core_bytes()) // pe
        for index in missing:
            out[index] = spare // len(missing)
    return out


def _disjoint_noncore(layer) -> list[np.ndarray]:
    """Each slice's non-core experts; overlapping slices are made disjoint in catalog order (an
    expert counts in the first slice that offers it) so the knapsack never counts one twice."""
    seen = set(layer.core)
    out = []
    for s in layer.slices:
        experts = [e for e in s.experts if e not in seen]
        seen.update(experts)
        out.append(np.array(experts, dtype=np.int64))
    return out


def _share(covered: int, total: int) -> float | None:
    return round(covered / total, 6) if total else None


def evaluate(plan: Plan, layers: Mapping[int, LayerStats], records=None) -> dict[str, Any]:
    """Coverage report (JSON-able). `layers`: merged held-out layer stats; `records`: the
    RecordCounts of the held-out files or None."""
    common = _common_layers(plan, layers)
    capacity = _capacities(plan)
    record_layer = {l: n for n, l in enumerate(records.layers)} if records is not None else {}
    rows = []
    totals = dict.fromkeys(_TOTALS, 0)
    for i in common:
        row, counted = _layer_row(plan.layers[i], layers[i], capacity[i], records, record_layer.get(i))
        for key, value in counted.items():
            totals[key] += value
        rows.append(row)
    overall = {
        "selections": totals["selections"],
        "core": _share(totals["core"], totals["selections"]),
        "oracle_core": _share(totals["oracle_core"], totals["selections"]),
        "in_plan": _share(totals["in_plan"], totals["selections"]),
        "core_plus_slices": _share(totals["core_plus_slices"], totals["req_selections"]),
        "oracle_per_request": _share(totals["oracle_per_request"], totals["req_selections"]),
        "requests": int(records.counts.shape[0]) if records is not None else 0,
    }
    return {
        "plan_identity": plan.identity,
        "model": plan.model,
        "overall": overall,
        "layers": rows,
        "notes": _notes(plan, layers, records),
    }


_TOTALS = (
    "selections",
    "core",
    "oracle_core",
    "in_plan",
    "req_selections",
    "core_plus_slices",
    "oracle_per_request",
)


def _common_layers(plan: Plan, layers: Mapping[int, LayerStats]) -> list[int]:
    """The layers both have, refused when there are none or their widths differ."""
    common = sorted(set(plan.layers) & set(layers))
    if not common:
        raise EvaluationError(
            f"plan layers {sorted(plan.layers)} and observation layers {sorted(layers)} "
            "have nothing in common"
        )
    for i in common:
        if layers[i].num_experts != plan.layers[i].num_experts:
            raise EvaluationError(
                f"layer {i}: plan has {plan.layers[i].num_experts} experts, "
                f"observations {layers[i].num_experts}"
            )
    return common


def _layer_row(
    lp, stats: LayerStats, capacity: int, records, record_index: int | None
) -> tuple[dict[str, Any], dict[str, int]]:
    """One layer's figures, and the selection counts it adds to the overall totals."""
    freq = np.asarray(stats.expert_frequency, dtype=np.int64)
    core = np.array(sorted(lp.core), dtype=np.int64)
    n = int(freq.sum())
    core_cov = int(freq[core].sum())
    oracle = int(_top_sum(freq, len(core)))
    in_plan = int(freq[np.array(sorted(lp.candidates), dtype=np.int64)].sum())
    row: dict[str, Any] = {
        "layer": lp.index,
        "selections": n,
        "core_experts": len(core),
        "specialist_capacity": capacity,
        "core": _share(core_cov, n),
        "oracle_core": _share(oracle, n),
        "in_plan": _share(in_plan, n),
    }
    counted = {"selections": n, "core": core_cov, "oracle_core": oracle, "in_plan": in_plan}
    if record_index is None:
        row.update(requests=0, core_plus_slices=None, oracle_per_request=None)
        return row, counted
    counts = np.asarray(records.counts[:, record_index, :], dtype=np.int64)
    req_n = int(counts.sum())
    base = counts[:, core].sum(axis=1)
    extra = best_slices_cover(counts, _disjoint_noncore(lp), capacity)
    cps = int((base + extra).sum())
    orq = int(_top_sum(counts, len(core) + capacity).sum())
    row.update(
        requests=int(counts.shape[0]),
        core_plus_slices=_share(cps, req_n),
        oracle_per_request=_share(orq, req_n),
    )
    counted.update(req_selections=req_n, core_plus_slices=cps, oracle_per_request=orq)
    return row, counted


def _notes(plan: Plan, layers: Mapping[int, LayerStats], records) -> list[str]:
    notes = []
    if records is None:
        notes.append(
            "no per-record counts in the observations (observe --per-request): "
            "core_plus_slices and oracle_per_request not computed"
        )
    skipped = sorted(set(layers) - set(plan.layers))
    if skipped:
        notes.append(f"observation layers not in the plan, not evaluated: {skipped}")
    unobserved = sorted(set(plan.layers) - set(layers))
    if unobserved:
        notes.append(f"plan layers without observations, not evaluated: {unobserved}")
    return notes


def evaluate_observations(plan: Plan, observations: list[Observations]) -> dict[str, Any]:
    """Merge several held-out files (same layers) and evaluate; records are concatenated."""
    layers = merge_layers([o.layers for o in observations])
    parts = [o.records for o in observations if o.records is not None]
    records = None
    if parts and len(parts) == len(observations):
        if len({p.layers for p in parts}) != 1:
            raise EvaluationError("per-record counts cover different layers in different files")
        records = RecordCounts(
            layers=parts[0].layers,
            counts=np.concatenate([p.counts for p in parts]),
            tags=tuple(t for p in parts for t in p.tags),
            tokens=np.concatenate([p.tokens for p in parts]),
            lines=np.concatenate([p.lines for p in parts]),
        )
    report = evaluate(plan, layers, records)
    report["inputs"] = [{"label": o.label, "sha256": o.digest} for o in observations]
    if parts and records is None:
        report["notes"].append("only some files have per-record counts: per-request figures not computed")
    return report


def format_report(report: Mapping[str, Any]) -> str:
    """A fixed-width table for the terminal."""

    def pct(x):
        return "   -  " if x is None else f"{100 * x:5.1f}%"

    lines = [
        f"plan {report['plan_identity'][:16]}  model {report['model'] or '-'}",
        f"{'layer':>6} {'core#':>5} {'spec#':>5} {'core':>7} {'oracle':>7} {'core+sl':>7} "
        f"{'oracleR':>7} {'inplan':>7}",
    ]
    for r in report["layers"]:
        lines.append(
            f"{r['layer']:>6} {r['core_experts']:>5} {r['specialist_capacity']:>5} {pct(r['core']):>7} "
            f"{pct(r['oracle_core']):>7} {pct(r['core_plus_slices']):>7} "
            f"{pct(r['oracle_per_request']):>7} {pct(r['in_plan']):>7}"
        )
    o = report["overall"]
    lines.append(
        f"{'all':>6} {'':>5} {'':>5} {pct(o['core']):>7} {pct(o['oracle_core']):>7} "
        f"{pct(o['core_plus_slices']):>7} {pct(o['oracle_per_request']):>7} {pct(o['in_plan']):>7}"
    )
    lines.append(f"selections {o['selections']:,}; requests {o['requests']:,}")
    lines.extend(f"note: {n}" for n in report["notes"])
    return "\n".join(lines)
