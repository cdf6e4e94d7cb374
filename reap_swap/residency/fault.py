"""A one-shot injected swap failure: the test seam behind the worker RPC `reap_arm_swap_fault`.

Why: issue #9 asks that a swap failing on one tensor-parallel rank leave every rank on the
previous resident set, and that this be shown by injecting the failure, also on a live server.
The fault is passed explicitly to the one swap it should break (no global state): the accounting
backend fails before it changes its keep-set; the CUDA engine wraps its ExpertStore so that
`map_slot` raises after `after_admissions` admissions were published, which makes apply_swap's
own local rollback run for real.
"""

from __future__ import annotations

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
