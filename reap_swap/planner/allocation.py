"""Who goes into the core and how many specialist slots each layer gets.

Super experts and REAP-guarded experts are forced into the core first; the rest of the core is
filled by value across all layers (or uniformly per layer, the baseline); specialist capacity
goes per layer in whole slices by the routed mass the next slice would add.

With ``cache_tail`` N (``reap-swap plan --cache-tail``) the core leaves every layer N
slots beside it in the device cache's pinned form (core+dlfu: (pool - core) // layers tail slots
per layer): at most budget slots - layers x N core experts in all (``tail_core_limit``), at most
experts - N in a layer (``core_caps``), filled by the same greedy order, so the capped core is the
greedy core's best prefix; the core slots it gives up go to the specialist budget (``cap_core``).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from reap_swap.planner.config import PlannerConfig, PlannerError
from reap_swap.planner.observation_types import LayerStats
from reap_swap.planner.values import layer_values, secondary_values, share, value_order


@dataclass(frozen=True)
class Slots:
    """The byte budget split into core and specialist experts (whole experts per byte budget)."""

    total_bytes: int
    core_bytes: int
    specialist_bytes: int
    core: int
    specialist: int
    slice_size: int
    core_capped: bool = False  # the cache tail's caps lowered the core (cap_core): fractions as spent


def split_budget(
    total_bytes: int, expert_bytes: int, n_layers: int, num_experts: int, config: PlannerConfig
) -> Slots:
    """Core and specialist slots; the core never exceeds every expert of every layer."""
    core_bytes = int(math.floor(total_bytes * config.core_fraction))
    specialist_bytes = total_bytes - core_bytes
    core = min(core_bytes // expert_bytes, n_layers * num_experts)
    specialist = specialist_bytes // expert_bytes
    slice_size = _slice_size(specialist, n_layers, config)
    return Slots(total_bytes, core_bytes, specialist_bytes, core, specialist, slice_size)


def _slice_size(specialist: int, n_layers: int, config: PlannerConfig) -> int:
    return config.slice_size or max(1, math.ceil(specialist / (n_layers * config.slices_per_request)))


def tail_core_limit(total_slots: int, n_layers: int, tail: int) -> int:
    """The most core experts that leave ``tail`` slots per layer beside the core: the device cache's
    pinned form lends (pool - core) // layers tail slots to every layer (cache_tail.
    pinned_tail_split), so that is >= tail exactly when core <= pool - layers x tail."""
    return max(0, int(total_slots) - int(n_layers) * int(tail))


def core_caps(layers: Sequence[int], tail: int, num_experts: int) -> dict[int, int]:
    """Per layer, the most core experts that leave ``tail`` of its experts outside the core (a
    layer's slots, core + tail, cannot exceed its experts: accounting's cache_tail.layer_slots)."""
    return {layer: max(0, int(num_experts) - int(tail)) for layer in sorted(layers)}


def cap_core(slots: Slots, core: int, expert_bytes: int, n_layers: int, config: PlannerConfig) -> Slots:
    """``slots`` with at most ``core`` core experts; the bytes it frees go to the specialists (the
    budget stays spent: core + specialist bytes = the total); unchanged when ``core`` is no lower."""
    if core >= slots.core:
        return slots
    core_bytes = core * expert_bytes
    specialist_bytes = slots.total_bytes - core_bytes
    specialist = specialist_bytes // expert_bytes
    return replace(
        slots,
        core_bytes=core_bytes,
        specialist_bytes=specialist_bytes,
        core=core,
        specialist=specialist,
        slice_size=_slice_size(specialist, n_layers, config),
        core_capped=True,
    )


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
        impact = share(freq * reap)
        for e in np.flatnonzero((freq > 0) & (reap >= multiple * mean) & (reap > 0)):
            out.append((float(impact[e]), i, int(e)))
    return sorted(out, key=lambda t: (-t[0], t[1], t[2]))


@dataclass
class LayerWork:
    """One layer while the planner fills it: values, value order, core so far, specialist slots."""

    index: int
    stats: LayerStats
    values: np.ndarray
    secondary: np.ndarray
    order: list[int]  # value order
    core: set[int] = field(default_factory=set)
    forced: dict[int, str] = field(default_factory=dict)  # expert -> "super" | "reap_guard"
    specialist: int = 0


def layer_work(layers: Mapping[int, LayerStats], signal: str) -> dict[int, LayerWork]:
    """Every layer's values and value order under `signal`, with an empty core."""
    work = {}
    for i, stats in layers.items():
        values = layer_values(stats, signal)
        secondary = secondary_values(stats)
        work[i] = LayerWork(i, stats, values, secondary, value_order(values, secondary))
    return work


def super_experts(layers: Mapping[int, LayerStats], config: PlannerConfig) -> dict[int, list[int]]:
    """The super experts per layer under ``config`` (none with --no-super-experts); build_plan finds
    them once, for the cache tail's caps (tail.tail_caps) and the core (force_super_experts)."""
    if not config.super_experts:
        return {}
    return find_super_experts(layers, config.super_expert_quantile, config.super_expert_max_divisor)


def force_super_experts(
    work: dict[int, LayerWork],
    supers: Mapping[int, list[int]],
    layers: Mapping[int, LayerStats],
    slots: Slots,
    expert_bytes: int,
    notes: list[str],
) -> None:
    """Put the super experts (``super_experts``) into the core; refused when they do not fit it."""
    n_super = sum(len(v) for v in supers.values())
    if n_super > slots.core:
        raise PlannerError(
            f"{n_super} super experts need {n_super * expert_bytes:,} bytes, over the core budget "
            f"of {slots.core * expert_bytes:,} bytes; raise the budget or pass --no-super-experts"
        )
    for i, experts in supers.items():
        for e in experts:
            work[i].core.add(e)
            work[i].forced[e] = "super"
    if not any(s.max_activations is not None for s in layers.values()):
        notes.append("no max_activations in the inputs: super experts not detected")


def force_reap_guarded(
    work: dict[int, LayerWork],
    layers: Mapping[int, LayerStats],
    config: PlannerConfig,
    slots: Slots,
    notes: list[str],
    caps: Mapping[int, int] | None = None,
) -> list[tuple[float, int, int]]:
    """Put REAP-guarded experts into the core, at most reap_guard_max_fraction of its slots (and,
    with ``caps``, none into a layer whose core is at its cap)."""
    guarded: list[tuple[float, int, int]] = []
    if config.reap_guard and any(s.reap is not None for s in layers.values()):
        cap = min(
            int(math.floor(config.reap_guard_max_fraction * slots.core)),
            slots.core - sum(len(w.core) for w in work.values()),
        )
        for impact, i, e in find_reap_guarded(layers, config.reap_guard_multiple):
            if len(guarded) >= cap:
                break
            if e in work[i].core or (caps is not None and len(work[i].core) >= caps[i]):
                continue
            work[i].core.add(e)
            work[i].forced[e] = "reap_guard"
            guarded.append((impact, i, e))
    elif config.reap_guard:
        notes.append("no reap field in the inputs: REAP saliency guard inactive")
    return guarded


def allocate_core(
    work: dict[int, LayerWork], slots: int, uniform: bool, caps: Mapping[int, int] | None = None
) -> None:
    """Fill the core up to `slots` experts in total. Forced experts are already in. ``caps``: layer
    -> the most core experts it may hold (the cache tail's, core_caps); a layer at its cap is
    skipped, so the greedy split goes on in the other layers."""
    used = sum(len(w.core) for w in work.values())
    left = slots - used
    if left <= 0:
        return
    if uniform:
        # baseline: the same count per layer (remainder to the lowest layers), each in value order
        n = len(work)
        for k, w in enumerate(sorted(work.values(), key=lambda w: w.index)):
            want = slots // n + (1 if k < slots % n else 0)
            if caps is not None:
                want = min(want, max(caps[w.index], len(w.core)))
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
    if caps is None:
        for *_, layer, e in items[:left]:
            work[layer].core.add(e)
        return
    for *_, layer, e in items:
        if left <= 0:
            break
        if len(work[layer].core) < caps[layer]:
            work[layer].core.add(e)
            left -= 1


def fill_order(work: dict[int, LayerWork]) -> list[list[int]]:
    """Every non-core expert as [layer, expert], best first, by the key the greedy core fill uses:
    a pool of any size holds the core plus this order's prefix, the greedy core of a larger budget."""
    items = sorted(
        (-w.values[e], -w.secondary[e], rank, w.index, e)
        for w in work.values()
        for rank, e in enumerate(w.order)
        if e not in w.core
    )
    return [[int(layer), int(e)] for *_, layer, e in items]


def allocate_specialists(work: dict[int, LayerWork], slots: int, slice_size: int) -> None:
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
