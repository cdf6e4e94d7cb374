"""The device expert cache of one MoE layer: state tensors and the per-step update.

Mechanism (research.md, "The device mechanism on CUDA"): the layer's virtual range holds E expert
units (each backed by its pinned host master, or by an HBM slot of the pool when a plan core or a
per-request swap made it resident in its own unit: *pinned*) and N *cache slot units* behind them,
always HBM-backed. Every step, on the device, before the fused-MoE kernel runs:

1. ``step_counts`` (the step's routed selections per expert, padding rows excluded) from the
   ORIGINAL topk ids -- the router counters (reap_swap.engine.counting) count the same ids, before any
   remap.
2. ``DeviceCache.step``: the policy of reap_swap.cache.device (``dlfu``) in int64 torch
   ops, fixed shapes, no ``.item()``, no host sync -- so a CUDA graph captures it and a replay
   updates it with the replayed step's routing. It counts hits/misses against the contents at step
   start, keeps the slots the step needs, admits missed experts into free slots (lowest free slot
   to the lowest admitted expert id), and fills ``copy_expert[s]`` (expert to copy into slot s this
   step, -1: nothing) for the copy kernel (device_cache_copy.py).
3. The copy kernel copies each admitted expert's unit (host-backed: read over PCIe) into its slot.
4. ``remap_ids``: topk ids of experts held in a slot become ``E + slot``; everything else (pinned
   experts, read-through misses, padding rows) keeps its id. The unchanged kernel then reads
   E + N units. A miss that got no slot reads through from its host-backed unit as before.

Every operation is integer arithmetic on identical inputs, so TP ranks (same topk ids) keep
identical caches without communicating. Pinned experts (resident in their own unit) are never
cached in a slot and are always hits; ``set_pinned`` (between steps: a per-request swap) evicts
slots holding newly pinned experts and may shrink the active tail (the tail yields to the swap).

Pure torch: runs on CPU tensors (tests/test_device_policy.py replays the traces against the
simulator) and on CUDA (tests/gpu/test_device_cache.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from reap_swap.cache.device import DECAY_SHIFT, SCORE_FRAC, SCORE_MAX, decay_numerator
from reap_swap.cache.online import LFU_DECAY

# counters (int64 device tensor, read between steps): the cacheacc interface (device_cache_api.py)
COUNTER_NAMES = (
    "steps",
    "selections",
    "selection_hits",
    "experts",  # distinct routed experts per step, summed
    "expert_hits",
    "admitted",  # misses copied into a slot in their step (promotions)
    "evicted",
    "bypassed",  # misses read through from host memory, not admitted
    "read_through_steps",  # steps needing more distinct experts than pinned + active slots
)
_C = {name: i for i, name in enumerate(COUNTER_NAMES)}
MAX_EXPERTS = 1 << 13  # the ranking key packs the expert id into 13 bits


def step_counts(topk_ids: torch.Tensor, num_experts: int, valid_rows: torch.Tensor | None = None):
    """Routed selections per expert of one step: int64 [E]; ids outside [0, E) and invalid rows
    (CUDA-graph padding) are not counted. Fixed shapes, no host sync."""
    ids = topk_ids.to(torch.int64)
    ok = (ids >= 0) & (ids < num_experts)
    if valid_rows is not None:
        ok = ok & valid_rows.reshape(-1, 1).to(torch.bool)
    safe = torch.where(ok, ids, torch.zeros_like(ids)).reshape(-1)
    out = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    return out.index_add_(0, safe, ok.reshape(-1).to(torch.int64))


class DeviceCache:
    """One layer's cache state (all tensors on ``device``, fixed shapes) and its step."""

    def __init__(self, num_experts: int, num_slots: int, device, decay: float = LFU_DECAY) -> None:
        if not 0 < num_experts <= MAX_EXPERTS:
            raise ValueError(f"num_experts {num_experts} not in [1, {MAX_EXPERTS}]")
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_experts, self.num_slots = num_experts, num_slots
        self.decay_num = decay_numerator(decay)
        self.id_bits = max(1, (num_experts - 1).bit_length())
        kw = {"dtype": torch.int64, "device": device}
        self.score = torch.zeros(num_experts, **kw)
        self.slot_expert = torch.full((num_slots,), -1, **kw)
        self.expert_slot = torch.full((num_experts,), -1, **kw)
        self.pinned = torch.zeros(num_experts, dtype=torch.bool, device=device)
        self.active = torch.tensor(num_slots, **kw)  # slots the tail may use (0-dim)
        self.copy_expert = torch.full((num_slots,), -1, **kw)  # this step's admissions, by slot
        self.table = torch.arange(num_experts, **kw)  # id the kernel reads for each expert
        self.counters = torch.zeros(len(COUNTER_NAMES), **kw)
        self._experts = torch.arange(num_experts, **kw)
        self._slots = torch.arange(num_slots, **kw)
        self._tiebreak = (num_experts - 1) - self._experts  # lower id ranks higher

    # ---- between steps (host-driven, not captured) ------------------------------------------
    def resident_experts(self) -> tuple[frozenset[int], frozenset[int]]:
        """(experts in slots, pinned experts): host copies, for tests and status."""
        slots = {int(e) for e in self.slot_expert.tolist() if e >= 0}
        return frozenset(slots), frozenset(int(e) for e in torch.nonzero(self.pinned).flatten().tolist())

    def seed(self, experts: Iterable[int]) -> list[tuple[int, int]]:
        """Fill empty slots with ``experts`` (ascending, lowest free slot first). Returns the
        (expert, slot) pairs whose bytes the caller must copy before the next step."""
        placed = []
        free = [s for s, e in enumerate(self.slot_expert.tolist()) if e < 0 and s < int(self.active)]
        pinned = set(self.resident_experts()[1])
        held = set(self.resident_experts()[0])
        for e in sorted(set(experts) - pinned - held):
            if not free:
                raise ValueError(f"seed: {len(placed)} slots filled, no free slot left for expert {e}")
            placed.append((e, free.pop(0)))
        for e, s in placed:
            self.slot_expert[s] = e
        self._rebuild()
        return placed

    def set_pinned(self, experts: Iterable[int], active_slots: int | None = None) -> list[int]:
        """A per-request swap made ``experts`` resident in their own units: they stop being cached
        (their slots are freed) and the tail may shrink to ``active_slots`` (slots from that index
        on are emptied). Returns the emptied slots."""
        active = self.num_slots if active_slots is None else int(active_slots)
        if not 0 <= active <= self.num_slots:
            raise ValueError(f"active_slots {active} not in [0, {self.num_slots}]")
        mask = torch.zeros_like(self.pinned)
        ids = sorted({int(e) for e in experts})
        if ids and not 0 <= ids[0] <= ids[-1] < self.num_experts:
            raise ValueError(f"pinned experts {ids} outside [0, {self.num_experts})")
        mask[ids] = True
        self.pinned.copy_(mask)
        self.active.fill_(active)
        emptied = []
        for s, e in enumerate(self.slot_expert.tolist()):
            if e >= 0 and (s >= active or e in ids):
                emptied.append(s)
                self.slot_expert[s] = -1
        self._rebuild()
        return emptied

    def _rebuild(self) -> None:
        """expert_slot and table from slot_expert (also inside step, with fixed shapes)."""
        dump = self.num_experts  # a scatter target past the end for empty slots
        inv = torch.full((self.num_experts + 1,), -1, dtype=torch.int64, device=self.score.device)
        inv.scatter_(0, torch.where(self.slot_expert >= 0, self.slot_expert, dump), self._slots)
        self.expert_slot.copy_(inv[: self.num_experts])
        self.table.copy_(
            torch.where(self.expert_slot >= 0, self.num_experts + self.expert_slot, self._experts)
        )
        self.copy_expert.fill_(-1)

    def state_tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor a step writes (snapshot/restore around a CUDA-graph warm-up)."""
        return (self.score, self.slot_expert, self.expert_slot, self.copy_expert, self.table, self.counters)

    def read_counters(self, reset: bool = False) -> dict[str, int]:
        vals = self.counters.tolist()
        if reset:
            self.counters.zero_()
        return dict(zip(COUNTER_NAMES, vals, strict=True))

    # ---- the step (captured) ------------------------------------------------------------------
    def step(self, counts: torch.Tensor) -> torch.Tensor:
        """Update the cache for one step's ``counts`` (int64 [E], step_counts). Returns the remap
        table (int64 [E]): the unit each expert is read from this step."""
        need = counts > 0
        in_slot = self.expert_slot >= 0
        resident = in_slot | self.pinned
        self._count(counts, need, resident)
        decayed = (self.score * self.decay_num) >> DECAY_SHIFT
        self.score.copy_(torch.clamp(decayed + (counts << SCORE_FRAC), max=SCORE_MAX))
        new_in = self._choose(need, in_slot)
        self._place(in_slot, new_in)
        c = self.counters
        c[_C["bypassed"]] += (need & ~resident & ~new_in).sum()
        wide = need.sum() > self.pinned.sum() + self.active
        c[_C["read_through_steps"]] += wide.to(torch.int64)
        return self.table

    def _count(self, counts: torch.Tensor, need: torch.Tensor, resident: torch.Tensor) -> None:
        hit = need & resident
        upd = torch.stack(
            (
                torch.ones((), dtype=torch.int64, device=counts.device),
                counts.sum(),
                (counts * hit).sum(),
                need.sum(),
                hit.sum(),
            )
        )
        self.counters[:5] += upd

    def _choose(self, need: torch.Tensor, in_slot: torch.Tensor) -> torch.Tensor:
        """The experts held in slots after the step (bool [E]): simulator's _Ranked.choose."""
        forced = in_slot & need
        free = self.active - forced.sum()
        rest = (in_slot | need) & ~forced & ~self.pinned
        b = self.id_bits
        key = (
            (need.to(torch.int64) << 61)
            | (self.score << (b + 1))
            | (in_slot.to(torch.int64) << b)
            | self._tiebreak
        )
        key = torch.where(rest, key, torch.full_like(key, -1))
        rank = (key.unsqueeze(0) > key.unsqueeze(1)).sum(dim=1)  # how many rest experts outrank e
        return forced | (rest & (rank < free))

    def _place(self, in_slot: torch.Tensor, new_in: torch.Tensor) -> None:
        """Evict and admit: the k-th admitted expert (ascending id) into the k-th free slot."""
        evict, admit = in_slot & ~new_in, new_in & ~in_slot
        se = self.slot_expert
        leaving = torch.where(se >= 0, evict[se.clamp(min=0)], torch.zeros_like(se, dtype=torch.bool))
        free = (self._slots < self.active) & ((se < 0) | leaving)
        free_rank = torch.cumsum(free.to(torch.int64), 0) - 1
        n_admit = admit.sum()
        size = max(self.num_experts, self.num_slots) + 1
        order = torch.full((size,), -1, dtype=torch.int64, device=se.device)
        admit_rank = torch.cumsum(admit.to(torch.int64), 0) - 1
        order.scatter_(0, torch.where(admit, admit_rank, size - 1), self._experts)
        gets = free & (free_rank < n_admit)
        incoming = order[free_rank.clamp(min=0, max=size - 2)]
        copy = torch.where(gets, incoming, torch.full_like(se, -1))
        se.copy_(torch.where(gets, incoming, torch.where(free, torch.full_like(se, -1), se)))
        self._rebuild()
        self.copy_expert.copy_(copy)
        self.counters[_C["admitted"]] += n_admit
        self.counters[_C["evicted"]] += evict.sum()


def policy_step(name: str):
    """The per-layer policy step by name (``POLICY_STEPS``), each equal to ``_policy`` bit for bit.

    ``torch``: ``_policy``, the reference (torch ops; any device, any size). ``compiled``: the same
    function fused by Inductor, compiled on the first call, which must come before CUDA-graph
    capture (vLLM's warm-up). ``triton``: the kernel that serves (device_cache/fast.py: one
    program per layer-step, a CUDA graph captures it; E and N up to ``fast.MAX_UNITS``)."""
    if name == "torch":
        return _policy
    if name == "compiled":
        return torch.compile(_policy, fullgraph=True)
    if name == "triton":
        from reap_swap.engine.device_cache.fast import fast_policy

        return fast_policy
    raise ValueError(f"unknown policy step {name!r}; known: {', '.join(POLICY_STEPS)}")


POLICY_STEPS = ("torch", "compiled", "triton")


class LayerStep:
    """What the layer runs per step, in stream order (fixed shapes, captured with the forward):
    count the step's routing (original ids), update the cache, copy admissions into slots, return
    the remapped ids for the kernel over E + N units. ``units``: device_cache_copy.unit_view."""

    def __init__(
        self,
        cache: DeviceCache,
        units: torch.Tensor,
        copy_fn=None,
        step: str = "torch",
    ) -> None:
        from reap_swap.engine.device_cache.copy import copy_units, copy_units_torch

        self.cache, self.units = cache, units
        # CUDA: the Triton kernel; CPU tensors (tests, accounting): the torch reference
        self.copy_fn = copy_fn or (copy_units if units.is_cuda else copy_units_torch)
        self._policy = policy_step(step)

    def seed(self, experts: Iterable[int]) -> list[tuple[int, int]]:
        """Fill free slots with ``experts`` and copy their bytes (between steps: startup fill)."""
        placed = self.cache.seed(experts)
        for e, s in placed:
            self.units[self.cache.num_experts + s].copy_(self.units[e])
        return placed

    def __call__(self, topk_ids: torch.Tensor, valid_rows: torch.Tensor | None = None) -> torch.Tensor:
        ids = self._policy(self.cache, topk_ids, valid_rows)
        self.copy_fn(self.units, self.cache.copy_expert, self.cache.num_experts)
        return ids


def _policy(cache: DeviceCache, topk_ids: torch.Tensor, valid_rows: torch.Tensor | None) -> torch.Tensor:
    """Count, update, remap: the ids the kernel reads (the copy is launched after, in stream order;
    the remap may run first: the copy writes only slot units, the kernel reads them after both)."""
    table = cache.step(step_counts(topk_ids, cache.num_experts, valid_rows))
    return remap_ids(topk_ids, table)


def remap_ids(topk_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The ids the kernel reads: ``table[id]`` (ids outside [0, E) unchanged), same dtype/shape."""
    num_experts = table.shape[0]
    ids = topk_ids.to(torch.int64)
    ok = (ids >= 0) & (ids < num_experts)
    mapped = table[torch.where(ok, ids, torch.zeros_like(ids))]
    return torch.where(ok, mapped, ids).to(topk_ids.dtype)
