"""Observations -> plan: which experts stay resident per layer, and which fire together.

Pure (numpy only): observations.py turns ``torch.save`` files into observation_types' dataclasses.
This module assembles the plan document; each step lives in its own module: planner_inputs
(merge, checks), planner_values (per-expert value), planner_allocation (core and specialist
slots), planner_slices (co-activation groups and catalog entries), tail (the --cache-tail core caps).

Why each step is what it is:

- **Core by expected hit rate.** Every MoE layer sees every token, so the share of routed
  selections a layer's core covers is that layer's hit rate, and the mean over layers is the
  model's. An expert's value is its share of its layer's routed selections (or of its router
  mass). All experts cost the same bytes, so taking (layer, expert) items in value order across
  *all* layers is the greedy split of the core budget by marginal hit gain: flat layers, whose
  experts each carry little, get fewer core slots than peaked ones.
- **Super experts always resident.** When the files carry REAP's ``max_activations``, experts
  whose maximum activation is an outlier (above both a quantile of all experts and a fraction of
  the global maximum) go into the core before anything else: dropping them breaks the model.
- **REAP saliency as a guard.** ``reap`` is how much an expert matters *when routed* (mean of
  gate weight x output norm over its tokens), not how often it is routed. A rarely-routed expert
  whose saliency is a multiple of its layer's routed-mean saliency is kept in the core ahead of
  the frequency order, but guards may take at most a fixed fraction of the core slots, so the
  guard protects outliers without turning the core into a saliency ranking.
- **Slices from true co-activation.** Non-core experts are grouped into slices of experts that
  are routed on the same tokens (Ochiai coefficient of the co-activation counts, greedy from the
  most frequent seed). REAP's ``pairwise_expert_frequency`` is freq[i] + freq[j] and says nothing
  about co-firing, so files without our ``coactivation`` fall back to frequency-rank buckets
  (consecutive experts in value order), recorded as such in ``scorerArtifacts``.
- **Specialist budget per layer** in whole slices, again greedily by the routed mass the next
  slice would add.
- **A tail beside the core, when asked** (``--cache-tail``). The device cache's pinned
  form (core+dlfu) serves the core in its own units and runs the cache on (pool - core) // layers
  slots per layer; at small budgets a 0.75 core leaves fewer tail slots than one token routes
  (12.5 %, top-8: 4). With N > 0 every layer's slots (its core + that shared tail) leave N beside
  its core: the core holds at most budget slots - layers x N experts (a budget below layers x N:
  none), a layer at most its experts - N, in the greedy order (super experts are still kept);
  the core slots given up go to the specialists; ``scorerArtifacts.cacheTail`` records the limits.
- **Reproducible.** Every parameter and the SHA-256 of every input file go into
  ``scorerArtifacts``; all orderings have total tie-breaks, so the same inputs give the same bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import orjson

from reap_swap.plan.document import MODE
from reap_swap.planner.allocation import (
    LayerWork,
    Slots,
    allocate_core,
    allocate_specialists,
    cap_core,
    fill_order,
    force_reap_guarded,
    force_super_experts,
    layer_work,
    split_budget,
    super_experts,
)
from reap_swap.planner.config import GIB, PlannerConfig, PlannerError, budget_bytes
from reap_swap.planner.groups import (
    allocate_core_grouped,
    group_pricing,
    grouped_budget_fields,
    round_forced_to_groups,
    split_budget_grouped,
)
from reap_swap.planner.inputs import PlannerInputs, input_artifact, merge_inputs
from reap_swap.planner.observation_types import Observations
from reap_swap.planner.slices import ochiai, slice_entries, slice_groups
from reap_swap.planner.tail import finish_tail_record, tail_caps
from reap_swap.planner.values import rounded, share, signal_description
from reap_swap.sizing.model_shape import ModelShape

__all__ = ["PlannerConfig", "PlannerError", "build_plan", "plan_bytes"]

PLANNER_VERSION = 1
SELECTION_STRATEGY = "hit_greedy_v1"
_SIGNAL_KEYS = {
    "frequency": "expert_frequency",
    "router_mass": "weighted_expert_frequency_sum",
    "reap": "reap",
}


def build_plan(
    observations: Sequence[Observations], shape: ModelShape, config: PlannerConfig, model_name: str
) -> dict:
    """The plan document (a dict that passes reap_swap.plan.document.validate_plan_document for `shape`)."""
    inputs = merge_inputs(observations, shape)
    pricing = group_pricing(shape, config.group_size) if config.group_size is not None else None
    if pricing is None:
        slots = split_budget(
            budget_bytes(shape, config), shape.expert_bytes, len(inputs.layers), shape.num_experts, config
        )
    else:
        slots = split_budget_grouped(
            budget_bytes(shape, config), pricing, len(inputs.layers), shape.num_experts, config
        )
    work = layer_work(inputs.layers, config.signal)
    notes: list[str] = []
    caps, tail_record = None, None
    supers = super_experts(inputs.layers, config)  # found once: the tail's caps and the core use them
    if config.cache_tail != 0:  # planner_config refuses it with group sizes: pricing is None here
        caps, slots, tail_record = tail_caps(inputs, shape, config, slots, notes, supers)
    force_super_experts(work, supers, inputs.layers, slots, shape.expert_bytes, notes)
    guarded = force_reap_guarded(work, inputs.layers, config, slots, notes, caps)
    group_fill = _fill_core(work, slots, config, pricing, notes, caps)
    if caps is not None:  # what the caps left unused (uniform fill) goes to the specialists too
        slots = cap_core(
            slots, sum(len(w.core) for w in work.values()), shape.expert_bytes, len(work), config
        )
        finish_tail_record(tail_record, work, slots, shape.expert_bytes, notes)
    if slots.specialist > 0:
        allocate_specialists(work, slots.specialist, slots.slice_size)
    have_coact = all(s.coactivation is not None for s in inputs.layers.values())
    if not have_coact:
        notes.append(
            "no true co-activation in the inputs (REAP's pairwise_expert_frequency is "
            "freq[i] + freq[j]): slices are consecutive experts in value order"
        )
    per_layer = {
        f"layer_{i}": _layer_entry(w, inputs, slots, config, shape.expert_bytes, have_coact)
        for i, w in sorted(work.items())
    }
    artifacts = _artifacts(inputs, shape, config, slots, work, per_layer)
    artifacts.update(
        sliceMethod="coactivation_greedy_ochiai" if have_coact else "frequency_rank_buckets",
        superExperts={f"layer_{i}": v for i, v in sorted(supers.items())},
        reapGuarded={
            f"layer_{i}": sorted(e for _, li, e in guarded if li == i)
            for i in sorted({li for _, li, _ in guarded})
        },
        layerBudgetTargets=_layer_targets(per_layer),
        taskFamilySlicePriors=_slice_priors(per_layer, inputs.tag_names),
        corpusTags=inputs.tag_names,
        notes=notes,
    )
    if tail_record is not None:
        artifacts["cacheTail"] = tail_record
    doc = {
        "mode": MODE,
        "model": model_name,
        "signalKey": _SIGNAL_KEYS[config.signal],
        "selectionStrategy": SELECTION_STRATEGY,
        "sourceSummaries": _source_summaries(inputs),
        "budget": _budget_section(slots, shape.expert_bytes, config),
        "perLayer": per_layer,
        "fillOrder": fill_order(work),
        "scorerArtifacts": artifacts,
        "summary": _summary(per_layer, work),
    }
    if pricing is not None:
        doc["groupSize"] = pricing.group_size
        doc["budget"].update(grouped_budget_fields(slots, pricing))
        artifacts["grouping"] = {
            **pricing.artifact(),
            "coreGroupFill": {f"layer_{i}": v for i, v in sorted(group_fill.items())},
        }
    return doc


def _fill_core(
    work: dict[int, LayerWork],
    slots: Slots,
    config: PlannerConfig,
    pricing,
    notes: list[str],
    caps: Mapping[int, int] | None = None,
) -> dict[int, list[int]]:
    """The core fill after the forced experts: per expert (today), or in whole groups of b
    (planner_groups); returns the experts added to complete forced experts' groups."""
    uniform = config.layer_allocation == "uniform"
    if pricing is None:
        allocate_core(work, slots.core, uniform, caps)
        return {}
    b = pricing.group_size
    added = round_forced_to_groups(work, b)
    allocate_core_grouped(work, slots.core, uniform, b)
    notes.append(
        f"group size {b} ({pricing.why}): experts priced at {pricing.bytes_per_expert:,.0f} HBM bytes "
        f"(groups of {pricing.group_bytes:,}), core and slices in whole groups"
    )
    return added


def plan_bytes(doc: Mapping[str, Any]) -> bytes:
    """The plan file's bytes: sorted keys, 2-space indent, trailing newline; same doc, same bytes."""
    return orjson.dumps(doc, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2) + b"\n"


# ----------------------------------------------------------------------------- document sections


def _layer_entry(
    w: LayerWork, inputs: PlannerInputs, slots: Slots, config: PlannerConfig, pe: int, have_coact: bool
) -> dict[str, Any]:
    """One perLayer entry: the core with its mass and bytes, the specialist targets, the slice catalog."""
    i = w.index
    rest = [e for e in w.order if e not in w.core]
    affinity = ochiai(w.stats.coactivation, w.stats.expert_frequency) if have_coact else None
    groups = slice_groups(rest, affinity, slots.slice_size) if slots.specialist > 0 and rest else []
    catalog = slice_entries(w, groups, pe, inputs.sources(i), inputs.layer_tags(i), affinity)
    core = sorted(w.core)
    cidx = np.array(core, dtype=np.int64)
    freq_share = share(w.stats.expert_frequency)
    mass_share = share(w.stats.weighted_frequency)
    candidates = min(len(rest), math.ceil(w.specialist * config.candidate_pool_multiplier))
    entry = {
        "rawLayerKey": w.stats.raw_key or str(i),
        "numExperts": w.stats.num_experts,
        "coreExperts": core,
        "coreActivationMass": rounded(freq_share[cidx].sum()) if core else 0.0,
        "coreRawActivationMass": rounded((mass_share if mass_share is not None else freq_share)[cidx].sum())
        if core
        else 0.0,
        "coreByteCost": len(core) * pe,
        "specialistActiveExpertTarget": w.specialist,
        "specialistCandidateExpertTarget": candidates,
        "specialistBudgetBytes": w.specialist * pe,
        "candidateBudgetBytes": candidates * pe,
    }
    if catalog:
        entry["sliceCatalog"] = catalog
    return entry


def _budget_section(slots: Slots, pe: int, config: PlannerConfig) -> dict[str, Any]:
    # the cache tail's caps lowered the core: the fractions as spent (parameters keep the request)
    fraction = (
        rounded(slots.core_bytes / slots.total_bytes)
        if slots.core_capped and slots.total_bytes
        else config.core_fraction
    )
    return {
        "per_expert_bytes": pe,
        "requested_max_resident_ratio": config.budget_ratio,
        "requested_max_resident_gib": config.budget_gib,
        "swappable_expert_budget_bytes": slots.total_bytes,
        "swappable_expert_budget_gib": rounded(slots.total_bytes / GIB),
        "core_budget_bytes": slots.core_bytes,
        "core_budget_gib": rounded(slots.core_bytes / GIB),
        "specialist_budget_bytes": slots.specialist_bytes,
        "specialist_budget_gib": rounded(slots.specialist_bytes / GIB),
        "core_budget_fraction": fraction,
        "specialist_budget_fraction": rounded(1 - fraction),
        "candidate_pool_multiplier": config.candidate_pool_multiplier,
        "max_refreshes_per_request": config.max_refreshes_per_request,
        "total_active_expert_capacity": slots.total_bytes // pe,
    }


def _artifacts(
    inputs: PlannerInputs,
    shape: ModelShape,
    config: PlannerConfig,
    slots: Slots,
    work: Mapping[int, LayerWork],
    per_layer: Mapping[str, Any],
) -> dict[str, Any]:
    """scorerArtifacts up to the per-layer records: how the plan was made, from which inputs."""
    return {
        "planner": "reap_swap.planner",
        "plannerVersion": PLANNER_VERSION,
        "selectionStrategy": SELECTION_STRATEGY,
        "parameters": config.recorded(),
        "inputs": [input_artifact(label, o) for label, o in zip(inputs.labels, inputs.observations)],
        "model": {
            "architecture": shape.architecture,
            "moeLayers": list(shape.moe_layers),
            "numExperts": shape.num_experts,
            "topK": shape.top_k,
            "expertBytes": shape.expert_bytes,
        },
        "slots": {
            "core": slots.core,
            "specialist": slots.specialist,
            "sliceSize": slots.slice_size,
            "coreUsed": sum(len(w.core) for w in work.values()),
            "specialistUsed": sum(w.specialist for w in work.values()),
        },
        "signal": signal_description(config.signal),
    }


def _layer_targets(per_layer: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "coreExpertsPerLayer": {k: len(v["coreExperts"]) for k, v in per_layer.items()},
        "specialistExpertsPerLayer": {k: v["specialistActiveExpertTarget"] for k, v in per_layer.items()},
        "candidateExpertsPerLayer": {k: v["specialistCandidateExpertTarget"] for k, v in per_layer.items()},
    }


def _slice_priors(per_layer: Mapping[str, Any], tag_names: Sequence[str]) -> dict[str, Any]:
    """Per corpus tag and layer, the slice ids ranked by that tag's prior ("global": catalog order)."""
    priors = {"global": {k: [s["sliceId"] for s in v.get("sliceCatalog", [])] for k, v in per_layer.items()}}
    for tag in tag_names:
        priors[tag] = {
            k: [
                s["sliceId"]
                for s in sorted(
                    v.get("sliceCatalog", []),
                    key=lambda s, tag=tag: (-s["taskPriors"].get(tag, 0.0), s["sliceId"]),
                )
            ]
            for k, v in per_layer.items()
        }
    return priors


def _source_summaries(inputs: PlannerInputs) -> list[dict[str, Any]]:
    out = []
    for label, o in zip(inputs.labels, inputs.observations):
        first = o.layers[min(o.layers)]
        item = {
            "label": label,
            "workflow": "reap-swap observe" if o.fmt == "reap-swap" else "reap observer",
            "totalTokens": int(first.total_tokens),
        }
        if isinstance(o.meta.get("records"), int):
            item["processedSamples"] = o.meta["records"]
        out.append(item)
    return out


def _summary(per_layer: Mapping[str, Any], work: Mapping[int, LayerWork]) -> dict[str, Any]:
    resident_pct = [100.0 * (len(w.core) + w.specialist) / w.stats.num_experts for w in work.values()]
    return {
        "layerCount": len(per_layer),
        "totalCoreExperts": sum(len(w.core) for w in work.values()),
        "totalSlices": sum(len(v.get("sliceCatalog", [])) for v in per_layer.values()),
        "residentFractionPctMin": rounded(min(resident_pct)),
        "residentFractionPctMax": rounded(max(resident_pct)),
    }
