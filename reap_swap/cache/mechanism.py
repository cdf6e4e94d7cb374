"""The device mechanism, per MoE layer: fixed slots, one decision per step, the rules every policy obeys.

See the package docstring (reap_swap/cache/__init__.py) for the model in words.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass, field, fields
from typing import Protocol

import numpy as np


class PolicyError(RuntimeError):
    """A policy broke the mechanism's rules (a bug in the policy, never silently accepted)."""


@dataclass(frozen=True)
class LayerSteps:
    """What one layer of a trace needs, step by step."""

    layer: int
    num_experts: int
    needed: tuple[np.ndarray, ...]  # per step: the distinct routed experts, ascending
    counts: tuple[np.ndarray, ...]  # per step: routed selections of each of ``needed``
    request_start: np.ndarray  # bool [steps]: the step is a request's prefill

    @classmethod
    def from_counts(cls, layer: int, step_counts: np.ndarray, request_starts: np.ndarray) -> LayerSteps:
        """``step_counts``: [steps, E] selections (Trace.step_counts); ``request_starts``: step ids."""
        needed, counts = [], []
        for row in step_counts:
            nz = np.flatnonzero(row)
            needed.append(nz)
            counts.append(row[nz].astype(np.int64))
        start = np.zeros(len(step_counts), dtype=bool)
        start[np.asarray(request_starts, dtype=np.int64)] = True
        return cls(layer, int(step_counts.shape[1]), tuple(needed), tuple(counts), start)

    @property
    def num_steps(self) -> int:
        return len(self.needed)


@dataclass
class LayerCounts:
    """What one policy did on one layer. Selection counts are the server's unit (a miss = a routed
    selection of a non-resident expert); expert counts are per step and distinct (one per expert a
    step needs: what crosses the host link once per step)."""

    selections: int = 0
    selection_hits: int = 0
    experts: int = 0  # sum over steps of distinct needed experts
    expert_hits: int = 0
    decode_selections: int = 0  # the same two, decode steps only (not a request's prefill)
    decode_selection_hits: int = 0
    decode_experts: int = 0
    decode_expert_hits: int = 0
    admitted: int = 0  # missed experts copied into a slot in their step
    prefetched: int = 0  # experts made resident without being routed that step (per-request swaps)
    bypassed: int = 0  # missed experts read through from host memory and not admitted
    read_through_steps: int = 0  # steps needing more distinct experts than the layer has slots
    steps: int = 0
    start_resident: int = 0  # experts filled at startup (not counted as moved)
    extra: dict = field(default_factory=dict)

    def add(self, other: LayerCounts) -> None:
        for f in fields(self):
            if f.name != "extra":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def expert_misses(self) -> int:
        return self.experts - self.expert_hits

    @property
    def host_reads(self) -> int:
        """Experts that crossed the host link: every miss once, plus every prefetch."""
        return self.expert_misses + self.prefetched

    def to_dict(self, per_expert_bytes: int) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        d.update(self.extra)
        d["selection_misses"] = self.selections - self.selection_hits
        d["expert_misses"] = self.expert_misses
        d["host_reads"] = self.host_reads
        d["selection_hit_rate"] = _ratio(self.selection_hits, self.selections)
        d["expert_hit_rate"] = _ratio(self.expert_hits, self.experts)
        d["decode_selection_hit_rate"] = _ratio(self.decode_selection_hits, self.decode_selections)
        d["decode_expert_hit_rate"] = _ratio(self.decode_expert_hits, self.decode_experts)
        d["bytes_moved"] = (self.admitted + self.prefetched) * per_expert_bytes
        d["host_read_bytes"] = self.host_reads * per_expert_bytes
        return d


def _ratio(a: int, b: int) -> float | None:
    return a / b if b else None


class Policy(Protocol):
    """One layer's cache policy. ``start`` gives the startup contents; ``prefetch`` (only where
    ``prefetches`` is true) may replace the contents at a request's first step before it runs;
    ``choose`` returns the contents after step ``t`` (checked against the rules)."""

    name: str
    prefetches: bool

    def start(self, steps: LayerSteps, capacity: int) -> Set[int]: ...

    def prefetch(self, t: int, resident: frozenset[int]) -> Set[int]: ...

    def choose(
        self, t: int, resident: frozenset[int], needed: np.ndarray, counts: np.ndarray
    ) -> Set[int]: ...


def _check(
    policy: Policy, t: int, old: frozenset[int], new: frozenset[int], needed: frozenset[int], cap: int
):
    if len(new) > cap:
        raise PolicyError(f"{policy.name} step {t}: {len(new)} resident > {cap} slots")
    if not new <= old | needed:
        raise PolicyError(
            f"{policy.name} step {t}: admitted {sorted(new - old - needed)} that the step did not route"
        )
    if not (old & needed) <= new:
        raise PolicyError(
            f"{policy.name} step {t}: evicted {sorted((old & needed) - new)} that the step needs"
        )


def _count_step(c: LayerCounts, hit: np.ndarray, counts: np.ndarray, decode: bool) -> None:
    sel, sel_hit = int(counts.sum()), int(counts[hit].sum())
    n, n_hit = len(counts), int(hit.sum())
    c.selections += sel
    c.selection_hits += sel_hit
    c.experts += n
    c.expert_hits += n_hit
    if decode:
        c.decode_selections += sel
        c.decode_selection_hits += sel_hit
        c.decode_experts += n
        c.decode_expert_hits += n_hit


def replay_layer(policy: Policy, steps: LayerSteps, capacity: int) -> LayerCounts:
    """Run one policy over one layer's steps under the mechanism's rules."""
    c = LayerCounts(steps=steps.num_steps)
    resident = frozenset(int(e) for e in policy.start(steps, capacity))
    if len(resident) > capacity:
        raise PolicyError(f"{policy.name}: starts with {len(resident)} experts in {capacity} slots")
    c.start_resident = len(resident)
    for t in range(steps.num_steps):
        if policy.prefetches and steps.request_start[t]:
            new = frozenset(int(e) for e in policy.prefetch(t, resident))
            if getattr(policy, "resizes", False):  # the device's pinned form: |swap set| + N slots
                capacity = policy.capacity
            if len(new) > capacity:
                raise PolicyError(f"{policy.name} step {t}: prefetch of {len(new)} > {capacity} slots")
            c.prefetched += len(new - resident)
            resident = new
        if hasattr(policy, "begin_step"):  # request-aware policies (learned.py) see the flag
            policy.begin_step(t, bool(steps.request_start[t]))
        needed, counts = steps.needed[t], steps.counts[t]
        hit = np.fromiter((int(e) in resident for e in needed), dtype=bool, count=len(needed))
        _count_step(c, hit, counts, decode=not steps.request_start[t])
        if len(needed) > capacity:
            c.read_through_steps += 1
        need = frozenset(int(e) for e in needed)
        new = frozenset(int(e) for e in policy.choose(t, resident, needed, counts))
        _check(policy, t, resident, new, need, capacity)
        c.admitted += len(new - resident)
        c.bypassed += len(need - resident - new)
        resident = new
    return c
