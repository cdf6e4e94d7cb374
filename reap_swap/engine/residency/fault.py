"""A one-shot injected swap failure: the test seam behind the worker RPC `reap_arm_swap_fault`.

Why: a swap failing on one tensor-parallel rank must leave every rank on the previous resident
set, and that has to be shown by injecting the failure, also on a live server.
The seam is a backend wrapper inside the worker (`FaultInjectingBackend`), so no production
signature carries a fault: armed, it fails the next non-dry-run apply once. Over the accounting
backend it fails before the resident set changes; over the CUDA backend it wraps the backend's
ExpertStore for that one apply so that `map_slot` raises after `after_admissions` admissions
were remapped (published too, unless the swap remaps ahead: swap.PUBLISH_AHEAD), which makes apply_swap's own local rollback run for real. A swap with too few
admissions to fail mid-way is undone and fails after it, so an armed fault always fails the call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn


class InjectedSwapFault(RuntimeError):
    """The failure an armed SwapFault raises (its message names the rank)."""


@dataclass
class SwapFault:
    rank: int
    after_admissions: int = 1
    fired: bool = False

    def fire(self, where: str) -> NoReturn:
        self.fired = True
        raise InjectedSwapFault(f"rank {self.rank}: injected swap fault ({where})")

    def wrap(self, store: Any) -> FaultyStore:
        return FaultyStore(store, self)


class FaultyStore:
    """An ExpertStore whose map_slot fails once, after `after_admissions` successful publishes.

    After firing it passes everything through, so the rollback that follows runs normally.
    """

    def __init__(self, store: Any, fault: SwapFault):
        self._store, self._fault, self.published = store, fault, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def map_slot(self, layer: int, expert: int, slot: int) -> None:
        if not self._fault.fired and self.published >= self._fault.after_admissions:
            self._fault.fire(
                f"map_slot of layer {layer} expert {expert} after {self.published} published admission(s)"
            )
        self._store.map_slot(layer, expert, slot)
        self.published += 1


class FaultInjectingBackend:
    """Wraps the worker's residency backend; `arm()` makes its next non-dry-run apply fail once.

    Everything else (resident, status, selfcheck, residency_mode) is the wrapped backend's.
    """

    def __init__(self, backend: Any, rank: int) -> None:
        self.inner = backend
        self.rank = rank
        self.armed: SwapFault | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def arm(self, after_admissions: int = 1) -> SwapFault:
        self.armed = SwapFault(self.rank, after_admissions)
        return self.armed

    def apply(self, resident: Mapping[int, Any], *, dry_run: bool = False) -> dict:
        if dry_run or self.armed is None:  # a dry run never fires it
            return self.inner.apply(resident, dry_run=dry_run)
        fault, self.armed = self.armed, None  # one-shot
        store = getattr(self.inner, "store", None)
        if store is None:  # no data path to break mid-way (accounting)
            fault.fire("accounting apply, before the resident set changed")
        previous = self.inner.resident()
        self.inner.store = fault.wrap(store)
        try:
            result = self.inner.apply(resident)  # SwapStepFailed once the fault fires mid-swap
        finally:
            self.inner.store = store
        self.inner.apply(previous)
        fault.fire(f"after a swap of {result.get('admitted', 0)} admission(s), undone")
