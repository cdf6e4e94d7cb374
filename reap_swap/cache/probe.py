"""The client's per-request probe sets as the simulator replays them, and the bench's
``plan-swap+cache`` split they are selected within. The ``probe`` policies pin, at each request's
prefill, the plan core plus the slices reap_swap.client.selection's ``probe`` takes; the servable
form (``probe+core+dlfu-split``) must also leave those swaps the swap table the bench's arm leaves
beside the cache tail (sizing/cache_tail.py's plan_swap_split), or the simulator would count a
cache no server runs. replay.py runs the policies on these sets.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from reap_swap.cache.hybrid import SPLIT
from reap_swap.cache.trace import Trace
from reap_swap.client.selection import select_probe
from reap_swap.plan.document import Plan
from reap_swap.sizing.cache_tail import plan_swap_split


def _probe_sets(
    plan: Plan, trace: Trace, counts: Mapping[int, object], budget_bytes: int, slots: Mapping[int, int]
) -> dict[int, dict[int, frozenset[int]]]:
    """Per layer: request's prefill step -> core + the slices reap_swap.client.selection's ``probe`` takes
    from the misses of that prefill with only the core resident, cut to the layer's slots (slices
    in the order the selection took them). No prompt text is in a trace: the prior fill uses the
    plan's global prior."""
    out: dict[int, dict[int, frozenset[int]]] = {l: {} for l in trace.layers}
    for first in trace.request_first_steps():
        misses = {}
        for l in trace.layers:
            row = counts[l][first]
            total = int(row.sum())
            core = plan.layers[l].core
            misses[l] = {e: int(c) / total for e, c in enumerate(row) if c and e not in core}
        chosen = select_probe(plan, misses, "", budget_bytes=budget_bytes)
        for l in trace.layers:
            keep = set(plan.layers[l].core)
            for sid in chosen.slices.get(l, ()):
                experts = set(plan.layers[l].slice_by_id[sid].experts)
                if len(keep | experts) <= slots[l]:
                    keep |= experts
            out[l][int(first)] = frozenset(keep)
    return out


@dataclass(frozen=True)
class SplitLayout:
    """The bench's ``plan-swap+cache`` (bench_arms._split_for_swaps) on a budget: the pool's slots,
    ``--reap-cache-slots tail_per_layer x layers`` and the swap table K that leaves, the client's
    selection budget. Each layer starts with its core + the tail (``slots``)."""

    pool: int
    core: int
    tail_per_layer: int
    swap_slots: int  # K = pool - layers x tail_per_layer
    slots: dict[int, int]

    def to_dict(self) -> dict:
        return {
            "pool": self.pool,
            "core": self.core,
            "tail_per_layer": self.tail_per_layer,
            "reap_cache_slots": self.tail_per_layer * len(self.slots),
            "swap_slots": self.swap_slots,
        }


def servable_split(plan: Plan, trace: Trace, budget_bytes: int) -> tuple[SplitLayout | None, str | None]:
    """(the layout, None) or (None, why not): cache_tail.plan_swap_split on the budget's pool, the
    plan core and the model's top_k, as the bench computes it for ``plan-swap+cache``. The bench
    splits over every plan layer: a trace that leaves plan layers out is refused, not guessed."""
    if set(plan.layers) != set(trace.layers):
        return None, (
            f"{SPLIT}: the plan has layers {sorted(plan.layers)}, the trace {list(trace.layers)}; the "
            "bench splits the pool over every plan layer"
        )
    split = plan_swap_split(plan, trace.top_k, budget_bytes)
    if split.why:
        return None, f"plan-swap+cache (the bench skips the arm): {split.why}"
    slots = {l: min(trace.num_experts, len(plan.layers[l].core) + split.per_layer) for l in trace.layers}
    return SplitLayout(split.pool, split.core, split.per_layer, split.kept, slots), None


def split_probe_sets(plan: Plan, trace: Trace, counts: Mapping[int, object], layout: SplitLayout):
    """The client's per-request sets under ``plan-swap+cache``: ``probe`` selected within the swap
    table (budget_bytes = K x per_expert_bytes, RunSpec.swap_budget_bytes), no per-layer cut (the
    client has none; the swap table is shared by the layers). Raises SelectionError."""
    every = {l: trace.num_experts for l in trace.layers}
    return _probe_sets(plan, trace, counts, layout.swap_slots * trace.per_expert_bytes, every)
