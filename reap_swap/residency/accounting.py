"""Accounting residency: the resident set as state only; no bytes move.

Why it exists: on vLLM's CPU build every expert already lives in host memory and the CPU fused-MoE
kernel ignores expert_map, so there is nothing to move and no way to make a kernel skip an expert.
What stays real: validation, the current keep-set, and router statistics / misses measured
against it. Also used on CUDA when REAP_SWAP_MASKS_ONLY asks for state-only swaps, or (loudly)
when the CUDA engine cannot be loaded.
"""

from __future__ import annotations

import time
from typing import Any

ResidentSets = dict[int, frozenset[int]]


class AccountingResidency:
    mode = "accounting"

    def __init__(self, initial: ResidentSets, per_expert_bytes: int, reason: str):
        self._keep: ResidentSets = {int(k): frozenset(v) for k, v in initial.items()}
        self._per_expert_bytes = int(per_expert_bytes)
        self.reason = reason
        self._applies = 0

    def apply(self, keep: ResidentSets, *, dry_run: bool = False, fault: Any = None) -> dict:
        """Record `keep`; an armed `fault` (residency.fault.SwapFault) fails before anything changes."""
        if fault is not None and not dry_run:
            fault.fire("accounting apply, before the keep-set changed")
        t0 = time.perf_counter()
        added = sum(len(ids - self._keep.get(layer, frozenset())) for layer, ids in keep.items())
        if not dry_run:
            self._keep = {int(k): frozenset(v) for k, v in keep.items()}
            self._applies += 1
        seconds = time.perf_counter() - t0
        return {
            "bytes_copied": 0,
            "seconds": seconds,
            "phases": {"bookkeeping": seconds},
            "experts_added": added,
            "note": f"accounting mode: {self.reason}; the resident set is recorded and router "
            f"misses are measured against it, but no expert weights were copied",
        }

    def resident(self) -> ResidentSets:
        return dict(self._keep)

    def status(self) -> dict:
        return {
            "mode": self.mode,
            "reason": self.reason,
            "applies": self._applies,
            "resident_bytes": sum(len(v) for v in self._keep.values()) * self._per_expert_bytes,
            "bytes_copied_total": 0,
        }
