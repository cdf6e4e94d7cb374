"""What a slice is worth to one request: plan priors weighted by the prompt's features, and the
share of the layer's routing that missed on its experts (from the server's router-miss payloads).

Router-miss payloads give each layer's ``inactive_experts`` and per-expert ``expert_counts``;
the values are shares of the layer's routed selections (see :func:`missed_mass`). The value
functions price a slice per *marginal* expert, for selection's greedy fill.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from reap_swap.client.prompt_features import GLOBAL
from reap_swap.plan.document import Plan, Slice

MissedMass = dict[int, dict[int, float]]  # layer -> expert -> routed mass that missed (share of the layer)


def _global_prior(layer_slices: Sequence[Slice]) -> list[float]:
    """Per slice: its ``global`` task prior, else its activation mass; all zero -> catalog rank."""
    values = [s.task_priors.get(GLOBAL, s.activation_mass) for s in layer_slices]
    if not any(v > 0 for v in values):
        n = len(layer_slices)
        values = [(n - i) / (n * (n + 1) / 2) for i in range(n)]  # shares summing to 1, catalog order
    return values


def _ranked_lists(plan: Plan, family: str, layer_key: str) -> list[str] | None:
    artifacts = plan.document.get("scorerArtifacts") or {}
    for key in ("taskFamilySlicePriors", "promptClusterPriors"):
        ranked = artifacts.get(key)
        if isinstance(ranked, Mapping) and isinstance(ranked.get(family), Mapping):
            ids = ranked[family].get(layer_key)
            if isinstance(ids, Sequence) and not isinstance(ids, str):
                return [str(i) for i in ids]
    return None


def slice_priors(plan: Plan, weights: Mapping[str, float]) -> dict[int, list[float]]:
    """Layer -> per-slice (catalog order) prior value: Σ weight[f] · prior_f(slice).

    prior_f is the slice's ``taskPriors[f]``. A plan that only *ranks* slices for f (scorer
    artifact lists) gives the slice at rank r the r-th largest global prior of its layer, so
    the layer keeps its mass scale and f its order; slices missing from the list get 0.
    """
    out: dict[int, list[float]] = {}
    for index, layer in plan.layers.items():
        glob = _global_prior(layer.slices)
        total = [0.0] * len(layer.slices)
        for name, w in weights.items():
            if w == 0.0:
                continue
            if name == GLOBAL:
                values = glob
            elif all(name in s.task_priors for s in layer.slices):
                values = [s.task_priors[name] for s in layer.slices]
            else:
                ranked = _ranked_lists(plan, name, layer.key)
                by_mass = sorted(glob, reverse=True)
                rank = {sid: r for r, sid in enumerate(ranked or ())}
                values = [
                    s.task_priors[name]
                    if name in s.task_priors
                    else (
                        by_mass[rank[s.slice_id]]
                        if s.slice_id in rank and rank[s.slice_id] < len(by_mass)
                        else (glob[i] if ranked is None else 0.0)
                    )
                    for i, s in enumerate(layer.slices)
                ]
            total = [t + w * v for t, v in zip(total, values)]
        out[index] = total
    return out


# ----------------------------------------------------------------------------- misses


def missed_mass(router_misses: Mapping[str, Any]) -> MissedMass:
    """GET /router_misses/{id} -> layer -> expert -> share of the layer's routing that missed on it.

    With the payload's per-expert ``expert_counts`` (the server's routed selections per expert),
    an inactive expert's share is its count over the layer's ``observed_selections``: the unit
    the hit rate is measured in, and the unit of the planner's priors (shares of selections).
    Without them: a per-expert ``inactive_expert_mass`` if present, else each of the layer's
    ``inactive_experts`` gets an equal part of its ``inactive_mass`` (over ``observed_mass``).
    """
    out: MissedMass = {}
    for key, row in (router_misses.get("layers") or {}).items():
        layer = int(str(key).removeprefix("layer_"))
        inactive = [int(e) for e in row.get("inactive_experts") or ()]
        counts = row.get("expert_counts")
        selections = int(row.get("observed_selections") or 0)
        if isinstance(counts, Sequence) and not isinstance(counts, str) and selections > 0:
            shares = {e: counts[e] / selections for e in inactive if 0 <= e < len(counts) and counts[e] > 0}
            if shares:
                out[layer] = dict(sorted(shares.items()))
            continue
        observed = float(row.get("observed_mass") or 0.0) or float(selections)
        if observed <= 0.0:
            continue
        per_expert = row.get("inactive_expert_mass")
        masses: dict[int, float] = {}
        if isinstance(per_expert, Mapping):
            masses = {int(e): float(m) for e, m in per_expert.items() if float(m) > 0}
        elif isinstance(per_expert, Sequence) and not isinstance(per_expert, str):
            masses = {e: float(m) for e, m in enumerate(per_expert) if float(m) > 0}
        else:
            total = float(row.get("inactive_mass") or 0.0)
            if total <= 0.0 and inactive:  # no gate weights counted: fall back to selections
                total = float(row.get("missed_selections") or 0) * (observed / max(1, selections))
            masses = {e: total / len(inactive) for e in inactive} if inactive else {}
        if masses:
            out[layer] = {e: m / observed for e, m in sorted(masses.items())}
    return out


def routed_share(router_misses: Mapping[str, Any]) -> MissedMass | None:
    """layer -> expert -> share of the layer's routed selections, resident or not (from the
    payload's ``expert_counts``); None when the server does not report per-expert counts."""
    out: MissedMass = {}
    found = False
    for key, row in (router_misses.get("layers") or {}).items():
        counts = row.get("expert_counts")
        if not isinstance(counts, Sequence) or isinstance(counts, str):
            continue
        found = True
        total = sum(counts)
        if total > 0:
            out[int(str(key).removeprefix("layer_"))] = {e: c / total for e, c in enumerate(counts) if c > 0}
    return out if found else None


def prior_value(priors: Mapping[int, Sequence[float]], plan: Plan):
    """A slice's prior, pro rata for the part of it not yet resident."""

    def value(index: int, i: int, new: frozenset[int]) -> tuple[float]:
        s = plan.layers[index].slices[i]
        return (priors[index][i] * len(new) / len(set(s.experts)),)

    return value


def miss_then_prior_value(
    plan: Plan,
    misses: MissedMass,
    priors: Mapping[int, Sequence[float]],
    current: Mapping[int, frozenset[int]] | None = None,
):
    """(missed mass of the new experts, prior share of them): misses first, the prior fills.

    ``current`` (refresh): experts resident during the measurement show no misses however much
    they were used, so their part counts at its prior share in the first component too.
    """
    by_prior = prior_value(priors, plan)

    def value(index: int, i: int, new: frozenset[int]) -> tuple[float, float]:
        row = misses.get(index, {})
        mass = sum(row.get(e, 0.0) for e in new)
        (p,) = by_prior(index, i, new)
        if current is not None:
            s = plan.layers[index].slices[i]
            was = new & current.get(index, frozenset())
            mass += priors[index][i] * len(was) / len(set(s.experts))
        return mass, p

    return value
