"""Online policies (they see only the past): LRU, LFU with decay, LFRU, optionally seeded by the
plan core or with the core pinned; and the plan's static core.

Every online cache here admits on demand: after a step, the experts it routed outrank every
resident it did not route, so each miss is admitted while slots not needed by the step are left
(in a read-through step, the missed experts with the best score get the free slots). Among the
rest the policy's score decides; ties keep residents (nothing moves), then the lower expert id.
"""

from __future__ import annotations

from collections.abc import Set

import numpy as np

from reap_swap.cache.mechanism import LayerSteps

# The per-step score decay of every LFU policy (simulated, accounting, on the device): chosen on a
# calibration trace (research.md "Device-cache policies in simulation").
LFU_DECAY = 0.8


class _Ranked:
    """Keep what the step needs, then the best-scored of the rest up to the slots."""

    prefetches = False

    def __init__(self, name: str, seed: Set[int] = frozenset(), pinned: Set[int] = frozenset()):
        if not set(pinned) <= set(seed):
            raise ValueError("pinned experts must be part of the seed")
        self.name = name
        self.seed = frozenset(seed)
        self.pinned = frozenset(pinned)
        self.capacity = 0

    def start(self, steps: LayerSteps, capacity: int) -> Set[int]:
        self.capacity = capacity
        self.reset(steps.num_experts)
        return self.seed

    def prefetch(self, t: int, resident: frozenset[int]) -> Set[int]:
        return resident

    def reset(self, num_experts: int) -> None:
        raise NotImplementedError

    def observe(self, t: int, needed: np.ndarray, counts: np.ndarray) -> None:
        raise NotImplementedError

    def score(self, t: int, e: int) -> float:
        raise NotImplementedError

    def rank_key(self, t: int, e: int, need: frozenset[int], resident: frozenset[int]) -> tuple:
        """Higher keeps a slot: needed experts first, then by score, residents on ties, low ids."""
        return (e in need, self.score(t, e), e in resident, -e)

    def choose(self, t: int, resident: frozenset[int], needed: np.ndarray, counts: np.ndarray) -> Set[int]:
        self.observe(t, needed, counts)
        need = frozenset(int(e) for e in needed)
        forced = (resident & need) | self.pinned
        free = self.capacity - len(forced)
        rest = (resident | need) - forced
        ranked = sorted(rest, key=lambda e: self.rank_key(t, e, need, resident), reverse=True)
        return forced | frozenset(ranked[: max(0, free)])


class LRU(_Ranked):
    """Least recently used: the score is the last step that routed the expert."""

    def reset(self, num_experts: int) -> None:
        self.last = np.full(num_experts, -1, dtype=np.int64)

    def observe(self, t, needed, counts) -> None:
        self.last[needed] = t

    def score(self, t, e) -> float:
        return float(self.last[e])


class LFU(_Ranked):
    """Least frequently used with decay: per step every score is multiplied by ``decay``, then the
    step's routed selections are added (the device counters' unit)."""

    def __init__(self, name, seed=frozenset(), pinned=frozenset(), decay: float = LFU_DECAY):
        super().__init__(name, seed, pinned)
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay = decay

    def reset(self, num_experts: int) -> None:
        self.freq = np.zeros(num_experts, dtype=np.float64)

    def observe(self, t, needed, counts) -> None:
        self.freq *= self.decay
        self.freq[needed] += counts

    def score(self, t, e) -> float:
        return float(self.freq[e])


class LFRU(_Ranked):
    """Frequency over age: selections so far / (1 + steps since the last use) (as in vLLM PR #37190)."""

    def reset(self, num_experts: int) -> None:
        self.count = np.zeros(num_experts, dtype=np.float64)
        self.last = np.full(num_experts, -1, dtype=np.int64)

    def observe(self, t, needed, counts) -> None:
        self.count[needed] += counts
        self.last[needed] = t

    def score(self, t, e) -> float:
        return float(self.count[e] / (1 + t - self.last[e]))


class Static:
    """The plan's core, resident from startup, never changed: what a plain client gets today."""

    prefetches = False

    def __init__(self, core: Set[int], name: str = "static"):
        self.name = name
        self.core = frozenset(core)

    def start(self, steps: LayerSteps, capacity: int) -> Set[int]:
        return self.core

    def prefetch(self, t: int, resident: frozenset[int]) -> Set[int]:
        return resident

    def choose(self, t, resident, needed, counts) -> Set[int]:
        return resident


class PerRequest(Static):
    """A resident set per request, swapped in before its prefill (the reap-swap client's swap);
    fixed during the request, misses read through. ``sets``: request's first step -> set."""

    prefetches = True

    def __init__(self, core: Set[int], sets: dict[int, frozenset[int]], name: str = "probe"):
        super().__init__(core, name)
        self.sets = sets

    def prefetch(self, t: int, resident: frozenset[int]) -> Set[int]:
        return self.sets.get(t, resident)
