"""The mechanism one step at a time: what a server runs while steps arrive (for the server's
cache accounting mode; replay_layer is unchanged).

``LayerCache`` applies exactly the rules of ``mechanism.replay_layer`` (the same ``_check`` and
``_count_step``) but is fed one step at a time, so the worker can run a policy online on the
stream its router counters see. ``tests/test_cache_stepper.py`` checks that stepping a trace gives
counts identical to ``replay_layer`` for every online policy.

Only online policies step: Belady needs the future and per-request ``probe`` sets need the
client; both are refused here (``StepperError``). One addition the simulator does not model: a
per-request swap (``pin``) makes its set resident and pinned, and the policy's tail yields to it
(the remaining slots, if any, stay dynamic); the simulator replays that with ``probe+lfu`` /
``probe+dlfu`` (hybrid.py, which shares ``yield_tail`` with ``pin``). With ``device_tail`` (accounting
mode's ``core+dlfu``, the CUDA device's pinned form) a swap follows the device instead: the set is
pinned in its own units beside a tail that keeps its N slots (``_pin_device``; parity with
residency.device_cache.DeviceCache: tests/test_cache_device_form.py).
"""

from __future__ import annotations

from collections.abc import Set

import numpy as np

from reap_swap.cache.hybrid import device_pin, yield_tail
from reap_swap.cache.mechanism import LayerCounts, LayerSteps, PolicyError, _check, _count_step
from reap_swap.cache.online import Static, _Ranked


class StepperError(ValueError):
    """A policy that cannot run online (the message says why)."""


class LayerCache:
    """One layer's cache state, stepped online. ``policy``: a fresh policy object from the
    simulator's factories (``cache_policy.replay._policy``); ``capacity``: the layer's slots."""

    def __init__(self, policy, layer: int, num_experts: int, capacity: int, device_tail: int | None = None):
        if getattr(policy, "prefetches", False) or not isinstance(policy, _Ranked | Static):
            raise StepperError(
                f"policy {policy.name!r} cannot run online (it needs the future or the client)"
            )
        self.policy = policy
        self.layer = layer
        self.num_experts = int(num_experts)
        self.base_capacity = int(capacity)
        self.capacity = int(capacity)
        empty = LayerSteps(layer, self.num_experts, (), (), np.zeros(0, dtype=bool))
        self.resident = frozenset(int(e) for e in policy.start(empty, self.capacity))
        if len(self.resident) > self.capacity:
            raise PolicyError(f"{policy.name}: starts with {len(self.resident)} experts in {capacity} slots")
        self.counts = LayerCounts(start_resident=len(self.resident))
        self.pinned: frozenset[int] = frozenset(getattr(policy, "pinned", frozenset()))
        self.t = 0
        # the CUDA device cache's pinned form (core+dlfu): N slots beside the pinned set, always N
        self.device_tail = None if device_tail is None else int(device_tail)
        self.evicted = 0  # experts that left the resident set in a step (the device's ``evicted``)

    def step(self, row: np.ndarray, request_start: bool) -> None:
        """One step's routed selections per expert (int [E], the counters' delta)."""
        row = np.asarray(row)
        needed = np.flatnonzero(row)
        counts = row[needed].astype(np.int64)
        c, t, resident = self.counts, self.t, self.resident
        hit = np.fromiter((int(e) in resident for e in needed), dtype=bool, count=len(needed))
        _count_step(c, hit, counts, decode=not request_start)
        if len(needed) > self.capacity:
            c.read_through_steps += 1
        need = frozenset(int(e) for e in needed)
        if hasattr(self.policy, "begin_step"):
            self.policy.begin_step(t, bool(request_start))
        new = frozenset(int(e) for e in self.policy.choose(t, resident, needed, counts))
        _check(self.policy, t, resident, new, need, self.capacity)
        c.admitted += len(new - resident)
        c.bypassed += len(need - resident - new)
        c.steps += 1
        self.evicted += len(resident - new)
        self.resident = new
        self.t += 1

    def pin(self, pinned: Set[int]) -> None:
        """A per-request swap: ``pinned`` becomes resident (prefetched, counted) and stays until
        the next swap; the tail keeps the best-scored former residents in the slots left over.
        A set larger than the layer's slots takes them all (no tail for that layer until a
        smaller set is swapped in)."""
        pinned = frozenset(int(e) for e in pinned)
        if self.device_tail is not None:
            return self._pin_device(pinned)
        self.capacity = max(self.base_capacity, len(pinned))
        if isinstance(self.policy, Static):
            new = pinned
        else:
            new = yield_tail(self.policy, self.resident, pinned, self.capacity, self.t)
        self.counts.prefetched += len(new - self.resident)
        self.resident, self.pinned = new, pinned

    def _pin_device(self, pinned: frozenset[int]) -> None:
        """The device's swap (DeviceCache.set_pinned, active slots unchanged): ``pinned`` lives in
        its own units (the swap table's), so the former pinned set leaves unless pinned again; the
        tail keeps its N slots and every cached expert not now pinned (slots of newly pinned ones
        are emptied, nothing is re-ranked, no score changes). Capacity: |pinned| + N (at most E)."""
        new, self.capacity = device_pin(
            self.policy, self.resident, pinned, self.device_tail, self.num_experts
        )
        self.counts.prefetched += len(new - self.resident)
        self.resident, self.pinned = new, pinned

    @property
    def tail_slots(self) -> int:
        return max(0, self.capacity - len(self.pinned))
