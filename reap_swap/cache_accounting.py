"""The device cache in accounting mode: the chosen policy run per layer, per step, as state only.

Why: on vLLM's CPU build (and under ``--reap-residency accounting``) no bytes can move, but the
cache's decisions can still be made and counted, on the same per-step stream the router counters
see, by the same pure policy code ``reap-swap simulate`` replays (cache_policy.stepper.LayerCache).
So CI can check the server's hits, misses, promotions and evictions exactly against the simulator
(tests/e2e/test_cache_accounting.py).

The stream: the worker snapshots every counting layer's ``reap_counts`` buffer before each engine
step (``execute_model``) and takes the difference after it (the controller's counter resets run
between steps, never inside one). Those are the model's own expert ids and the selections of
every token of the step; a step is a request's prefill when it schedules a new request. Steps
that route nothing (no tokens scheduled) are not steps of the cache.

Slots: ``--reap-cache-slots N`` is the tail beyond the pinned set, over all layers; ``auto`` asks
the pool for its slots beyond the pinned set (``pool_tail_slots``, another developer's
``--reap-budget auto`` provides it) and falls back to the plan budget minus the plan core. Per
layer the capacity is ``replay.layer_slots(core + tail, ..., "core+tail")``: the simulator's
allocation, so ``reap-swap simulate --budget <(core + tail) x per_expert_bytes>B`` replays the
same cache. Policy names: ``--reap-cache lfu`` is the simulator's ``lfu-seeded`` (decay 0.8),
``lru`` is ``lru-seeded``; with ``--reap-cache-seed seeded`` lfu is ``dlfu-seeded`` (the same LFU
in the integer arithmetic the CUDA device cache runs).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from reap_swap.cache_policy.mechanism import LayerCounts
from reap_swap.cache_policy.replay import _policy, layer_slots
from reap_swap.cache_policy.stepper import LayerCache
from reap_swap.logs import get_logger

log = get_logger("reap_swap.cache")

CACHE_POLICIES = {"lfu": "lfu-seeded", "lru": "lru-seeded"}  # --reap-cache -> simulator policy
# --reap-cache-seed seeded: the integer LFU the CUDA device runs (residency/device_cache_seeded.py),
# so this accounting equals the device's decisions by construction (research.md "seedserve")
SEEDED_POLICIES = {"lfu": "dlfu-seeded", "lru": "lru-seeded"}
LFU_DECAY = 0.8  # research.md "Device-cache policies in simulation": tuned on the calibration trace
COUNTERS = ("hits", "misses", "promotions", "evictions", "read_through_steps")


def tail_slots(plan, setting: int | str, pool_tail_slots: Callable[[], int | None] | None) -> tuple[int, str]:
    """(cache slots beyond the pinned set over all layers, where the number came from)."""
    if setting != "auto":
        return int(setting), "--reap-cache-slots"
    if pool_tail_slots is not None:
        n = pool_tail_slots()
        if n is not None:
            return int(n), "the pool's slots beyond the pinned set"
    budget = int(plan.swappable_budget_bytes) // int(plan.per_expert_bytes)
    core = sum(len(p.core) for p in plan.layers.values())
    return max(0, budget - core), f"plan budget ({budget} experts) minus the plan core ({core})"


@dataclass
class CacheAccounting:
    """Per counted layer, one LayerCache; the totals the surfaces report."""

    policy: str  # the simulator's policy name
    caches: dict[int, LayerCache]
    slots: dict[int, int]
    tail: int
    tail_source: str
    top_k: int
    refused: dict[int, str] = field(default_factory=dict)  # plan layer -> why no cache there
    record: deque | None = None  # the last N steps fed (rows per layer), when asked for
    steps: int = 0
    reason: str | None = None  # why the cache is not engaged at all

    @classmethod
    def build(
        cls,
        plan,
        setting: str,
        slots_setting,
        layers: Mapping[int, int],
        uncounted: Mapping[int, str],
        top_k: int,
        record_steps: int = 0,
        pool_tail_slots=None,
        seed: str = "pinned",
    ) -> CacheAccounting:
        """``layers``: counted plan layer -> its number of experts; ``uncounted``: layer -> why not;
        ``seed``: --reap-cache-seed (seeded: lfu runs as the device's integer ``dlfu-seeded``)."""
        name = (SEEDED_POLICIES if seed == "seeded" else CACHE_POLICIES)[setting]
        tail, source = tail_slots(plan, slots_setting, pool_tail_slots)
        core = {l: plan.layers[l].core for l in plan.layers}
        total = sum(len(c) for c in core.values()) + tail
        num_experts = max(layers.values(), default=0)
        slots, how = layer_slots(total, sorted(plan.layers), core, "core+tail", num_experts)
        refused = {
            l: f"not counted ({why}): the cache cannot see its routing" for l, why in uncounted.items()
        }
        caches = {}
        for l, e in layers.items():
            if l not in plan.layers:
                continue
            if slots[l] < top_k:
                refused[l] = (
                    f"too few slots for one token: {slots[l]} slots < top_k {top_k}; every step reads through"
                )
            caches[l] = LayerCache(_policy(name, l, plan, None, LFU_DECAY), l, e, slots[l])
        acc = cls(
            name,
            caches,
            slots,
            tail,
            f"{source}; per layer {how}",
            top_k,
            refused,
            deque(maxlen=record_steps) if record_steps else None,
        )
        for l, why in sorted(refused.items()):
            log.error("reap-swap cache: layer %d not engaged: %s", l, why)
        log.info(
            "reap-swap cache: policy %s, %d tail slots (%s), slots per layer %s",
            name,
            tail,
            acc.tail_source,
            slots,
        )
        return acc

    @classmethod
    def disengaged(cls, reason: str) -> CacheAccounting:
        log.warning("reap-swap cache: not engaged: %s", reason)
        return cls("off", {}, {}, 0, "", 0, reason=reason)

    def step(self, rows: Mapping[int, np.ndarray], request_start: bool) -> None:
        """One engine step's routed selections per layer (the counters' delta)."""
        if not any(int(np.asarray(r).sum()) for r in rows.values()):
            return
        for l, cache in self.caches.items():
            cache.step(rows[l], request_start)
        self.steps += 1
        if self.record is not None:
            self.record.append(
                {
                    "request_start": bool(request_start),
                    "layers": {str(l): np.asarray(r).astype(int).tolist() for l, r in rows.items()},
                }
            )

    def pin(self, resident: Mapping[int, frozenset[int]]) -> None:
        """A per-request swap was applied: its set is pinned, the tail yields to it."""
        for l, cache in self.caches.items():
            if l in resident:
                cache.pin(resident[l])

    def totals(self) -> dict[str, int]:
        c = LayerCounts()
        for cache in self.caches.values():
            c.add(cache.counts)
        return counters_of(c, self.evictions())

    def evictions(self, layer: int | None = None) -> int:
        """Experts that left a layer's slots: admissions + prefetches + the startup fill - resident."""
        caches = self.caches.values() if layer is None else [self.caches[layer]]
        return sum(
            x.counts.admitted + x.counts.prefetched + x.counts.start_resident - len(x.resident)
            for x in caches
        )

    def status(self) -> dict[str, Any]:
        if self.reason is not None:
            return {"engaged": False, "reason": self.reason}
        layers = {}
        for l, cache in self.caches.items():
            layers[str(l)] = {
                "slots": cache.capacity,
                "occupied": len(cache.resident),
                "pinned": len(cache.pinned),
                "tail_slots": cache.tail_slots,
                "resident": sorted(cache.resident),
                "engaged": l not in self.refused,
                **({"reason": self.refused[l]} if l in self.refused else {}),
                **counters_of(cache.counts, self.evictions(l)),
                "counts": cache.counts.to_dict(0),
            }
        for l, why in self.refused.items():
            layers.setdefault(str(l), {"engaged": False, "reason": why})
        return {
            "engaged": any(l not in self.refused for l in self.caches),
            "mode": "accounting",
            "policy": self.policy,
            "lfu_decay": LFU_DECAY if "lfu" in self.policy else None,
            "tail_slots": self.tail,
            "tail_source": self.tail_source,
            "steps": self.steps,
            "recording": self.record.maxlen if self.record is not None else 0,
            "totals": self.totals(),
            "layers": layers,
        }

    def trace(self, reset: bool) -> list[dict]:
        out = list(self.record or ())
        if reset and self.record is not None:
            self.record.clear()
        return out


def counters_of(c: LayerCounts, evictions: int) -> dict[str, int]:
    """The five Prometheus counters from a policy's counts (units: routed selections for hits and
    misses, experts for promotions and evictions, steps for read-through steps)."""
    return {
        "hits": c.selection_hits,
        "misses": c.selections - c.selection_hits,
        "expert_hits": c.expert_hits,
        "expert_misses": c.expert_misses,
        "promotions": c.admitted,
        "evictions": evictions,
        "read_through_steps": c.read_through_steps,
    }
