"""All three at once (README's ``plan-swap+cache``): per-request swaps pin the client's ``probe``
set, the device cache's policy keeps adapting in the slots left over.

Policies ``probe+lfu`` (the tail is ``lfu-seeded``, the float LFU no device serves; accounting
mode ran it for ``--reap-cache lfu`` until the pinned default became the device's ``core+dlfu``) and
``probe+dlfu`` (the tail is ``dlfu-seeded``, what ``--reap-cache-seed seeded`` runs: the integer
LFU of device.py). The semantics are the server's in accounting mode, step for step:

- Startup: the cache policy seeded with the plan core, nothing pinned (``LayerCache.__init__``);
  the backend's resident set is the core.
- Before a request's prefill the client swaps to its set (``probe``'s set per layer: the core plus
  the slices reap_swap.client.selection's ``probe`` takes, cut to the layer's slots; probe._probe_sets).
  The worker pins only when the swap changes the backend's resident set, over all layers at once
  (``WorkerCore.apply``: ``resident != before``); a pin then reaches every layer, even one whose
  set did not change. ``swaps`` below holds exactly those request starts.
- A pin is ``LayerCache.pin`` (``yield_tail`` is that code, shared): the set becomes resident and
  pinned (missing members counted as prefetched), the tail keeps the best-scored former residents
  in the slots left over; afterwards ``_Ranked.choose`` forces the pinned set every step and the
  policy admits and evicts in the rest.
- The client's probe pass (a one-token prefill with only the core resident, before the swap) is
  not in a trace and not replayed, as for ``probe``: on a real server it is one more prefill step
  the cache sees (and counts) before the request's own.
"""

from __future__ import annotations

from collections.abc import Mapping, Set

from reap_swap.cache.mechanism import LayerSteps
from reap_swap.cache.online import _Ranked

# policy -> the tail's policy; ``probe+core+dlfu`` is the device's pinned form (DevicePinned below)
TAILS = {"probe+lfu": "lfu-seeded", "probe+dlfu": "dlfu-seeded", "probe+core+dlfu": "core+dlfu"}
# the servable form of ``probe+core+dlfu``, the bench's ``plan-swap+cache`` (probe.servable_split):
# DevicePinned with the tail cache_tail.swap_cache_split gives per layer, the client's sets
# selected within the swap table K that tail leaves, so |sets| + layers x tail <= the budget's slots
SPLIT = "probe+core+dlfu-split"


def device_pin(
    policy: _Ranked, resident: frozenset[int], pinned: frozenset[int], tail: int, num_experts: int
):
    """A per-request swap on the CUDA device's pinned form (DeviceCache.set_pinned, active slots
    unchanged): ``pinned`` in its own units, the former pinned set leaves unless pinned again, the
    ``tail`` slots keep every cached expert not now pinned (nothing re-ranked). Sets
    ``policy.pinned`` / ``policy.capacity``; returns (the new resident set, the new capacity)."""
    kept = resident - policy.pinned - pinned
    capacity = min(int(num_experts), len(pinned) + int(tail))
    policy.pinned, policy.capacity = pinned, capacity
    return pinned | kept, capacity


def yield_tail(policy: _Ranked, resident: frozenset[int], pinned: frozenset[int], capacity: int, t: int):
    """A per-request swap on a ranked cache: ``pinned`` resident and forced from now on, the
    best-scored former residents (score after step ``t - 1``; ties: lower id) in the slots left
    over. Sets ``policy.pinned`` / ``policy.capacity``; returns the new resident set."""
    policy.pinned = pinned  # _Ranked.choose forces its pinned set every step
    policy.capacity = capacity
    rest = sorted(resident - pinned, key=lambda e: (policy.score(t - 1, e), -e))
    return pinned | frozenset(rest[::-1][: max(0, capacity - len(pinned))])


def swap_points(
    sets: Mapping[int, Mapping[int, frozenset[int]]], core: Mapping[int, frozenset[int]]
) -> list[int]:
    """Request starts at which the worker pins: the swap's sets (all layers) differ from the
    previous swap's (at startup: the core). ``sets``: layer -> request's first step -> set."""
    before = {l: frozenset(c) for l, c in core.items()}
    out = []
    for t in sorted(next(iter(sets.values()), {})):
        now = {l: sets[l][t] for l in sets}
        if now != {l: before[l] for l in sets}:
            out.append(t)
            before.update(now)
    return out


class SwapPinned:
    """One layer: ``tail`` (a fresh seeded ranked policy) between swaps; ``swaps``: step -> the
    set pinned before that step (only the steps where the worker pins)."""

    prefetches = True

    def __init__(self, name: str, tail: _Ranked, swaps: Mapping[int, frozenset[int]]):
        if tail.pinned:
            raise ValueError(f"{name}: the tail policy must start with nothing pinned")
        self.name = name
        self.tail = tail
        self.swaps = dict(swaps)
        self.capacity = 0

    def start(self, steps: LayerSteps, capacity: int) -> Set[int]:
        self.capacity = capacity
        return self.tail.start(steps, capacity)

    def prefetch(self, t: int, resident: frozenset[int]) -> Set[int]:
        pinned = self.swaps.get(t)
        if pinned is None:
            return resident
        return yield_tail(self.tail, resident, frozenset(pinned), max(self.capacity, len(pinned)), t)

    def choose(self, t, resident, needed, counts) -> Set[int]:
        return self.tail.choose(t, resident, needed, counts)


class DevicePinned:
    """``probe+core+dlfu``: the device's pinned form (``core+dlfu``) with the client's swaps, as
    accounting mode runs it for the default ``--reap-cache lfu`` (LayerCache ``device_tail``): the
    tail is the layer's slots minus its core (N), fixed; a swap pins its set beside it
    (``device_pin``), so the layer's capacity becomes |set| + N (``resizes``: replay_layer follows)."""

    prefetches = True
    resizes = True

    def __init__(self, name: str, tail: _Ranked, swaps: Mapping[int, frozenset[int]]):
        self.name, self.tail, self.swaps = name, tail, dict(swaps)
        self.capacity = self.tail_slots = self.num_experts = 0

    def start(self, steps: LayerSteps, capacity: int) -> Set[int]:
        self.capacity, self.num_experts = capacity, steps.num_experts
        self.tail_slots = capacity - len(self.tail.pinned)  # N (at most E - core: the slots given)
        return self.tail.start(steps, capacity)

    def prefetch(self, t: int, resident: frozenset[int]) -> Set[int]:
        pinned = self.swaps.get(t)
        if pinned is None:
            return resident
        new, self.capacity = device_pin(
            self.tail, resident, frozenset(pinned), self.tail_slots, self.num_experts
        )
        return new

    def choose(self, t, resident, needed, counts) -> Set[int]:
        return self.tail.choose(t, resident, needed, counts)
