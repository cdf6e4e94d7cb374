"""Accounting residency: the resident set as state only; no bytes move.

Why it exists: on vLLM's CPU build every expert already lives in host memory and the CPU fused-MoE
kernel ignores expert_map, so there is nothing to move and no way to make a kernel skip an expert.
What stays real: validation, the current resident set, and router statistics / misses measured
against it. Also used on CUDA when REAP_SWAP_MASKS_ONLY asks for state-only swaps, or (loudly)
when the CUDA engine cannot be loaded.
"""

from __future__ import annotations

import time

ResidentSets = dict[int, frozenset[int]]


class AccountingResidency:
    residency_mode = "accounting"

    def __init__(
        self,
        initial: ResidentSets,
        per_expert_bytes: int,
        reason: str,
        refused_layers: dict[str, str] | None = None,
    ):
        self._resident: ResidentSets = {int(k): frozenset(v) for k, v in initial.items()}
        self._per_expert_bytes = int(per_expert_bytes)
        self.reason = reason
        # the CUDA engine's per-layer refusals when it fell back here (layer name -> why stock path)
        self.refused_layers = dict(refused_layers or {})
        self._applies = 0

    def apply(self, resident: ResidentSets, *, dry_run: bool = False) -> dict:
        """Record `resident` as the resident set (a dry run records nothing)."""
        t0 = time.perf_counter()
        added = sum(len(ids - self._resident.get(layer, frozenset())) for layer, ids in resident.items())
        if not dry_run:
            self._resident = {int(k): frozenset(v) for k, v in resident.items()}
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
        return dict(self._resident)

    def status(self) -> dict:
        return {
            "mode": self.residency_mode,
            "reason": self.reason,
            "refused_layers": dict(self.refused_layers),
            "applies": self._applies,
            "resident_bytes": sum(len(v) for v in self._resident.values()) * self._per_expert_bytes,
            "bytes_copied_total": 0,
        }
