"""Statistics attribution: which request each read of the device counters is credited to.

Opening request R (a swap, warm or cartridge) credits what the workers counted since the last
open to the request that was open then, measured against *its* resident set (a miss is a routed
selection outside it), and opens R. Reads of the open request add what the workers have counted
so far. Pure: counter reads arrive as aggregated per-layer stats (forensics.aggregate_workers).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from reap_swap.plan.active_set import ResidentSets
from reap_swap.plan.forensics import StatsLedger, add_stats, mask_outside


class _Ledger(StatsLedger):
    def reset(self, request_id: str) -> None:
        """Zero a request's total (it stays known: a later read answers zeros, not 404)."""
        self._entries[request_id] = {}


def _clean(stats: Mapping) -> dict[int, dict]:
    return {int(k): {"counts": v["counts"], "weights": v["weights"]} for k, v in stats.items()}


def _total(stats: Mapping[int, Mapping]) -> int:
    return sum(sum(v["counts"]) for v in stats.values())


class Attribution:
    def __init__(self, resident: ResidentSets, metrics: Any) -> None:
        self.metrics = metrics  # controller.Metrics: selections(routed, missed)
        self.observed = _Ledger()  # everything routed, per request
        self.missed = _Ledger()  # the part routed outside the resident set of its request
        self.open_request: str | None = None
        self.open_resident: ResidentSets = resident
        self.unattributed_selections = 0

    def knows(self, request_id: str) -> bool:
        return request_id in self.observed or request_id == self.open_request

    def credit(self, stats: Mapping, discard: bool = False) -> None:
        """Credit a counter read (already reset on the workers) to the open request."""
        clean = _clean(stats)
        if not clean:
            return
        missed = mask_outside(clean, self.open_resident)
        routed = _total(clean)
        self.metrics.selections(routed, _total(missed))
        if discard:
            return
        if self.open_request is None:
            self.unattributed_selections += routed
            return
        self.observed.close_into(self.open_request, clean)
        self.missed.close_into(self.open_request, missed)

    def open(self, request_id: str, resident: ResidentSets, reset: bool) -> None:
        """Open `request_id` under `resident` (with `reset`, its totals so far are zeroed)."""
        if reset:
            self.reset(request_id)
        self.open_request = request_id
        self.open_resident = resident
        self.observed.open(request_id)
        self.missed.open(request_id)

    def totals(self, request_id: str, live: Mapping | None, reset: bool) -> tuple[dict, dict]:
        """(observed, missed) of a request, plus `live` (a read of the open request's counters)."""
        observed = self.observed.get(request_id) or {}
        missed = self.missed.get(request_id) or {}
        if live is None:
            return observed, missed
        clean = _clean(live)
        outside = mask_outside(clean, self.open_resident)
        if reset:
            self.metrics.selections(_total(clean), _total(outside))
        return add_stats(observed, clean), add_stats(missed, outside)

    def reset(self, request_id: str) -> None:
        self.observed.reset(request_id)
        self.missed.reset(request_id)
