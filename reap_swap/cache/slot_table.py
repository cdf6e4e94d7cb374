"""Which expert occupies which HBM slot: the bookkeeping of a swap, with no GPU in it.

The CUDA engine owns a fixed pool of HBM slots, reserved at startup so that vLLM sizes the KV cache
with the pool already accounted for. A swap is planned here first (evictions, then admissions into
the slots the evictions freed), checked against the pool's capacity before anything moves, and
committed step by step as the engine carries each step out, so that the table always says what
the device really holds, also after a failure half-way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from reap_swap.sizing.cache_tail import swap_table_refusal


class PoolCapacityError(ValueError):
    """The requested resident set needs more HBM slots than the pool has. ``message``: the refusal
    beside lent cache tails (cache_tail.swap_table_refusal, the same sentence from CUDA's
    SlotTable.plan and accounting mode's CacheAccounting.check_swap); the whole pool's text is the
    default."""

    def __init__(self, needed: int, capacity: int, message: str | None = None) -> None:
        self.needed = needed
        self.capacity = capacity
        self.overflow = needed - capacity
        super().__init__(
            message
            or f"resident set needs {needed} expert slots but the HBM pool has {capacity} "
            f"(overflow {self.overflow} experts)"
        )


class SeededCapacityError(PoolCapacityError):
    """A swap set wider than a seeded layer's cache slots (the message names the layer): the CUDA
    seeded cache's refusal (device_cache_seeded.SeededPins.plan) and accounting mode's same one."""

    def __init__(self, layer: int, needed: int, capacity: int) -> None:
        super().__init__(
            needed,
            capacity,
            f"layer {layer}: a swap set of {needed} experts is wider than the layer's {capacity} "
            "cache slots (--reap-cache-seed seeded pins a swap inside them; overflow "
            f"{needed - capacity} experts)",
        )
        self.layer = layer


@dataclass(frozen=True)
class SlotStep:
    layer: int
    expert: int
    slot: int


@dataclass(frozen=True)
class SwapPlan:
    """Evictions first (they free slots), then admissions into free slots; reused stay put."""

    evict: tuple[SlotStep, ...]
    admit: tuple[SlotStep, ...]
    reused: int

    @property
    def is_noop(self) -> bool:
        return not self.evict and not self.admit


@dataclass
class SlotTable:
    num_slots: int
    _where: dict[tuple[int, int], int] = field(default_factory=dict)
    # a set: a commit is O(1) (a list's remove() scanned the whole pool per admission: 7 ms of pure
    # Python in a full-pool swap of 1024 slots, inside the admit loop that paces the copies)
    _free: set[int] = field(default_factory=set)
    # pool slots lent to the device cache tails beside this table, for the refusal's text
    # (cache_tail.swap_table_refusal): over lent_layers layers, lent_per_layer each in the pinned
    # form (lent = layers x N); None where the layers' counts differ (the seeded C_l)
    lent: int = 0
    lent_layers: int = 0
    lent_per_layer: int | None = None

    def __post_init__(self) -> None:
        if self.num_slots < 0:
            raise ValueError("num_slots must be >= 0")
        self._free = set(range(self.num_slots)) - set(self._where.values())

    # -- queries -------------------------------------------------------------------------------
    def slot_of(self, layer: int, expert: int) -> int | None:
        return self._where.get((layer, expert))

    def resident(self) -> dict[int, frozenset[int]]:
        out: dict[int, set[int]] = {}
        for layer, expert in self._where:
            out.setdefault(layer, set()).add(expert)
        return {layer: frozenset(experts) for layer, experts in sorted(out.items())}

    @property
    def used(self) -> int:
        return len(self._where)

    def grow(self, extra: int) -> None:
        """`extra` more slots (the pool grew: --reap-budget auto | GiB); new slots are free."""
        if extra < 0:
            raise ValueError("a pool only grows")
        new = range(self.num_slots, self.num_slots + extra)
        self.num_slots += extra
        self._free.update(new)

    # -- planning ------------------------------------------------------------------------------
    def plan(self, target: Mapping[int, Iterable[int]]) -> SwapPlan:
        """Plan the move to `target` (layers absent from `target` keep nothing resident)."""
        wanted = {(int(layer), int(e)) for layer, experts in target.items() for e in experts}
        if len(wanted) > self.num_slots:
            if self.lent:  # the pinned device cache took the rest of the pool: say so, with the remedy
                why = swap_table_refusal(
                    len(wanted), self.num_slots, self.lent, self.lent_layers, self.lent_per_layer
                )
                raise PoolCapacityError(len(wanted), self.num_slots, why)
            raise PoolCapacityError(len(wanted), self.num_slots)
        current = set(self._where)
        evict = tuple(SlotStep(layer, e, self._where[(layer, e)]) for layer, e in sorted(current - wanted))
        # lowest slot first: a deterministic layout
        free_after = sorted([*(s.slot for s in evict), *self._free])
        admit_keys = sorted(wanted - current)
        admit = tuple(SlotStep(layer, e, free_after[i]) for i, (layer, e) in enumerate(admit_keys))
        return SwapPlan(evict=evict, admit=admit, reused=len(current & wanted))

    # -- commits (one per step actually carried out) -------------------------------------------
    def commit_evict(self, step: SlotStep) -> None:
        slot = self._where.pop((step.layer, step.expert))
        if slot != step.slot:
            raise AssertionError(f"slot table out of sync: {step} held slot {slot}")
        self._free.add(slot)

    def commit_admit(self, step: SlotStep) -> None:
        if (step.layer, step.expert) in self._where:
            raise AssertionError(f"expert already resident: {step}")
        if step.slot not in self._free:
            raise AssertionError(f"slot table out of sync: {step} admitted into a slot that is not free")
        self._free.discard(step.slot)
        self._where[(step.layer, step.expert)] = step.slot
