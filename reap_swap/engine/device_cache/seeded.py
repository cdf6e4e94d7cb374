"""Per-request swaps with the seeded device cache (``--reap-cache-seed seeded``, the
default form on CUDA: device_cache_serving).

With ``seed_core`` the plan core is not pinned by the engine: each cached layer gets its whole
share C of the pool (core + tail, accounting's ``cache_tail.layer_slots(..., "core+tail")``) as cache
slots, seeded with the core, evictable (the simulator's ``dlfu-seeded``). The swap SlotTable keeps
only the pool's remainder. A per-request swap's set P of a cached layer is therefore pinned
*inside the layer's own slots*, not in the SlotTable:

- P goes into the slots [C - |P|, C) -- an expert the previous swap pinned keeps its slot when that
  slot is still in the range, the others take the free ones (ascending) -- and each expert's own unit of the layer
  range is remapped onto that slot's physical handle (the same lent pool allocation, mapped a
  second time): the kernel reads P through the experts' own ids, the cache sees them ``pinned``
  (DeviceCache.set_pinned's semantics) and its tail is the first ``active = C - |P|`` slots.
- The tail keeps the best-scored former residents (cached ones and the previous swap's set, less
  P; score after the last step, ties lower id): hybrid.yield_tail's choice, which
  LayerCache.pin (accounting mode) makes too. A keeper already in a slot < active stays; others
  move into the lowest free tail slots (lowest id first).
- Bytes: every placed expert whose slot changed is copied from its host master (all own units are
  host-backed while this runs: the previous swap's set is mapped back to host first). Nothing is
  copied slot to slot, so the order of the copies does not matter.
- A set wider than C is refused by name before anything moves (SeededCapacityError, a
  PoolCapacityError; the worker's apply error, so the HTTP answer is 422 capacity_exceeded naming
  the layer, with the previous set re-applied -- a no-op: only the workers know C). Accounting mode
  refuses the same set with the same error when run with --reap-cache-device on
  (cache_accounting.check_swap); otherwise it grows that layer's capacity to |P|
  (LayerCache.pin); research.md "seedserve" lists every difference.

Between steps only (the worker RPC; cuda_backend.apply quiesces first). Pure torch on the units
view: runs on CPU tensors with a fake range (tests/test_device_cache_seeded.py) and on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from reap_swap.cache.slot_table import PoolCapacityError, SeededCapacityError
from reap_swap.engine.device_cache.layer import DeviceCache, LayerStep


@dataclass(frozen=True)
class SeededPin:
    """One layer's new layout: tail slot -> expert (slots < active), pinned expert -> slot."""

    tail: dict[int, int]
    pinned: dict[int, int]
    active: int
    copies: tuple[tuple[int, int], ...]  # (expert, slot) whose bytes come from the host master


def plan_pin(cache: DeviceCache, before: Mapping[int, int], experts: Iterable[int]) -> SeededPin:
    """The layout after pinning ``experts`` (``before``: the previous swap's expert -> slot)."""
    pins = sorted({int(e) for e in experts})
    n, num_e = cache.num_slots, cache.num_experts
    if pins and not 0 <= pins[0] <= pins[-1] < num_e:
        raise ValueError(f"pinned experts {pins} outside [0, {num_e})")
    if len(pins) > n:
        raise PoolCapacityError(len(pins), n)
    active = n - len(pins)
    slot_expert = [int(e) for e in cache.slot_expert.tolist()]
    score = cache.score.tolist()
    former = ({e for e in slot_expert if e >= 0} | set(before)) - set(pins)
    ranked = sorted(former, key=lambda e: (score[e], -e), reverse=True)  # hybrid.yield_tail's order
    keep = set(ranked[:active])
    tail = {s: e for s, e in enumerate(slot_expert[:active]) if e in keep}
    free = [s for s in range(active) if s not in tail]
    moving = sorted(keep - set(tail.values()))
    tail.update(zip(free, moving, strict=False))
    # a pin already held in a slot of the new pinned range keeps it (its bytes are there: no copy);
    # the others take the range's free slots, lowest first: a swap that adds a slice moves only it
    pinned = {e: before[e] for e in pins if before.get(e, -1) >= active}
    taken = set(pinned.values())
    free_pins = [s for s in range(active, n) if s not in taken]
    pinned.update(zip([e for e in pins if e not in pinned], free_pins, strict=False))
    copies = [(e, s) for s, e in tail.items() if slot_expert[s] != e]
    copies += [(e, s) for e, s in pinned.items() if before.get(e) != s or slot_expert[s] >= 0]
    return SeededPin(tail, pinned, active, tuple(sorted(copies, key=lambda c: c[1])))


def apply_pin(
    step: LayerStep, rng: Any, handle: Callable[[int], Any], before: Mapping[int, int], pin: SeededPin
):
    """Carry out ``pin`` on one layer: map the previous set back to host, copy from the host
    masters, set the cache state, map the new set onto its slots. Returns the bytes copied."""
    cache, units, num_e = step.cache, step.units, step.cache.num_experts
    for e in sorted(before):
        rng.map_host(e, defer_access=True)
    rng.flush_access()
    for e, s in pin.copies:  # own unit e is host-backed now: its master's bytes
        units[num_e + s].copy_(units[e])
    if units.is_cuda:  # the copies read units about to be remapped: they must have landed
        torch.cuda.synchronize(units.device)
    se = torch.full_like(cache.slot_expert, -1)
    for s, e in pin.tail.items():
        se[s] = e
    cache.slot_expert.copy_(se)
    mask = torch.zeros_like(cache.pinned)
    mask[sorted(pin.pinned)] = True
    cache.pinned.copy_(mask)
    cache.active.fill_(pin.active)
    cache._rebuild()
    for e, s in sorted(pin.pinned.items()):
        rng.map_device(e, handle(s), defer_access=True)
    rng.flush_access()
    return len(pin.copies) * int(units[0].numel() * units.element_size())


class SeededPins:
    """Every seeded cached layer's pinned set (expert -> slot) and the swap over them. ``core``:
    what ``resident()`` answers for a layer no swap has pinned yet (the set the cache was seeded
    with; accounting mode's backend answers the same), so WorkerCore's "a swap that changes the
    set pins it" rule sees the same sets in both modes."""

    def __init__(
        self,
        caches: Any,
        layer_range: Callable[[int], Any],
        handle: Callable[[int, int], Any],
        core: Mapping[int, Iterable[int]] | None = None,
    ):
        self.caches = caches  # device_cache_api.DeviceCaches
        self.layer_range = layer_range  # layer -> its CacheRange
        self.handle = handle  # (layer, cache slot) -> the lent pool slot's physical handle
        self.core = {int(l): frozenset(int(e) for e in c) for l, c in (core or {}).items()}
        self.pinned: dict[int, dict[int, int]] = {}

    def layers(self) -> set[int]:
        return set(self.caches.layers)

    def caches_slots(self) -> dict[int, int]:
        """Cache slots per seeded layer (C_l: what a swap may pin there)."""
        return {l: s.cache.num_slots for l, s in self.caches.layers.items()}

    def plan(self, target: Mapping[int, Iterable[int]]) -> dict[int, SeededPin]:
        """Every layer's layout, validated before anything moves (raises PoolCapacityError)."""
        out = {}
        for layer, experts in sorted(target.items()):
            cache = self.caches.layers[layer].cache
            try:
                out[layer] = plan_pin(cache, self.pinned.get(layer, {}), experts)
            except PoolCapacityError as exc:
                raise SeededCapacityError(layer, exc.needed, exc.capacity) from None
        return out

    def apply(self, target: Mapping[int, Iterable[int]], force: bool = False) -> tuple[int, int]:
        """(bytes copied, experts newly pinned) after pinning ``target`` on its layers: every
        layer is validated first (nothing moves on a refusal); a target equal to ``resident()``
        is a no-op unless ``force`` (WorkerCore pins every layer when the swap changes the set
        anywhere, also on layers outside the cache: the caller says so)."""
        pins = self.plan(target)
        now = self.resident()
        if not force and all(frozenset(int(e) for e in v) == now.get(l) for l, v in target.items()):
            return 0, 0
        step0 = next(iter(self.caches.layers.values()), None)
        if step0 is not None and step0.units.is_cuda:  # quiesce: no kernel reads a range remapped
            torch.cuda.synchronize(step0.units.device)
        copied = admitted = 0
        for layer, pin in pins.items():
            before = self.pinned.get(layer, {})
            step = self.caches.layers[layer]
            copied += apply_pin(
                step, self.layer_range(layer), lambda s, l=layer: self.handle(l, s), before, pin
            )
            admitted += len(set(pin.pinned) - set(before))
            self.pinned[layer] = dict(pin.pinned)
        return copied, admitted

    def resident(self) -> dict[int, frozenset[int]]:
        """The backend's set per cached layer: the last swap's, else the seed (the plan core)."""
        out = {l: self.core.get(l, frozenset()) for l in self.caches.layers}
        out.update({l: frozenset(p) for l, p in self.pinned.items()})
        return out


def seeded_pins(engine: Any) -> SeededPins | None:
    """The CUDA backend's SeededPins when the engine serves --reap-cache-seed seeded, else None."""
    cfg = getattr(engine, "cache", None)
    if cfg is None or not cfg.seed_core or cfg.layer_slots is None:
        return None
    st = engine.state
    core = {l: p.core for l, p in st.plan.layers.items()} if st.plan is not None else {}
    return SeededPins(
        cfg.caches, lambda l: st.layers[l].rng, lambda l, s: st.pool.slot_handle(cfg.lent[l] + s), core
    )
