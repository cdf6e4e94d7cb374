"""The API process's swap state machine: validate, apply on every worker, attribute statistics.

Why separate from routes.py: this is the logic the endpoints share (swap, warm, cartridge,
misses, status) and it only needs an async `rpc(method, **kwargs)` that returns one reply per
worker (the worker RPC contract of reap_swap.engine.wire, spoken by workers.py), so it is
unit-tested against fake workers (tests/reap_fakes.py: the real worker_core.WorkerCore) without vLLM.

Invariants:
- One swap at a time (an asyncio lock; concurrent requests queue). Status and statistics reads
  take the same lock, so they never see half a swap.
- The resident set changes only when every worker applied the new one. If a worker call fails
  (it raises, or a worker answers {"error": ...}), the old resident set is re-applied on every
  worker (best effort) and the caller gets a WorkerSwapFailed (HTTP 5xx) naming the failed ranks
  and each rank's signature after the rollback; the controller's state is what it was before.
- Every swap reports each rank's resident-set signature after it (`workers`); ranks of one pipeline
  stage that disagree are visible in the response and in status() (a stage holds its own layers).
- Statistics attribution (docs/architecture.md): opening request R (swap/warm/cartridge) reads
  and resets the device counters in the same worker call that applies the new resident set,
  credits what was read to the previously open request R' measured against R''s resident set,
  and opens R. Engine steps run between worker calls, never inside one, so no step is split or
  lost. Every request served while R is open is credited to R: the counters are per engine
  step, not per sequence.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from pathlib import Path

from reap_swap.engine import wire
from reap_swap.plan.active_set import (
    RefreshLedger,
    RefreshLimitExceeded,
    ResidentSets,
    SwapRequest,
    check_budget,
    delta,
    delta_summary,
    resident_bytes,
    resident_sets,
    signature,
)
from reap_swap.plan.bounded_map import LRUDict
from reap_swap.plan.cartridges import load_cartridges
from reap_swap.plan.document import Plan
from reap_swap.plan.forensics import ForensicsLog, aggregate_workers, summarize_router_misses
from reap_swap.plan.pool_fill import Pool, fill_pool, pool_from_workers, resolve_swap
from reap_swap.server.attribution import Attribution
from reap_swap.server.swap_failure import WorkerSwapFailed, capacity_refusal, ranks_named_in, stages_agree
from reap_swap.server.swap_report import brief, startup_resident, status_report, swap_response, timing
from reap_swap.server.workers import Rpc, Workers, failures, pin_capacity

log = logging.getLogger("reap_swap.server.controller")

__all__ = ["Metrics", "SwapController", "UnknownCartridge", "WorkerSwapFailed", "load_cartridges"]


class UnknownCartridge(KeyError): ...


class Metrics:
    """What the controller reports to Prometheus; a no-op base so tests need no registry."""

    def swap(self, kind: str, outcome: str, seconds: float, bytes_copied: int) -> None: ...
    def selections(self, routed: int, missed: int) -> None: ...
    def cache(self, cache: Mapping[str, object]) -> None: ...


class SwapController:
    def __init__(
        self,
        plan: Plan,
        rpc: Rpc,
        *,
        plan_file: str | Path | None = None,
        validate_only: bool = False,
        max_loaded_cartridges: int = 8,
        cartridges: Mapping[str, Mapping[str, list]] | None = None,
        metrics: Metrics | None = None,
        keep_pool_full: bool = False,
    ):
        self.plan = plan
        self.plan_file = str(plan_file) if plan_file is not None else None
        self.all_workers = Workers(rpc)
        self.validate_only = validate_only
        self.metrics = metrics or Metrics()
        self.lock = asyncio.Lock()
        self.resident: ResidentSets = resident_sets(plan, {})
        self.sig = signature(self.resident)
        self.residency_mode = "unknown"
        self.attribution = Attribution(self.resident, self.metrics)
        self.forensics = ForensicsLog()
        self.refreshes = RefreshLedger(plan.max_refreshes_per_request)
        self.cartridge_defs = dict(cartridges if cartridges is not None else load_cartridges(plan, plan_file))
        self.cartridges: LRUDict[str, ResidentSets] = LRUDict(max_loaded_cartridges)  # resolved
        self.swap_count = 0
        self.noop_count = 0
        self.failed_count = 0
        self.last_swap_time: float | None = None
        self.last_swap_seconds: float | None = None
        self.workers = 0
        # --reap-budget auto | GiB: swaps fill the workers' pool from the plan's order (pool_fill.py)
        self.keep_pool_full = keep_pool_full
        self.pool: Pool | None = None  # set by start() when keep_pool_full
        self.fill_order = plan.fill_order()[0] if keep_pool_full else []
        # layer -> experts a swap can pin there (the seeded device cache's slots; start() reads it
        # from the workers): a wider set is cut by the plan's rank, the rest left to the cache
        self.pin_capacity: dict[int, int] = {}

    @property
    def open_request(self) -> str | None:
        return self.attribution.open_request

    @property
    def unattributed_selections(self) -> int:
        return self.attribution.unattributed_selections

    # -- startup -----------------------------------------------------------------------------
    async def start(self) -> dict:
        """Adopt the workers' resident set and clear warm-up/profiling counts."""
        async with self.lock:
            statuses = await self.all_workers.statuses()
            if any(s.plan_identity != self.plan.identity for s in statuses):
                raise RuntimeError("a worker loaded a different plan than the API process")
            self.resident = startup_resident(statuses, self.plan.layers)
            if self.keep_pool_full:
                await self._fill_pool_at_start([s.backend for s in statuses])
            self.sig = signature(self.resident)
            self.attribution.open_resident = self.resident
            self.residency_mode = statuses[0].residency_mode
            self.workers = len(statuses)
            self.pin_capacity = pin_capacity(statuses)
            await self.all_workers.reset_stats()
            return {"workers": self.workers, "mode": self.residency_mode, "signature": self.sig}

    async def _fill_pool_at_start(self, backends: list[dict]) -> None:
        """Adopt the workers' pool; fill it (core + order's prefix) if startup did not (accounting)."""
        try:
            self.pool = pool_from_workers(self.plan, backends)
        except ValueError as exc:
            raise RuntimeError(str(exc)) from None
        target, _added = fill_pool(resident_sets(self.plan, {}), self.fill_order, self.pool)
        if all(self.resident.get(layer) == target[layer] for layer in self.pool.layers):
            return
        results = await self.all_workers.apply(target, dry_run=False, read_stats=False)
        message, _ranks = failures(results)
        if message:
            raise RuntimeError(f"filling the pool at startup failed: {message}")
        self.resident = target

    # -- swaps -------------------------------------------------------------------------------
    def resolve_active_set(
        self, active_set: Mapping[str, list], budget_bytes: int | None
    ) -> tuple[ResidentSets, int, dict]:
        """(resident set, budget applied, validation details) of an active set, checked against the
        plan (keep_pool_full: the workers' pool, filled from the plan's order). Raises ActiveSetError."""
        pool = self.pool if self.keep_pool_full else None
        return resolve_swap(self.plan, active_set, budget_bytes, pool, self.fill_order, self.pin_capacity)

    async def swap(self, req: SwapRequest, kind: str = "swap") -> dict:
        """Validate outside the lock (pure), then apply under it."""
        t0 = time.perf_counter()
        resident, _budget, details = self.resolve_active_set(req.active_set, req.budget_bytes)
        t_validate = time.perf_counter() - t0
        async with self.lock:
            return await self._apply(req, kind, resident, details, t0, t_validate)

    async def swap_cartridge(
        self, cartridge_id: str, request_id: str, phase: str = "prefill", budget_bytes: int | None = None
    ) -> dict:
        t0 = time.perf_counter()
        if cartridge_id not in self.cartridge_defs:
            raise UnknownCartridge(cartridge_id)
        loaded = cartridge_id in self.cartridges
        if loaded and (budget_bytes is None or not self.keep_pool_full):  # a filled set: pool's budget
            resident = self.cartridges[cartridge_id]
            details = {
                "resident_experts": sum(len(v) for v in resident.values()),
                "resident_bytes": resident_bytes(self.plan, resident),
            }
            pool_slots = self.pool.slots if self.keep_pool_full and self.pool is not None else None
            details["budget_bytes"] = check_budget(self.plan, resident, budget_bytes, pool_slots)
        else:
            resident, _b, details = self.resolve_active_set(self.cartridge_defs[cartridge_id], budget_bytes)
            self.cartridges[cartridge_id] = resident
        details = {**details, "cartridge": cartridge_id, "cartridge_was_loaded": loaded}
        req = SwapRequest(request_id=request_id, phase=phase, active_set={}, budget_bytes=budget_bytes)
        t_validate = time.perf_counter() - t0
        async with self.lock:
            return await self._apply(req, "cartridge", resident, details, t0, t_validate)

    async def _apply(
        self, req: SwapRequest, kind: str, resident: ResidentSets, details: dict, t0: float, t_validate: float
    ) -> dict:
        """Under the lock: refresh limit, worker call (with rollback), statistics, bookkeeping."""
        if req.phase == "decode_refresh" and self.refreshes.count(req.request_id) + 1 > self.refreshes.limit:
            raise RefreshLimitExceeded(req.request_id, self.refreshes.limit)
        base = self._response_base(req, kind, resident, details)
        if self.validate_only:
            return await self._dry_run(req, kind, resident, base, t0, t_validate)
        t1 = time.perf_counter()
        results = await self._apply_or_roll_back(resident, kind, t0)
        t_workers = time.perf_counter() - t1
        t2 = time.perf_counter()
        refresh_count = self._open_request(req, resident, results)
        phases = {"validate": t_validate, "workers": t_workers, "statistics": time.perf_counter() - t2}
        return self._commit(req, kind, resident, base, results, refresh_count, t0, phases)

    def _response_base(self, req: SwapRequest, kind: str, resident: ResidentSets, details: dict) -> dict:
        return {
            "request_id": req.request_id,
            "phase": req.phase,
            "kind": kind,
            "warm_start_only": bool(req.warm_start_only or kind == "warm"),
            "signature": signature(resident),
            "previous_signature": self.sig,
            "delta": delta_summary(delta(self.resident, resident)),
            **({"unpinned": details["unpinned"]} if details.get("unpinned") else {}),
            "validation": details,
            "mode": self.residency_mode,
            "max_refreshes_per_request": self.refreshes.limit,
        }

    async def _dry_run(
        self, req: SwapRequest, kind: str, resident: ResidentSets, base: dict, t0: float, t_validate: float
    ) -> dict:
        """REAP_SWAP_VALIDATE_ONLY: every worker dry-runs the swap; nothing changes."""
        t1 = time.perf_counter()
        results = await self.all_workers.apply(resident, dry_run=True, read_stats=False)
        message, failed_ranks = failures(results)
        refused = capacity_refusal(results, dry_run=True)
        if refused is not None:
            raise refused
        if message:  # a dry run changes nothing: there is nothing to roll back
            raise WorkerSwapFailed(
                "dry run failed: " + message,
                True,
                failed_ranks=failed_ranks,
                workers=[brief(r) for r in results],
            )
        base.update(
            validate_only=True,
            noop=base["signature"] == self.sig,
            bytes_copied=0,
            refresh_count=self.refreshes.count(req.request_id),
            note="REAP_SWAP_VALIDATE_ONLY: validated by the plan and dry-run on every "
            "worker; nothing changed",
            workers=[brief(r) for r in results],
            timing=timing(t0, {"validate": t_validate, "workers": time.perf_counter() - t1}),
        )
        self.metrics.swap(kind, "validated", time.perf_counter() - t0, 0)
        return base

    async def _apply_or_roll_back(
        self, resident: ResidentSets, kind: str, t0: float
    ) -> list[wire.ApplyReply]:
        """Apply on every worker (reading the counters); on any failure restore the old set and raise."""
        try:
            results = await self.all_workers.apply(resident, dry_run=False, read_stats=True)
            cause: Exception | None = None
            message, failed_ranks = failures(results)
        except Exception as exc:  # noqa: BLE001 - any worker failure
            cause, message = exc, f"{type(exc).__name__}: {exc}"
            failed_ranks = ranks_named_in(str(exc))
        if cause is None and not message:
            return results
        # a capacity refusal moved nothing on the ranks that refused; the others (pipeline stages
        # with room) may have applied, so the previous set is re-applied everywhere either way
        rolled, rb_err, after = await self.all_workers.rollback(self.resident)
        refused = capacity_refusal(results) if cause is None and rolled else None
        self.metrics.swap(kind, "failed" if refused is None else "refused", time.perf_counter() - t0, 0)
        if refused is not None:  # a client error (422), not a failed swap
            log.warning("reap-swap: swap to %s refused: %s", signature(resident), refused)
            raise refused
        self.failed_count += 1
        log.error(
            "reap-swap: swap to %s failed on rank(s) %s (%s); rollback to %s %s",
            signature(resident),
            failed_ranks or "?",
            message,
            self.sig,
            "done" if rolled else "FAILED",
        )
        raise WorkerSwapFailed(
            f"worker call failed: {message}", rolled, rb_err, failed_ranks, after
        ) from cause

    def _open_request(self, req: SwapRequest, resident: ResidentSets, results: list[wire.ApplyReply]) -> int:
        """Credit what the workers read to the open request, then open `req` (returns its refresh count)."""
        stats = aggregate_workers([{**r.model_dump(), "layers": r.stats} for r in results])
        self.attribution.credit(stats, discard=req.reset_router_stats)
        self.attribution.open(req.request_id, resident, reset=req.reset_router_stats)
        return self.refreshes.record(req.request_id, req.phase)

    def _commit(
        self,
        req: SwapRequest,
        kind: str,
        resident: ResidentSets,
        base: dict,
        results: list[wire.ApplyReply],
        refresh_count: int,
        t0: float,
        phases: dict,
    ) -> dict:
        """Adopt the new resident set, count the swap, answer it and remember it (forensics)."""
        if not stages_agree([(r.pp_rank, r.signature) for r in results]):
            log.error(
                "reap-swap: ranks disagree after swap %s: %s", base["signature"], [brief(r) for r in results]
            )
        noop = base["signature"] == self.sig
        self.resident, self.sig = resident, base["signature"]
        self.swap_count += 1
        self.noop_count += int(noop)
        self.last_swap_time = time.time()
        self.last_swap_seconds = time.perf_counter() - t0
        out = swap_response(base, results, noop=noop, refresh_count=refresh_count, swap_seq=self.swap_count)
        out["timing"] = timing(t0, phases, [r.phases for r in results])
        out["forensics"] = self.forensics.update(
            req.request_id,
            last_swap={k: out[k] for k in _FORENSIC_KEYS},
            last_active_set=dict(req.active_set) if req.active_set else None,
            refresh_count=refresh_count,
            plan_identity=self.plan.identity,
            swaps=(self.forensics.get(req.request_id) or {}).get("swaps", 0) + 1,
            updated_at=self.last_swap_time,
        )
        self.metrics.swap(kind, "noop" if noop else "applied", self.last_swap_seconds, out["bytes_copied"])
        return out

    # -- reads -------------------------------------------------------------------------------
    async def router_misses(self, request_id: str, reset: bool = False) -> dict | None:
        async with self.lock:
            if not self.attribution.knows(request_id):
                return None
            is_open = request_id == self.open_request
            live = aggregate_workers(await self.all_workers.read_stats(reset)) if is_open else None
            observed, missed = self.attribution.totals(request_id, live, reset)
            if reset:
                self.attribution.reset(request_id)
            last = (self.forensics.get(request_id) or {}).get("last_swap", {})
            return {
                "request_id": request_id,
                "open": is_open,
                "reset": reset,
                "signature": self.sig if is_open else last.get("signature"),
                "workers": self.workers,
                "tp_disagreement": [
                    dict(layer=k, **x) for k, v in (live or {}).items() for x in v.get("tp_disagreement", [])
                ],
                **summarize_router_misses(observed, missed),
            }

    async def status(self) -> dict:
        async with self.lock:
            out = status_report(self, await self.all_workers.statuses())
        self.metrics.cache(out["cache"])
        return out

    async def cache_trace(self, reset: bool) -> list[wire.CacheTraceReply]:
        async with self.lock:
            return await self.all_workers.cache_trace(reset)


_FORENSIC_KEYS = (
    "kind",
    "phase",
    "signature",
    "previous_signature",
    "noop",
    "delta",
    "validation",
    "bytes_copied",
    "timing",
)
