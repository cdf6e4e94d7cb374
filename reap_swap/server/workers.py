"""Every worker, as the swap controller calls them: the worker RPC as typed calls, and readings of the replies.

The controller needs only an async `rpc(method, **kwargs)` that returns one reply per worker (the
worker RPC contract of reap_swap.engine.wire). This module is the one place that speaks it: each
call validates the replies back into wire models, `rollback` re-applies an old resident set on
every worker, and `failures` / `pin_capacity` read what the replies say. Kept apart from
controller.py so the state machine reads as its steps, and so tests can stand in for one call
(e.g. a rollback that fails) without fake workers.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from reap_swap.engine import wire
from reap_swap.plan.active_set import ResidentSets
from reap_swap.server.swap_report import brief

log = logging.getLogger("reap_swap.server.workers")

Rpc = Callable[..., Awaitable[list]]  # rpc(method, **kwargs) -> one reply per worker


def failures(results: list[wire.ApplyReply]) -> tuple[str, list[int]]:
    """(every failed rank's error joined, the failed ranks); ("", []) when all applied."""
    failed = [r for r in results if r.error]
    return "; ".join(r.error for r in failed), sorted(r.rank for r in failed)


def pin_capacity(statuses: list[wire.StatusReply]) -> dict[int, int]:
    """layer -> what a swap can pin there, from the workers' cache status (``pin_capacity``: the
    seeded device cache's slots per layer); the smallest any rank reports (a pipeline stage
    reports its own layers). Empty where no worker reports one (a swap is then checked against
    the pool as a whole)."""
    out: dict[int, int] = {}
    for s in statuses:
        extra = (s.cache.model_extra or {}) if s.cache is not None else {}
        for layer, cap in (extra.get("pin_capacity") or {}).items():
            out[int(layer)] = min(int(cap), out.get(int(layer), int(cap)))
    return out


class Workers:
    """The worker RPC (reap_swap.engine.wire) over every worker: one validated reply per worker."""

    def __init__(self, rpc: Rpc) -> None:
        self._rpc = rpc

    async def apply(
        self, resident: ResidentSets, *, dry_run: bool, read_stats: bool
    ) -> list[wire.ApplyReply]:
        request = wire.ApplyResidency(
            resident=wire.encode_resident_sets(resident), dry_run=dry_run, read_stats=read_stats
        )
        results = await self._rpc(wire.APPLY_RESIDENCY, **request.model_dump())
        return wire.replies(wire.ApplyReply, list(results))

    async def statuses(self) -> list[wire.StatusReply]:
        return wire.replies(wire.StatusReply, list(await self._rpc(wire.STATUS)))

    async def read_stats(self, reset: bool) -> list[dict]:
        results = await self._rpc(wire.READ_STATS, **wire.ReadStats(reset=reset).model_dump())
        return [r.model_dump() for r in wire.replies(wire.StatsReply, list(results))]

    async def reset_stats(self) -> None:
        await self._rpc(wire.RESET_STATS)

    async def cache_trace(self, reset: bool) -> list[wire.CacheTraceReply]:
        return wire.replies(wire.CacheTraceReply, list(await self._rpc(wire.CACHE_TRACE, reset=reset)))

    async def rollback(self, old: ResidentSets) -> tuple[bool, str | None, list[dict]]:
        """Re-apply `old` on every worker: (restored everywhere, error, each rank's brief)."""
        try:
            results = await self.apply(old, dry_run=False, read_stats=False)
        except Exception as exc:  # noqa: BLE001
            log.error("reap-swap: rollback to the previous resident set failed: %s", exc)
            return False, f"{type(exc).__name__}: {exc}", []
        error, _ranks = failures(results)
        if error:
            log.error("reap-swap: rollback to the previous resident set failed: %s", error)
            return False, error, [brief(r) for r in results]
        return True, None, [brief(r) for r in results]
