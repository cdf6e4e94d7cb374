"""Belady's offline optimum for the mechanism: the fewest distinct misses (host reads) any policy
can have on a trace, with the best possible startup fill.

Rule: after step t, keep what the step needs (the mechanism forces it), then fill the remaining
slots with the candidates (residents the step did not need, missed experts of the step) whose
next use is soonest; a missed expert never used again is not admitted. Ties on the next use are
broken by the use after it, and so on (:func:`future_ranks`): of two experts both next routed in
step u, the one resident then is a hit and must stay through u, so it should be the one wanted
again sooner. Equal futures keep residents. Startup: the ``capacity`` experts used first (same
order).

Why it is optimal (exchange argument, checked by brute force in tests/test_simulate.py): let an
optimal schedule agree with this rule up to step t and keep x where the rule keeps y, with
next(y) <= next(x). Swap their roles until one of them is next used: if that is y (earlier), the
swapped schedule saves y's miss and holds one expert less, which can cost at most x's miss later;
if both are used in the same step, both schedules miss one of them. Prefetching cannot help: a
prefetched expert costs a host read, the same as missing it when it is routed. So no policy,
online or offline, prefetching or not, reads fewer experts from the host than this one.

What it does not bound: routed *selections* that miss. A prefill step routes an expert many
times and a decode step once, so a policy may keep fewer distinct experts but heavier ones; the
per-selection optimum is a weighted problem Belady does not solve.
"""

from __future__ import annotations

from collections.abc import Set

import numpy as np

from reap_swap.cache.mechanism import LayerSteps


def future_ranks(steps: LayerSteps) -> np.ndarray:
    """[steps + 1, E]: row t + 1 ranks the experts by their uses after step t (row 0: from step
    0 on), soonest first, compared as whole sequences: first by the next use, then on a tie by
    the use after it, and so on; experts never used again rank last; equal futures rank equal."""
    n, e = steps.num_steps, steps.num_experts
    out = np.zeros((n + 1, e), dtype=np.int64)
    for t in range(n - 1, -1, -1):
        used = np.zeros(e, dtype=np.int64)
        used[steps.needed[t]] = 1
        # ranking the uses from step t on, given row t + 1's ranking of those after it
        key = (1 - used) * (e + 1) + out[t + 1]
        out[t] = np.unique(key, return_inverse=True)[1]
    return out


class Belady:
    prefetches = False

    def __init__(self, name: str = "belady"):
        self.name = name

    def start(self, steps: LayerSteps, capacity: int) -> Set[int]:
        self.capacity = capacity
        ranks = future_ranks(steps)
        self.rank = ranks[1:]  # rank[t]: futures after step t
        used = np.zeros(steps.num_experts, dtype=bool)
        for needed in steps.needed:
            used[needed] = True
        # the last row of self.rank is all-equal (nothing follows); "used later" per step:
        self.used_after = np.zeros((steps.num_steps, steps.num_experts), dtype=bool)
        for t in range(steps.num_steps - 2, -1, -1):
            self.used_after[t] = self.used_after[t + 1]
            self.used_after[t, steps.needed[t + 1]] = True
        first = [int(x) for x in np.flatnonzero(used)]
        return frozenset(sorted(first, key=lambda x: (ranks[0][x], x))[:capacity])

    def prefetch(self, t: int, resident: frozenset[int]) -> Set[int]:
        return resident

    def choose(self, t: int, resident: frozenset[int], needed: np.ndarray, counts: np.ndarray) -> Set[int]:
        need = frozenset(int(e) for e in needed)
        forced = resident & need
        rank, later = self.rank[t], self.used_after[t]
        rest = [e for e in (resident | need) - forced if e in resident or later[e]]
        rest.sort(key=lambda e: (rank[e], e not in resident, e))
        return forced | frozenset(rest[: self.capacity - len(forced)])


class BeladyAdmit(Belady):
    """Belady under *mandatory admission* from a cold start: every expert a step routes is resident
    after it (when it fits), the other slots keep the residents wanted again soonest, and the cache
    starts empty. This is the oracle of published per-layer residency studies (e.g. the OLMoE
    decode-trace tables research.md compares with), so their numbers can be checked exactly; it
    bounds policies that must admit every miss, not the mechanism (which may read a miss through
    without admitting it: ``Belady`` above, the lower bound)."""

    def __init__(self, name: str = "belady-admit"):
        super().__init__(name)

    def start(self, steps: LayerSteps, capacity: int) -> Set[int]:
        super().start(steps, capacity)
        return frozenset()

    def choose(self, t: int, resident: frozenset[int], needed: np.ndarray, counts: np.ndarray) -> Set[int]:
        rank = self.rank[t]
        need = frozenset(int(e) for e in needed)
        if len(need) >= self.capacity:  # wider than the slots: its residents stay (the mechanism
            forced = resident & need  # keeps them), then the soonest wanted of its other experts
            rest = sorted(need - forced, key=lambda e: (rank[e], e))
            return forced | frozenset(rest[: self.capacity - len(forced)])
        kept = sorted(resident - need, key=lambda e: (rank[e], e))
        return need | frozenset(kept[: self.capacity - len(need)])
