"""The expert cache on the API side: /reap/status's "cache" section and the Prometheus counters.

The workers own the cache state (reap_swap.cache.accounting); this process sees it through the
`reap_status` replies. TP ranks run the same policy on the same routing, so their caches must be
identical without communication: the report says whether they are (`ranks_agree`). The
counters are cumulative totals read from rank 0; Prometheus counters are advanced by the
difference each time a status is read (GET /reap/status, and every `REFRESH_S` seconds by the
endpoint plugin's refresh task), so a scrape lags the workers by at most that interval.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import Counter

from reap_swap import get_logger

log = get_logger("reap_swap.cache")

REFRESH_S = 10.0
_HELP = {
    "hits": "Routed selections of experts resident in the expert cache at step start",
    "misses": "Routed selections of experts not resident in the expert cache at step start",
    "promotions": "Experts admitted into a cache slot (missed and copied in its step)",
    "evictions": "Experts that left the cache's slots",
    "read_through_steps": "Layer steps that routed more distinct experts than the layer has slots",
}
COUNTERS = {k: Counter(f"reap_cache_{k}", h) for k, h in _HELP.items()}  # exported as *_total


def report(statuses: Sequence[Any]) -> dict:
    """The cache section of /reap/status from the workers' StatusReply models."""
    caches = [s.cache.model_dump() if s.cache is not None else None for s in statuses]
    if not caches or caches[0] is None:
        return {"engaged": False, "reason": "the workers report no cache (an older worker build?)"}
    stages: dict[int, dict] = {}  # pipeline stage -> its first rank's cache (the stage's reference)
    for s, c in zip(statuses, caches):
        if c is not None:
            stages.setdefault(int(getattr(s, "pp_rank", 0)), c)
    agree = all(_same(c, stages.get(int(getattr(s, "pp_rank", 0)), {})) for s, c in zip(statuses, caches))
    return {**_merge_stages([stages[k] for k in sorted(stages)]), "ranks_agree": agree}


def _merge_stages(refs: list[dict]) -> dict:
    """One cache document over pipeline stages (each holds its own layers): layers joined, totals
    summed; without pipeline parallelism the one stage's document as it is."""
    first = refs[0]
    if len(refs) == 1:
        return first
    totals: dict[str, int] = {}
    layers: dict[str, Any] = {}
    for ref in refs:
        for k, v in (ref.get("totals") or {}).items():
            totals[k] = totals.get(k, 0) + v
        layers.update(ref.get("layers") or {})
    return {
        **first,
        "engaged": any(r.get("engaged") for r in refs),
        "totals": totals,
        "layers": dict(sorted(layers.items(), key=lambda kv: int(kv[0]))),
        "steps": max((int(r.get("steps") or 0) for r in refs), default=0),
    }


def _same(a: Mapping | None, b: Mapping) -> bool:
    if a is None:
        return False
    la, lb = a.get("layers", {}), b.get("layers", {})
    return a.get("totals") == b.get("totals") and all(
        la.get(k, {}).get("resident") == v.get("resident") for k, v in lb.items()
    )


class CacheMetrics:
    """Advance the Prometheus counters to the workers' totals (never backwards: a lower total
    means a restarted worker, whose counts start again from the new baseline)."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}

    def update(self, cache: Mapping[str, Any]) -> None:
        totals = cache.get("totals") or {}
        for name, counter in COUNTERS.items():
            now = int(totals.get(name, 0))
            delta = now - self.seen.get(name, 0)
            if delta > 0:
                counter.inc(delta)
            self.seen[name] = now


async def refresh(status, interval_s: float = REFRESH_S) -> None:
    """Read the status (which updates the counters) every `interval_s` while the server runs."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await status()
        except Exception as exc:  # noqa: BLE001 - a failed refresh must not end the server
            log.warning("reap-swap cache: metrics refresh failed: %s: %s", type(exc).__name__, exc)
