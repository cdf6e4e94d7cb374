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

Policy and slots: the CUDA device's, so the check is of what the device runs (ACCOUNTING_POLICIES).
``--reap-cache lfu`` with the default ``--reap-cache-seed pinned`` is the simulator's ``core+dlfu``:
the plan core pinned, the integer LFU (decay 0.8, cache_policy.device) on a tail of N slots per
layer computed by the device's rule (cache_tail.pinned_tail_split, which
device_cache_engine.CacheConfig.split runs): ``--reap-cache-slots N`` gives N // layers per layer
(the remainder is not lent), ``auto`` the pool's slots beyond the plan core // layers, the pool
being the plan budget's slots (``pool_tail_slots``, if an engine offers it, replaces the pool's
count); where the device would refuse (0 per layer, more than the pool) the cache is disengaged
with the device's reason. A swap pins its set beside the N-slot tail as the device does
(LayerCache ``device_tail``). ``reap-swap simulate --budget <(core + layers x N//layers) x
per_expert_bytes>B --policy core+dlfu`` replays the same cache. ``--reap-cache-seed seeded``: lfu
is ``dlfu-seeded`` (the device's seeded form) on ``cache_tail.layer_slots(core + tail, ...,
"core+tail")`` slots, the tail N (or auto: the plan budget minus the core, as split_seeded).
``lru``: the simulator's ``lru-seeded`` on the seeded slots; the device has no LRU (NO_DEVICE_LRU,
in /reap/status ``cache.note`` and the log). core+dlfu with fewer than 2 x top_k tail slots per
layer logs one WARNING and shows it as /reap/status ``cache.tail_note`` (cache_tail.small_tail_note:
the numbers and the remedy, ``reap-swap plan --cache-tail auto``).

Swap capacity (``check_swap``, before WorkerCore lets the backend apply): the CUDA server's with
the same flags (cache_tail.swap_capacity). With ``--reap-cache-device on`` the pinned form's swap
table is K = the pool less the lent tail (cache_tail.swap_slots_after_lending, CacheConfig.split's rule):
a wider resident set is refused with CUDA's PoolCapacityError and its very sentence
(cache_tail.swap_table_refusal: K, the pool, layers x N lent, the remedy); with
--reap-cache-seed seeded (served on CUDA; the default form there) the seeded device refuses a
layer's set wider than its slots (SeededCapacityError). With the device off (CUDA's default), lru,
or a split the device would refuse, the CUDA server lends nothing: the whole pool.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from reap_swap import get_logger
from reap_swap.cache.mechanism import LayerCounts
from reap_swap.cache.online import LFU_DECAY
from reap_swap.cache.replay import _policy
from reap_swap.cache.slot_table import PoolCapacityError, SeededCapacityError
from reap_swap.cache.stepper import LayerCache
from reap_swap.sizing.cache_tail import (
    DEVICE_FORM,
    core_slots,
    device_tail,
    layer_slots,
    small_tail_note,
    swap_capacity,
    swap_table_refusal,
    tail_slots,
)

log = get_logger("reap_swap.cache")

# --reap-cache x --reap-cache-seed -> the simulator policy accounting runs: the CUDA device's own
# where it has one (device_cache_serving.cache_config_for serves lfu as core+dlfu, or dlfu-seeded
# with --reap-cache-seed seeded), so CI's exact check against `reap-swap simulate` checks the policy
# the device runs. The device has no LRU: lru keeps the simulator's lru-seeded (NO_DEVICE_LRU).
ACCOUNTING_POLICIES = {
    ("lfu", "pinned"): "core+dlfu",
    ("lfu", "seeded"): "dlfu-seeded",
    ("lru", "pinned"): "lru-seeded",
    ("lru", "seeded"): "lru-seeded",
}
NO_DEVICE_LRU = (
    "--reap-cache lru: the CUDA device cache has no LRU (it implements the integer LFU dlfu only and "
    "refuses lru by name); accounting runs the simulator's lru-seeded, a policy no device serves"
)


def accounting_policy(setting: str, seed: str = "pinned") -> tuple[str, str | None]:
    """(the simulator policy accounting runs, why it is not the device's or None)."""
    name = ACCOUNTING_POLICIES[(setting, "seeded" if seed == "seeded" else "pinned")]
    return name, (NO_DEVICE_LRU if setting == "lru" else None)


COUNTERS = ("hits", "misses", "promotions", "evictions", "read_through_steps")


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
    device_form: bool = False  # core+dlfu: swaps and evictions as the CUDA device counts them
    note: str | None = None  # why the policy is not the device's (lru), for /reap/status and the log
    tail_note: str | None = None  # core+dlfu with a tail < 2 x top_k per layer (cache_tail.small_tail_note)
    swap_slots: int | None = None  # K, what the CUDA device's swap table keeps (check_swap); None: the pool
    seeded_swaps: bool = False  # the seeded device: a swap's set must fit each layer's C_l (check_swap)
    swap_source: str = ""  # how the swap capacity was counted (/reap/status)
    swap_lent: tuple[int, int] | None = None  # beside K: (layers, N per layer) lent, for the refusal

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
        cache_device: str = "off",
    ) -> CacheAccounting:
        """``layers``: counted plan layer -> its number of experts; ``uncounted``: layer -> why not;
        ``seed``: --reap-cache-seed (lfu: pinned runs the device's core+dlfu, seeded dlfu-seeded);
        ``cache_device``: --reap-cache-device, which with ``seed`` decides the swap capacity the
        CUDA server would have (swap_capacity)."""
        name, note = accounting_policy(setting, seed)
        device_form = name == DEVICE_FORM
        tail_note = None
        if device_form:  # the device's rule: N // layers (or auto) tail slots beside every layer's core
            per_layer, source, refusal, _kept, pool = device_tail(plan, slots_setting, pool_tail_slots)
            if refusal:
                return cls.disengaged(f"{refusal} (the CUDA device cache refuses it too; policy {name})")
            tail = per_layer * len(plan.layers)
            tail_note = small_tail_note(per_layer, top_k, pool, core_slots(plan), len(plan.layers))
        else:
            tail, source = tail_slots(plan, slots_setting, pool_tail_slots)
        core = {l: plan.layers[l].core for l in plan.layers}
        total = sum(len(c) for c in core.values()) + tail
        slots, how = layer_slots(
            total, sorted(plan.layers), core, "core+tail", max(layers.values(), default=0)
        )
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
            device = per_layer if device_form else None
            caches[l] = LayerCache(_policy(name, l, plan, None, LFU_DECAY), l, e, slots[l], device)
        record = deque(maxlen=record_steps) if record_steps else None
        acc = cls(name, caches, slots, tail, f"{source}; per layer {how}", top_k, refused, record)
        acc.device_form, acc.note, acc.tail_note = device_form, note, tail_note
        acc.swap_slots, acc.seeded_swaps, acc.swap_source, acc.swap_lent = swap_capacity(
            plan, name, slots_setting, pool_tail_slots, cache_device
        )
        for l, why in sorted(refused.items()):
            log.error("reap-swap cache: layer %d not engaged: %s", l, why)
        if note:
            log.warning("reap-swap cache: %s", note)
        if tail_note:
            log.warning("reap-swap cache: %s", tail_note)
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

    def check_swap(self, resident: Mapping[int, frozenset[int]]) -> None:
        """Refuse, before anything changes, a swap the CUDA server with the same flags refuses for
        capacity (swap_capacity; WorkerCore calls it before the backend applies, dry runs included).
        Pinned form: the whole resident set (every layer of ``resident``, core included) must fit
        K, the pool less the lent tail, as CUDA's SlotTable.plan raises (PoolCapacityError, the
        same sentence: cache_tail.swap_table_refusal). Seeded device: a layer's set must fit
        its C_l cache slots, as SeededPins.plan raises (SeededCapacityError, the same text)."""
        if self.reason is not None:
            return
        if self.swap_slots is not None:
            needed = sum(len(v) for v in resident.values())
            if needed > self.swap_slots:
                layers, per_layer = self.swap_lent or (0, 0)
                why = swap_table_refusal(needed, self.swap_slots, layers * per_layer, layers, per_layer)
                raise PoolCapacityError(needed, self.swap_slots, why)
        elif self.seeded_swaps:
            for l in sorted(resident):
                if l in self.caches and len(resident[l]) > self.slots[l]:
                    raise SeededCapacityError(l, len(resident[l]), self.slots[l])

    def pin_capacity(self) -> dict[str, int]:
        """layer -> the experts a swap can pin there (its slots), as the seeded device reports it."""
        return {str(l): int(self.slots[l]) for l in sorted(self.caches) if l not in self.refused}

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
        """Experts that left a layer's slots: admissions + prefetches + the startup fill - resident
        (core+dlfu: the tail's step evictions, as the device counts them; a swap's are the swap's)."""
        caches = self.caches.values() if layer is None else [self.caches[layer]]
        if self.device_form:  # the device's ``evicted``: experts leaving the tail slots in a step
            return sum(x.evicted for x in caches)
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
            "device_policy": self.policy if self.note is None else None,
            **({"note": self.note} if self.note else {}),
            **({"tail_note": self.tail_note} if self.tail_note else {}),
            "lfu_decay": LFU_DECAY if "lfu" in self.policy else None,
            "tail_slots": self.tail,
            "tail_source": self.tail_source,
            "swap_slots": self.swap_slots,  # None: the whole pool (or, seeded_swaps, each layer's slots)
            "seeded_swaps": self.seeded_swaps,
            **({"pin_capacity": self.pin_capacity()} if self.seeded_swaps else {}),
            "swap_source": self.swap_source,
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
