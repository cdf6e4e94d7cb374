"""Observations -> plan: which experts stay resident per layer, and which fire together.

Pure (numpy only): observations.py turns ``torch.save`` files into the dataclasses below.

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
- **Reproducible.** Every parameter and the SHA-256 of every input file go into
  ``scorerArtifacts``; all orderings have total tie-breaks, so the same inputs give the same bytes.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field, model_validator

from reap_swap.model_shape import ModelShape
from reap_swap.plan import MODE

GIB = 1 << 30
PLANNER_VERSION = 1
SELECTION_STRATEGY = "hit_greedy_v1"
_FLOAT_DIGITS = 8


# ----------------------------------------------------------------------------- observations


@dataclass(frozen=True)
class LayerStats:
    """One MoE layer's router statistics over some tokens. Optional fields are None when absent."""

    total_tokens: int
    expert_frequency: np.ndarray  # [E] int64: routed selections per expert
    weighted_frequency: np.ndarray | None = None  # [E] float64: summed routed gate weight
    coactivation: np.ndarray | None = None  # [E, E] int64: tokens on which both were routed
    reap: np.ndarray | None = None  # [E] REAP saliency (mean over routed tokens of g * ||out||)
    weighted_ean_sum: np.ndarray | None = None  # [E] sum over routed tokens of g * ||out||
    ean_sum: np.ndarray | None = None  # [E] sum over routed tokens of ||out||
    max_activations: np.ndarray | None = None  # [E] largest activation seen (super experts)
    raw_key: str = ""  # the layer's key in the file

    @property
    def num_experts(self) -> int:
        return int(self.expert_frequency.shape[0])


@dataclass(frozen=True)
class RecordCounts:
    """Per-record routed counts (observe --per-request): what per-request evaluation needs."""

    layers: tuple[int, ...]
    counts: np.ndarray  # [R, len(layers), E] routed selections per record, layer, expert
    tags: tuple[str, ...]  # [R]
    tokens: np.ndarray  # [R] prompt tokens per record
    lines: np.ndarray  # [R] corpus line numbers (1-based)


@dataclass(frozen=True)
class Observations:
    """One observation file, converted: all tokens, per corpus tag, optionally per record."""

    label: str  # names this input in sourceSummaries / signalsBySummary (the file's stem)
    digest: str  # sha256 hex of the file's bytes
    layers: Mapping[int, LayerStats]
    tags: Mapping[str, Mapping[int, LayerStats]] = field(default_factory=dict)
    records: RecordCounts | None = None
    fmt: str = "reap"  # "reap" (CerebrasResearch/reap observer) or "reap-swap" (our observe)
    fields: tuple[str, ...] = ()  # field names the file had (first layer)
    meta: Mapping[str, Any] = field(default_factory=dict)


def merge_layer_stats(parts: Sequence[LayerStats]) -> LayerStats:
    """Sum counts over disjoint token sets; REAP's per-routed-token mean is re-weighted by
    frequency; max stays max. A field survives only if every part has it (a partial sum would
    be biased)."""
    first = parts[0]
    sizes = {p.num_experts for p in parts}
    if len(sizes) != 1:
        raise PlannerError(f"layer {first.raw_key!r}: expert counts differ between files: {sorted(sizes)}")

    def total(name: str) -> np.ndarray | None:
        values = [getattr(p, name) for p in parts]
        return None if any(v is None for v in values) else np.sum(values, axis=0)

    freq = np.sum([p.expert_frequency for p in parts], axis=0).astype(np.int64)
    reap = None
    if all(p.reap is not None for p in parts):
        weighted = np.sum([p.reap * p.expert_frequency for p in parts], axis=0)
        reap = np.divide(weighted, freq, out=np.zeros_like(weighted, dtype=np.float64), where=freq > 0)
    max_act = None
    if all(p.max_activations is not None for p in parts):
        max_act = np.max([p.max_activations for p in parts], axis=0)
    return LayerStats(
        total_tokens=sum(p.total_tokens for p in parts),
        expert_frequency=freq,
        weighted_frequency=total("weighted_frequency"),
        coactivation=total("coactivation"),
        reap=reap,
        weighted_ean_sum=total("weighted_ean_sum"),
        ean_sum=total("ean_sum"),
        max_activations=max_act,
        raw_key=first.raw_key,
    )


def merge_layers(maps: Sequence[Mapping[int, LayerStats]]) -> dict[int, LayerStats]:
    """Per layer merge of several files' layer maps; every file must have the same layers."""
    keys = [frozenset(m) for m in maps]
    if len(set(keys)) > 1:
        raise PlannerError(
            "observation files cover different layers: " + "; ".join(str(sorted(k)) for k in keys)
        )
    return {i: merge_layer_stats([m[i] for m in maps]) for i in sorted(keys[0])} if maps else {}


# ----------------------------------------------------------------------------- configuration


class PlannerError(ValueError):
    """The observations and the model or the budget do not admit a plan; the message says why."""


class PlannerConfig(BaseModel):
    """Every knob of the planner; recorded verbatim in scorerArtifacts.parameters."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    budget_ratio: float | None = Field(
        default=None, gt=0, le=1, description="resident budget as a fraction of all expert bytes"
    )
    budget_gib: float | None = Field(default=None, gt=0, description="resident budget in GiB")
    core_fraction: float = Field(default=0.75, ge=0, le=1)
    signal: Literal["frequency", "router_mass", "reap"] = "frequency"
    layer_allocation: Literal["greedy", "uniform"] = "greedy"
    slices_per_request: int = Field(default=2, ge=1, description="slices a request may add per layer")
    slice_size: int | None = Field(default=None, ge=1, description="experts per slice; default derived")
    candidate_pool_multiplier: float = Field(default=1.25, ge=1)
    reap_guard: bool = True
    reap_guard_multiple: float = Field(default=2.0, gt=0)
    reap_guard_max_fraction: float = Field(default=0.1, ge=0, le=1)
    super_experts: bool = True
    super_expert_quantile: float = Field(default=99.5, gt=0, le=100)
    super_expert_max_divisor: float = Field(default=10.0, ge=1)
    max_refreshes_per_request: int = Field(default=1, ge=0)

    @model_validator(mode="after")
    def _one_budget(self) -> PlannerConfig:
        if (self.budget_ratio is None) == (self.budget_gib is None):
            raise ValueError("give exactly one of budget_ratio and budget_gib")
        return self


# ----------------------------------------------------------------------------- helpers


def _r(x: float) -> float:
    """Rounded float: stable, short JSON."""
    return round(float(x), _FLOAT_DIGITS)


def _share(values: np.ndarray | None) -> np.ndarray | None:
    if values is None:
        return None
    values = np.asarray(values, dtype=np.float64)
    s = values.sum()
    return values / s if s > 0 else np.zeros_like(values)


def layer_values(stats: LayerStats, signal: str) -> np.ndarray:
    """Per-expert value in [0, 1], summing to 1 over the layer (0 everywhere if nothing routed)."""
    if signal == "frequency":
        return _share(stats.expert_frequency)
    if signal == "router_mass":
        if stats.weighted_frequency is None:
            raise PlannerError(
                f"signal router_mass needs weighted_expert_frequency_sum (missing in layer {stats.raw_key!r})"
            )
        return _share(stats.weighted_frequency)
    if stats.reap is None:
        raise PlannerError(f"signal reap needs REAP's 'reap' field (missing in layer {stats.raw_key!r})")
    return _share(np.maximum(stats.reap, 0.0))


def _order(values: np.ndarray, secondary: np.ndarray) -> list[int]:
    """Experts by value desc, then secondary desc, then id asc: a total, reproducible order."""
    n = len(values)
    return sorted(range(n), key=lambda e: (-values[e], -secondary[e], e))


def find_super_experts(
    layers: Mapping[int, LayerStats], quantile: float, max_divisor: float
) -> dict[int, list[int]]:
    """Outliers of max_activations over all layers: above the quantile and above global max / divisor."""
    have = {i: s.max_activations for i, s in layers.items() if s.max_activations is not None}
    if not have:
        return {}
    flat = np.concatenate([np.asarray(v, dtype=np.float64) for v in have.values()])
    threshold = max(float(np.quantile(flat, quantile / 100.0)), float(flat.max()) / max_divisor)
    out = {i: [int(e) for e in np.flatnonzero(np.asarray(v) > threshold)] for i, v in have.items()}
    return {i: e for i, e in out.items() if e}


def find_reap_guarded(layers: Mapping[int, LayerStats], multiple: float) -> list[tuple[float, int, int]]:
    """(impact share, layer, expert) for routed experts whose REAP saliency is >= multiple x the
    layer's routed-mean saliency. Impact share = freq x reap over the layer's sum: what losing it costs."""
    out = []
    for i, s in layers.items():
        if s.reap is None:
            continue
        freq = s.expert_frequency.astype(np.float64)
        reap = np.maximum(np.asarray(s.reap, dtype=np.float64), 0.0)
        if freq.sum() <= 0:
            continue
        mean = float((freq * reap).sum() / freq.sum())
        impact = _share(freq * reap)
        for e in np.flatnonzero((freq > 0) & (reap >= multiple * mean) & (reap > 0)):
            out.append((float(impact[e]), i, int(e)))
    return sorted(out, key=lambda t: (-t[0], t[1], t[2]))


# ----------------------------------------------------------------------------- allocation


@dataclass
class _LayerWork:
    index: int
    stats: LayerStats
    values: np.ndarray
    secondary: np.ndarray
    order: list[int]  # value order
    core: set[int] = field(default_factory=set)
    forced: dict[int, str] = field(default_factory=dict)  # expert -> "super" | "reap_guard"
    specialist: int = 0


def _allocate_core(work: dict[int, _LayerWork], slots: int, uniform: bool) -> None:
    """Fill the core up to `slots` experts in total. Forced experts are already in."""
    used = sum(len(w.core) for w in work.values())
    left = slots - used
    if left <= 0:
        return
    if uniform:
        # baseline: the same count per layer (remainder to the lowest layers), each in value order
        n = len(work)
        for k, w in enumerate(sorted(work.values(), key=lambda w: w.index)):
            want = slots // n + (1 if k < slots % n else 0)
            for e in w.order:
                if len(w.core) >= want or left <= 0:
                    break
                if e not in w.core:
                    w.core.add(e)
                    left -= 1
        return
    items = []
    for w in work.values():
        for rank, e in enumerate(w.order):
            if e not in w.core:
                items.append((-w.values[e], -w.secondary[e], rank, w.index, e))
    items.sort()
    for *_, layer, e in items[:left]:
        work[layer].core.add(e)


def _allocate_specialists(work: dict[int, _LayerWork], slots: int, slice_size: int) -> None:
    """Per-layer specialist capacity, in whole slices, by the mass the next slice would add."""
    heap: list[tuple[float, int, int, int]] = []
    rest: dict[int, list[int]] = {}
    for w in work.values():
        rest[w.index] = [e for e in w.order if e not in w.core]

    def push(layer: int, unit: int) -> None:
        group = rest[layer][unit * slice_size : (unit + 1) * slice_size]
        if group:
            gain = float(sum(work[layer].values[e] for e in group))
            heapq.heappush(heap, (-gain, layer, unit, len(group)))

    for layer in sorted(work):
        push(layer, 0)
    left = slots
    while heap and left > 0:
        _, layer, unit, cost = heapq.heappop(heap)
        if cost > left:
            continue  # this layer's next slice no longer fits; smaller ones elsewhere may
        work[layer].specialist += cost
        left -= cost
        push(layer, unit + 1)


# ----------------------------------------------------------------------------- slices


def _ochiai(coact: np.ndarray, freq: np.ndarray) -> np.ndarray:
    """C_ij / sqrt(f_i f_j): 1 when two experts are always routed together, 0 when never."""
    coact = np.asarray(coact, dtype=np.float64)
    denom = np.sqrt(np.outer(freq, freq).astype(np.float64))
    out = np.divide(coact, denom, out=np.zeros_like(coact), where=denom > 0)
    np.fill_diagonal(out, 0.0)
    return out


def group_by_coactivation(experts: list[int], affinity: np.ndarray, size: int) -> list[list[int]]:
    """Greedy groups of `size`: seed = first unassigned expert (callers pass value order), then add
    the unassigned expert with the highest mean affinity to the group (ties: earlier in `experts`)."""
    left = list(experts)
    groups = []
    while left:
        group = [left.pop(0)]
        while left and len(group) < size:
            scores = affinity[np.ix_(left, group)].mean(axis=1)
            best = int(np.argmax(scores))  # argmax returns the first maximum: earlier wins ties
            group.append(left.pop(best))
        groups.append(group)
    return groups


def _slice_entries(
    w: _LayerWork,
    groups: list[list[int]],
    pe: int,
    sources: Sequence[tuple[str, LayerStats]],
    tags: Mapping[str, LayerStats],
    affinity: np.ndarray | None,
) -> list[dict]:
    s = w.stats
    freq_share = _share(s.expert_frequency)
    mass_share = _share(s.weighted_frequency)
    reap_share = _share(np.maximum(s.reap, 0.0)) if s.reap is not None else None
    source_shares = [(label, _share(st.expert_frequency)) for label, st in sources]
    tag_shares = {tag: _share(st.expert_frequency) for tag, st in sorted(tags.items())}
    entries = []
    for group in groups:
        experts = sorted(group)
        idx = np.array(experts)
        entry: dict[str, Any] = {
            "experts": experts,
            "byteCost": len(experts) * pe,
            "activationMass": _r(freq_share[idx].sum()),
            "rawActivationMass": _r((mass_share if mass_share is not None else freq_share)[idx].sum()),
            "expertFrequencyMass": _r(s.expert_frequency[idx].sum()),
        }
        if reap_share is not None:
            entry["reapMass"] = _r(reap_share[idx].sum())
        if s.weighted_ean_sum is not None:
            entry["weightedEanMass"] = _r(np.asarray(s.weighted_ean_sum)[idx].sum())
        if affinity is not None and len(experts) > 1:
            pairs = affinity[np.ix_(idx, idx)]
            entry["coactivationScore"] = _r(pairs.sum() / (len(experts) * (len(experts) - 1)))
        entry["signalsBySummary"] = {label: _r(share[idx].sum()) for label, share in source_shares}
        priors = {"global": entry["activationMass"]}
        priors.update({tag: _r(share[idx].sum()) for tag, share in tag_shares.items()})
        entry["taskPriors"] = priors
        entries.append(entry)
    # catalog order: most routed mass first; ids follow the order
    entries.sort(key=lambda x: (-x["activationMass"], x["experts"][0]))
    width = max(2, len(str(len(entries) - 1)))
    for n, entry in enumerate(entries):
        entry["sliceId"] = f"layer_{w.index}_slice_{n:0{width}d}"
    return entries


# ----------------------------------------------------------------------------- entry points


def budget_bytes(shape: ModelShape, config: PlannerConfig) -> int:
    total = shape.total_expert_bytes
    if config.budget_ratio is not None:
        return int(math.floor(config.budget_ratio * total))
    return int(math.floor(config.budget_gib * GIB))


def build_plan(
    observations: Sequence[Observations], shape: ModelShape, config: PlannerConfig, model_name: str
) -> dict:
    """The plan document (a dict that passes reap_swap.plan.validate_plan_document for `shape`)."""
    if not observations:
        raise PlannerError("no observation files given")
    digests = [o.digest for o in observations]
    if len(set(digests)) != len(digests):
        raise PlannerError(
            "the same observation file is given twice (equal sha256): it would be counted twice"
        )
    layers = merge_layers([o.layers for o in observations])
    _check_shape(layers, shape)
    labels = _unique_labels([o.label for o in observations])
    tag_names = sorted({t for o in observations for t in o.tags})
    tags = {t: merge_layers([o.tags[t] for o in observations if t in o.tags]) for t in tag_names}

    pe = shape.expert_bytes
    total_bytes = budget_bytes(shape, config)
    core_bytes_budget = int(math.floor(total_bytes * config.core_fraction))
    specialist_bytes_budget = total_bytes - core_bytes_budget
    core_slots = core_bytes_budget // pe
    specialist_slots = specialist_bytes_budget // pe
    n_layers = len(layers)
    if core_slots > n_layers * shape.num_experts:
        core_slots = n_layers * shape.num_experts

    work: dict[int, _LayerWork] = {}
    for i, stats in layers.items():
        values = layer_values(stats, config.signal)
        secondary = _secondary(stats)
        work[i] = _LayerWork(i, stats, values, secondary, _order(values, secondary))

    notes: list[str] = []
    supers: dict[int, list[int]] = {}
    if config.super_experts:
        supers = find_super_experts(layers, config.super_expert_quantile, config.super_expert_max_divisor)
        n_super = sum(len(v) for v in supers.values())
        if n_super > core_slots:
            raise PlannerError(
                f"{n_super} super experts need {n_super * pe:,} bytes, over the core budget "
                f"of {core_slots * pe:,} bytes; raise the budget or pass --no-super-experts"
            )
        for i, experts in supers.items():
            for e in experts:
                work[i].core.add(e)
                work[i].forced[e] = "super"
    if not any(s.max_activations is not None for s in layers.values()):
        notes.append("no max_activations in the inputs: super experts not detected")

    guarded: list[tuple[float, int, int]] = []
    if config.reap_guard and any(s.reap is not None for s in layers.values()):
        cap = min(
            int(math.floor(config.reap_guard_max_fraction * core_slots)),
            core_slots - sum(len(w.core) for w in work.values()),
        )
        for impact, i, e in find_reap_guarded(layers, config.reap_guard_multiple):
            if len(guarded) >= cap:
                break
            if e in work[i].core:
                continue
            work[i].core.add(e)
            work[i].forced[e] = "reap_guard"
            guarded.append((impact, i, e))
    elif config.reap_guard:
        notes.append("no reap field in the inputs: REAP saliency guard inactive")

    _allocate_core(work, core_slots, config.layer_allocation == "uniform")

    slice_size = config.slice_size or max(
        1, math.ceil(specialist_slots / (n_layers * config.slices_per_request))
    )
    if specialist_slots > 0:
        _allocate_specialists(work, specialist_slots, slice_size)

    have_coact = all(s.coactivation is not None for s in layers.values())
    slice_method = "coactivation_greedy_ochiai" if have_coact else "frequency_rank_buckets"
    if not have_coact:
        notes.append(
            "no true co-activation in the inputs (REAP's pairwise_expert_frequency is "
            "freq[i] + freq[j]): slices are consecutive experts in value order"
        )

    per_layer: dict[str, Any] = {}
    for i, w in sorted(work.items()):
        rest = [e for e in w.order if e not in w.core]
        affinity = _ochiai(w.stats.coactivation, w.stats.expert_frequency) if have_coact else None
        groups: list[list[int]] = []
        if specialist_slots > 0 and rest:
            if affinity is not None:
                groups = group_by_coactivation(rest, affinity, slice_size)
            else:
                groups = [rest[k : k + slice_size] for k in range(0, len(rest), slice_size)]
        sources = [(label, o.layers[i]) for label, o in zip(labels, observations)]
        catalog = _slice_entries(
            w, groups, pe, sources, {t: tags[t][i] for t in tag_names if i in tags[t]}, affinity
        )
        core = sorted(w.core)
        cidx = np.array(core, dtype=np.int64)
        freq_share = _share(w.stats.expert_frequency)
        mass_share = _share(w.stats.weighted_frequency)
        candidates = min(len(rest), math.ceil(w.specialist * config.candidate_pool_multiplier))
        entry = {
            "rawLayerKey": w.stats.raw_key or str(i),
            "numExperts": w.stats.num_experts,
            "coreExperts": core,
            "coreActivationMass": _r(freq_share[cidx].sum()) if core else 0.0,
            "coreRawActivationMass": _r((mass_share if mass_share is not None else freq_share)[cidx].sum())
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
        per_layer[f"layer_{i}"] = entry

    total_core = sum(len(w.core) for w in work.values())
    resident_pct = [100.0 * (len(w.core) + w.specialist) / w.stats.num_experts for w in work.values()]
    budget = {
        "per_expert_bytes": pe,
        "requested_max_resident_ratio": config.budget_ratio,
        "requested_max_resident_gib": config.budget_gib,
        "swappable_expert_budget_bytes": total_bytes,
        "swappable_expert_budget_gib": _r(total_bytes / GIB),
        "core_budget_bytes": core_bytes_budget,
        "core_budget_gib": _r(core_bytes_budget / GIB),
        "specialist_budget_bytes": specialist_bytes_budget,
        "specialist_budget_gib": _r(specialist_bytes_budget / GIB),
        "core_budget_fraction": config.core_fraction,
        "specialist_budget_fraction": _r(1 - config.core_fraction),
        "candidate_pool_multiplier": config.candidate_pool_multiplier,
        "max_refreshes_per_request": config.max_refreshes_per_request,
        "total_active_expert_capacity": total_bytes // pe,
    }
    layer_keys = [f"layer_{i}" for i in sorted(work)]
    slice_priors = {
        "global": {k: [s["sliceId"] for s in per_layer[k].get("sliceCatalog", [])] for k in layer_keys}
    }
    for tag in tag_names:
        slice_priors[tag] = {
            k: [
                s["sliceId"]
                for s in sorted(
                    per_layer[k].get("sliceCatalog", []),
                    key=lambda s: (-s["taskPriors"].get(tag, 0.0), s["sliceId"]),
                )
            ]
            for k in layer_keys
        }
    artifacts = {
        "planner": "reap_swap.planner",
        "plannerVersion": PLANNER_VERSION,
        "selectionStrategy": SELECTION_STRATEGY,
        "parameters": config.model_dump(mode="json"),
        "inputs": [_input_artifact(label, o) for label, o in zip(labels, observations)],
        "model": {
            "architecture": shape.architecture,
            "moeLayers": list(shape.moe_layers),
            "numExperts": shape.num_experts,
            "topK": shape.top_k,
            "expertBytes": pe,
        },
        "slots": {
            "core": core_slots,
            "specialist": specialist_slots,
            "sliceSize": slice_size,
            "coreUsed": total_core,
            "specialistUsed": sum(w.specialist for w in work.values()),
        },
        "signal": _signal_description(config.signal),
        "sliceMethod": slice_method,
        "superExperts": {f"layer_{i}": v for i, v in sorted(supers.items())},
        "reapGuarded": {
            f"layer_{i}": sorted(e for _, li, e in guarded if li == i)
            for i in sorted({li for _, li, _ in guarded})
        },
        "layerBudgetTargets": {
            "coreExpertsPerLayer": {k: len(per_layer[k]["coreExperts"]) for k in layer_keys},
            "specialistExpertsPerLayer": {
                k: per_layer[k]["specialistActiveExpertTarget"] for k in layer_keys
            },
            "candidateExpertsPerLayer": {
                k: per_layer[k]["specialistCandidateExpertTarget"] for k in layer_keys
            },
        },
        "taskFamilySlicePriors": slice_priors,
        "corpusTags": tag_names,
        "notes": notes,
    }
    source_summaries = []
    for label, o in zip(labels, observations):
        first = o.layers[min(o.layers)]
        item = {
            "label": label,
            "workflow": "reap-swap observe" if o.fmt == "reap-swap" else "reap observer",
            "totalTokens": int(first.total_tokens),
        }
        if isinstance(o.meta.get("records"), int):
            item["processedSamples"] = o.meta["records"]
        source_summaries.append(item)
    return {
        "mode": MODE,
        "model": model_name,
        "signalKey": {
            "frequency": "expert_frequency",
            "router_mass": "weighted_expert_frequency_sum",
            "reap": "reap",
        }[config.signal],
        "selectionStrategy": SELECTION_STRATEGY,
        "sourceSummaries": source_summaries,
        "budget": budget,
        "perLayer": per_layer,
        "scorerArtifacts": artifacts,
        "summary": {
            "layerCount": len(per_layer),
            "totalCoreExperts": total_core,
            "totalSlices": sum(len(v.get("sliceCatalog", [])) for v in per_layer.values()),
            "residentFractionPctMin": _r(min(resident_pct)),
            "residentFractionPctMax": _r(max(resident_pct)),
        },
    }


def plan_bytes(doc: Mapping[str, Any]) -> bytes:
    """The plan file's bytes: sorted keys, 2-space indent, trailing newline; same doc, same bytes."""
    return orjson.dumps(doc, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2) + b"\n"


def _secondary(stats: LayerStats) -> np.ndarray:
    """Tie-breaker after the value: router mass, else REAP impact, else zeros."""
    if stats.weighted_frequency is not None:
        return _share(stats.weighted_frequency)
    if stats.weighted_ean_sum is not None:
        return _share(stats.weighted_ean_sum)
    return np.zeros(stats.num_experts)


def _signal_description(signal: str) -> str:
    return {
        "frequency": "expert_frequency / layer total (share of routed selections)",
        "router_mass": "weighted_expert_frequency_sum / layer total (share of routed gate weight)",
        "reap": "reap / layer sum (REAP saliency share; a baseline, not a hit-rate signal)",
    }[signal]


def _check_shape(layers: Mapping[int, LayerStats], shape: ModelShape) -> None:
    missing = sorted(set(shape.moe_layers) - set(layers))
    extra = sorted(set(layers) - set(shape.moe_layers))
    if missing or extra:
        raise PlannerError(
            f"observations cover layers {sorted(layers)}, model {shape.architecture} has "
            f"MoE layers {list(shape.moe_layers)}"
            + (f"; missing {missing}" if missing else "")
            + (f"; not MoE: {extra}" if extra else "")
        )
    for i, s in layers.items():
        if s.num_experts != shape.num_experts:
            raise PlannerError(
                f"layer {i}: observations have {s.num_experts} experts, model has {shape.num_experts}"
            )


def _unique_labels(labels: Sequence[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        n = seen.get(label, 0)
        seen[label] = n + 1
        out.append(label if n == 0 else f"{label}#{n + 1}")
    return out


def _input_artifact(label: str, o: Observations) -> dict:
    first = o.layers[min(o.layers)]
    return {
        "label": label,
        "sha256": o.digest,
        "format": o.fmt,
        "fields": list(o.fields),
        "layers": len(o.layers),
        "totalTokens": int(first.total_tokens),
        "tags": sorted(o.tags),
        "records": o.records.counts.shape[0] if o.records is not None else 0,
    }
