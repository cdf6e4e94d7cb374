"""Replay a trace under every (budget, policy): budgets, the policies by name (per-layer slots:
sizing/cache_tail.py's layer_slots; the client's probe sets and the plan-swap+cache split they
replay: probe.py)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

from reap_swap.cache.belady import Belady, BeladyAdmit
from reap_swap.cache.device import DLFU
from reap_swap.cache.hybrid import SPLIT, TAILS, DevicePinned, SwapPinned, swap_points
from reap_swap.cache.learned import DLearn, fit_layer
from reap_swap.cache.mechanism import LayerCounts, LayerSteps, replay_layer
from reap_swap.cache.online import LFRU, LFU, LFU_DECAY, LRU, PerRequest, Static
from reap_swap.cache.prior import MARKOV_WEIGHT, DLFUAdmit, DLFUMarkov, transition_table
from reap_swap.cache.probe import _probe_sets, servable_split, split_probe_sets
from reap_swap.cache.trace import Trace
from reap_swap.client.selection import SelectionError
from reap_swap.plan.document import Plan
from reap_swap.sizing.cache_tail import layer_slots

POLICIES = (
    "static",
    "probe",
    "lru",
    "lru-seeded",
    "lfu",
    "lfu-seeded",
    "lfru",
    "lfru-seeded",
    "core+lru",
    "core+lfu",
    "core+lfru",
    "dlfu",
    "dlfu-seeded",
    "core+dlfu",
    "dlfu-admit-seeded",
    "dlfu-markov-seeded",
    "dlearn-seeded",
    "probe+lfu",
    "probe+dlfu",
    "probe+core+dlfu",
    SPLIT,
    "belady",
    "belady-admit",
)
PROBE_POLICIES = frozenset({"probe", *TAILS})  # need the client's per-request probe sets
PRIOR_POLICIES = frozenset(
    {"dlfu-markov-seeded", "dlearn-seeded"}
)  # need a calibration routing trace (--prior-trace)
PLAN_POLICIES = frozenset(p for p in POLICIES if p in ("static", "probe") or "seeded" in p or "+" in p)
ALLOCATIONS = ("core+tail", "uniform")
_SIZE = re.compile(r"^\s*([0-9.]+)\s*(GiB|MiB|KiB|B)\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


class SimulationError(ValueError):
    """Inputs that cannot be simulated together (the message names the argument)."""


@dataclass(frozen=True)
class Budget:
    label: str  # as given: "0.25" or "1.5GiB"
    bytes: int
    fraction: float  # of all the trace's expert bytes


def parse_budget(text: str, total_expert_bytes: int) -> Budget:
    """``0.25`` = a fraction of all expert bytes; ``1.5GiB`` / ``512MiB`` / ``73728B`` = bytes."""
    m = _SIZE.match(text)
    try:
        if m:
            size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
        else:
            frac = float(text)
            if not 0.0 < frac <= 1.0:
                raise SimulationError(f"--budget {text}: a fraction must be in (0, 1]")
            size = int(frac * total_expert_bytes)
    except ValueError as exc:
        if isinstance(exc, SimulationError):
            raise
        raise SimulationError(f"--budget {text}: not a fraction (0.25) or a size (1.5GiB)") from exc
    return Budget(text.strip(), size, size / total_expert_bytes)


def _factory(name: str, core: frozenset[int], lfu_decay: float) -> Callable[[], object]:
    base, _, seeded = name.partition("-")
    pinned = base.startswith("core+")
    kind = base.removeprefix("core+")
    cls = {"lru": LRU, "lfu": LFU, "lfru": LFRU, "dlfu": DLFU}[kind]
    seed = core if (seeded or pinned) else frozenset()
    kwargs = {"decay": lfu_decay} if cls in (LFU, DLFU) else {}
    return lambda: cls(name, seed=seed, pinned=core if pinned else frozenset(), **kwargs)


def check_inputs(trace: Trace, plan: Plan | None) -> None:
    """The plan must describe the trace's model: every trace layer, the same experts and bytes."""
    if plan is None:
        return
    missing = [l for l in trace.layers if l not in plan.layers]
    if missing:
        raise SimulationError(f"--plan: layers {missing} of the trace are not in the plan")
    wrong = [l for l in trace.layers if plan.layers[l].num_experts != trace.num_experts]
    if wrong:
        raise SimulationError(
            f"--plan: layer {wrong[0]} has {plan.layers[wrong[0]].num_experts} experts, trace {trace.num_experts}"
        )
    if plan.per_expert_bytes != trace.per_expert_bytes:
        raise SimulationError(
            f"--plan: per_expert_bytes {plan.per_expert_bytes} != the trace's {trace.per_expert_bytes}"
        )


def _refusal(name, plan, slots, layers, tables) -> str | None:
    if name not in PLAN_POLICIES:
        return None
    if plan is None:
        return "needs --plan (uses the plan's core)"
    for l in layers:
        if len(plan.layers[l].core) > slots[l]:
            return f"layer {l}: the plan's core ({len(plan.layers[l].core)} experts) exceeds its {slots[l]} slots"
    if name in PRIOR_POLICIES and tables is None:
        return "needs --prior-trace (a calibration routing trace of the same model: its transition table)"
    return None


def _policy(name, l, plan, probe_sets, lfu_decay, tables=None):
    core = plan.layers[l].core if plan is not None else frozenset()
    if name == "dlfu-admit-seeded":
        return DLFUAdmit(name, seed=core, decay=lfu_decay)
    if name == "dlfu-markov-seeded":
        return DLFUMarkov(name, tables[l].markov, seed=core, decay=lfu_decay)
    if name == "dlearn-seeded":
        return DLearn(name, tables[l].learned, seed=core)
    if name == "static":
        return Static(core)
    if name == "probe":
        return PerRequest(core, probe_sets[l])
    if name == SPLIT:  # the device's pinned form, the tail n = the layer's slots - core (split)
        return DevicePinned(name, _factory("core+dlfu", core, lfu_decay)(), probe_sets[l])
    if name in TAILS:  # probe_sets here: only the request starts where the worker pins
        wrap = DevicePinned if TAILS[name].startswith("core+") else SwapPinned
        return wrap(name, _factory(TAILS[name], core, lfu_decay)(), probe_sets[l])
    if name == "belady":
        return Belady()
    if name == "belady-admit":
        return BeladyAdmit()
    return _factory(name, core, lfu_decay)()


def _run_policy(name, trace, plan, steps, slots, probe_sets, lfu_decay, tables) -> dict:
    per_layer, total = {}, LayerCounts()
    if name in TAILS or name == SPLIT:
        points = swap_points(probe_sets, {l: plan.layers[l].core for l in trace.layers})
        probe_sets = {l: {t: probe_sets[l][t] for t in points} for l in trace.layers}
    for l in trace.layers:
        c = replay_layer(_policy(name, l, plan, probe_sets, lfu_decay, tables), steps[l], slots[l])
        per_layer[str(l)] = c.to_dict(trace.per_expert_bytes)
        total.add(c)
    return {"totals": total.to_dict(trace.per_expert_bytes), "layers": per_layer}


def simulate(
    trace: Trace,
    plan: Plan | None,
    budgets: Sequence[str],
    policies: Sequence[str] = POLICIES,
    *,
    allocation: str = "core+tail",
    lfu_decay: float = LFU_DECAY,
    prior_trace: Trace | None = None,
    markov_weight: float = MARKOV_WEIGHT,
) -> dict:
    """Every budget x policy on the trace -> a JSON-able report (rows in budget, policy order).
    ``prior_trace``: a calibration routing trace of the same model (never the trace replayed),
    the source of ``dlfu-markov-seeded``'s transition tables."""
    check_inputs(trace, plan)
    tables = _prior_tables(trace, prior_trace, markov_weight)
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise SimulationError(f"--policy {unknown[0]}: choose from {', '.join(POLICIES)}")
    total_bytes = len(trace.layers) * trace.num_experts * trace.per_expert_bytes
    core = {l: plan.layers[l].core for l in trace.layers} if plan is not None else None
    counts = {l: trace.step_counts(l) for l in trace.layers}
    starts = trace.request_first_steps()
    steps = {l: LayerSteps.from_counts(l, counts[l], starts) for l in trace.layers}
    rows = []
    for text in budgets:
        budget = parse_budget(text, total_bytes)
        total_slots = budget.bytes // trace.per_expert_bytes
        if allocation not in ALLOCATIONS:
            raise SimulationError(f"--layer-slots {allocation}: choose one of {', '.join(ALLOCATIONS)}")
        slots, how = layer_slots(total_slots, trace.layers, core, allocation, trace.num_experts)
        probe_sets, probe_error = None, None
        for name in policies:
            row = {
                "budget": budget.label,
                "budget_bytes": budget.bytes,
                "budget_fraction": budget.fraction,
                "slots": {str(l): s for l, s in slots.items()},
                "allocation": how,
                "policy": name,
            }
            reason = _refusal(name, plan, slots, trace.layers, tables)
            if name in PROBE_POLICIES and reason is None and probe_sets is None and probe_error is None:
                try:
                    probe_sets = _probe_sets(plan, trace, counts, budget.bytes, slots)
                except SelectionError as exc:
                    probe_error = f"selection refused: {exc}"
            reason = reason or (probe_error if name in PROBE_POLICIES else None)
            run_slots, run_sets = slots, probe_sets
            if name == SPLIT and reason is None:
                layout, reason = servable_split(plan, trace, budget.bytes)
                if layout is not None:
                    row["split"] = layout.to_dict()
                    row["slots"] = {str(l): s for l, s in layout.slots.items()}
                    run_slots = layout.slots
                    try:
                        run_sets = split_probe_sets(plan, trace, counts, layout)
                    except SelectionError as exc:
                        reason = f"selection refused: {exc}"
            if reason:
                rows.append({**row, "status": "refused", "reason": reason})
                continue
            rows.append(
                {
                    **row,
                    "status": "ok",
                    **_run_policy(name, trace, plan, steps, run_slots, run_sets, lfu_decay, tables),
                }
            )
    prior = None if prior_trace is None else {**trace_summary(prior_trace), "markov_weight": markov_weight}
    return {
        "trace": trace_summary(trace),
        "plan": _plan_summary(plan),
        "lfu_decay": lfu_decay,
        "prior_trace": prior,
        "rows": rows,
    }


def _prior_tables(trace: Trace, prior: Trace | None, weight: float) -> dict[int, object] | None:
    """Per layer: the transition table of the prior trace (refused unless it has the same model)."""
    if prior is None:
        return None
    if prior.num_experts != trace.num_experts or not set(trace.layers) <= set(prior.layers):
        raise SimulationError(
            f"--prior-trace: {prior.num_experts} experts, layers {list(prior.layers)}; the trace has "
            f"{trace.num_experts} experts, layers {list(trace.layers)}"
        )
    if weight < 0:
        raise SimulationError(f"--markov-weight {weight}: must be >= 0")
    starts = prior.request_first_steps()
    return {l: _Prior(LayerSteps.from_counts(l, prior.step_counts(l), starts), weight) for l in trace.layers}


class _Prior:
    """One layer's calibration-trace models, built on first use: the transition table of
    ``dlfu-markov-seeded`` and the fitted reuse model of ``dlearn-seeded``."""

    def __init__(self, steps: LayerSteps, weight: float):
        self.steps, self.weight = steps, weight

    @cached_property
    def markov(self):
        return transition_table(self.steps, self.weight)

    @cached_property
    def learned(self) -> dict:
        return fit_layer(self.steps)


def trace_summary(trace: Trace) -> dict:
    return {
        "model": trace.model,
        "layers": list(trace.layers),
        "num_experts": trace.num_experts,
        "top_k": trace.top_k,
        "per_expert_bytes": trace.per_expert_bytes,
        "requests": trace.num_requests,
        "steps": trace.num_steps,
        "tokens": trace.num_tokens,
        "source": dict(trace.source),
    }


def _plan_summary(plan: Plan | None) -> dict | None:
    if plan is None:
        return None
    return {
        "model": plan.model,
        "identity": plan.identity,
        "core_experts": {str(l): len(p.core) for l, p in plan.layers.items()},
        "budget_bytes": plan.swappable_budget_bytes,
    }
