"""The API process's swap state machine: validate, apply on every worker, attribute statistics.

Why separate from routes.py: this is the logic the endpoints share (swap, warm, cartridge,
misses, status) and it only needs an async `rpc(method, *args)` that returns one result per
worker, so it is unit-tested against fake workers without vLLM.

Invariants:
- One swap at a time (an asyncio lock; concurrent requests queue). Status and statistics reads
  take the same lock, so they never see half a swap.
- The resident set changes only when every worker applied the new keep-set. If a worker call
  fails (it raises, or a worker answers {"error": ...}), the old keep-set is re-applied on every
  worker (best effort) and the caller gets a SwapFailed (HTTP 5xx) naming the failed ranks and
  each rank's signature after the rollback; the controller's state is what it was before.
- Every swap reports each rank's resident-set signature after it (`workers`), so a TP group
  whose ranks disagree is visible in the response and in status().
- Statistics attribution (docs/architecture.md): opening request R (swap/warm/cartridge) reads
  and resets the device counters in the same worker call that applies the new keep-set, credits
  what was read to the previously open request R' measured against R''s keep-set, and opens R.
  Engine steps run between worker calls, never inside one, so no step is split or lost. Every
  request served while R is open is credited to R: the counters are per engine step, not per
  sequence.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import orjson

from reap_swap.active_set import (
    ActiveSetError,
    RefreshLedger,
    RefreshLimitExceeded,
    ResidentSets,
    SwapRequest,
    check_budget,
    delta,
    delta_summary,
    normalize_active_set,
    resident_bytes,
    resident_sets,
    signature,
)
from reap_swap.forensics import (
    ForensicsLog,
    StatsLedger,
    add_stats,
    aggregate_workers,
    mask_outside,
    summarize_router_misses,
)
from reap_swap.lru import LRUDict
from reap_swap.plan import Plan

log = logging.getLogger("reap_swap.controller")

Rpc = Callable[..., Awaitable[list]]  # rpc(method, *args) -> one result per worker
CARTRIDGES_FILE = "cartridges.json"


class SwapFailed(RuntimeError):
    """A worker call failed; `rolled_back` says whether the old keep-set was restored.

    `failed_ranks`: the ranks that reported the failure (best effort when the RPC itself raised:
    read from "rank N" in the text); `workers`: each rank's brief after the rollback.
    """

    def __init__(
        self,
        message: str,
        rolled_back: bool,
        rollback_error: str | None = None,
        failed_ranks: list[int] | None = None,
        workers: list[dict] | None = None,
    ):
        super().__init__(message)
        self.rolled_back = rolled_back
        self.rollback_error = rollback_error
        self.failed_ranks = failed_ranks or []
        self.workers = workers or []

    @property
    def workers_consistent(self) -> bool | None:
        """Do the ranks report one signature after the rollback (None: no per-rank replies)?"""
        return len({w.get("signature") for w in self.workers}) == 1 if self.workers else None


_RANK_RE = re.compile(r"\brank (\d+)\b")


def ranks_named_in(text: str) -> list[int]:
    """Ranks a failure message names ("rank 1: ..."): vLLM relays only the worker's message."""
    return sorted({int(m) for m in _RANK_RE.findall(text)})


def _errors(results: list) -> list[Mapping]:
    return [r for r in results if isinstance(r, Mapping) and r.get("error")]


class UnknownCartridge(KeyError):
    pass


def keep_to_wire(keep: ResidentSets) -> dict[str, list[int]]:
    return {str(k): sorted(v) for k, v in sorted(keep.items())}


def keep_from_wire(keep: Mapping[str, Any]) -> ResidentSets:
    return {int(k): frozenset(int(e) for e in v) for k, v in keep.items()}


def load_cartridges(plan: Plan, plan_file: str | Path | None) -> dict[str, Mapping[str, list]]:
    """Cartridges of the plan plus those in cartridges.json beside the plan file, validated.

    The file holds {"cartridges": {id: {layer: [ids or sliceIds]}}} (or the inner mapping alone).
    A cartridge id defined in both places is an error rather than a silent choice.
    """
    found: dict[str, Mapping[str, list]] = {
        k: {lk: list(v) for lk, v in sel.items()} for k, sel in plan.cartridges.items()
    }
    if plan_file is not None:
        path = Path(plan_file).resolve().parent / CARTRIDGES_FILE
        if path.is_file():
            doc = orjson.loads(path.read_bytes())
            doc = doc.get("cartridges", doc) if isinstance(doc, dict) else doc
            if not isinstance(doc, dict):
                raise ValueError(f"{path}: expected an object of cartridges")
            for cid, sel in doc.items():
                if cid in found:
                    raise ValueError(f"{path}: cartridge {cid!r} is also defined in the plan")
                if not isinstance(sel, dict):
                    raise ValueError(f"{path}: cartridge {cid!r} must map layers to expert lists")
                found[cid] = sel
    for cid, sel in found.items():
        try:
            normalize_active_set(plan, sel)
        except ActiveSetError as exc:
            raise ValueError(f"cartridge {cid!r}: {exc}") from None
    return found


class _Ledger(StatsLedger):
    def reset(self, request_id: str) -> None:
        """Zero a request's total (it stays known: a later read answers zeros, not 404)."""
        self._entries[request_id] = {}


class Metrics:
    """What the controller reports to Prometheus; a no-op base so tests need no registry."""

    def swap(self, kind: str, outcome: str, seconds: float, bytes_copied: int) -> None: ...
    def selections(self, routed: int, missed: int) -> None: ...


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
    ):
        self.plan = plan
        self.plan_file = str(plan_file) if plan_file is not None else None
        self._rpc = rpc
        self.validate_only = validate_only
        self.metrics = metrics or Metrics()
        self.lock = asyncio.Lock()
        self.keep: ResidentSets = resident_sets(plan, {})
        self.sig = signature(self.keep)
        self.mode = "unknown"
        self.open_request: str | None = None
        self.open_keep: ResidentSets = self.keep
        self.observed = _Ledger()  # everything routed, per request
        self.missed = _Ledger()  # the part routed to experts outside the keep-set then resident
        self.forensics = ForensicsLog()
        self.refreshes = RefreshLedger(plan.max_refreshes_per_request)
        self.cartridge_defs = dict(cartridges if cartridges is not None else load_cartridges(plan, plan_file))
        self.cartridges: LRUDict[str, ResidentSets] = LRUDict(max_loaded_cartridges)  # prepared keep-sets
        self.swap_count = 0
        self.noop_count = 0
        self.failed_count = 0
        self.last_swap_time: float | None = None
        self.last_swap_seconds: float | None = None
        self.unattributed_selections = 0
        self.workers = 0

    async def rpc(self, method: str, *args) -> list:
        return list(await self._rpc(method, *args))

    # -- startup -----------------------------------------------------------------------------
    async def start(self) -> dict:
        """Adopt the workers' resident set and clear warm-up/profiling counts."""
        async with self.lock:
            statuses = await self.rpc("reap_status")
            sets = {orjson.dumps(s["layers"], option=orjson.OPT_SORT_KEYS) for s in statuses}
            if len(sets) != 1:
                raise RuntimeError(f"workers disagree about the resident set at startup: {statuses}")
            if any(s.get("plan_identity") not in (None, self.plan.identity) for s in statuses):
                raise RuntimeError("a worker loaded a different plan than the API process")
            self.keep = keep_from_wire(statuses[0]["layers"])
            self.sig = signature(self.keep)
            self.open_keep = self.keep
            self.mode = statuses[0].get("mode", "unknown")
            self.workers = len(statuses)
            await self.rpc("reap_reset_stats")
            return {"workers": self.workers, "mode": self.mode, "signature": self.sig}

    # -- swaps -------------------------------------------------------------------------------
    def prepare(
        self, active_set: Mapping[str, list], budget_bytes: int | None
    ) -> tuple[ResidentSets, int, dict]:
        """Validate against the plan: keep-set, budget applied, validation details (raises ActiveSetError)."""
        requested = normalize_active_set(self.plan, active_set)
        keep = resident_sets(self.plan, requested)
        budget = check_budget(self.plan, keep, budget_bytes)
        details = {
            "requested_layers": sorted(requested),
            "requested_experts": sum(len(v) for v in requested.values()),
            "resident_experts": sum(len(v) for v in keep.values()),
            "resident_bytes": resident_bytes(self.plan, keep),
            "budget_bytes": budget,
            "budget_source": "request" if budget_bytes is not None else "plan",
        }
        return keep, budget, details

    async def swap(self, req: SwapRequest, kind: str = "swap") -> dict:
        """Validate outside the lock (pure), then apply under it."""
        t0 = time.perf_counter()
        keep, _budget, details = self.prepare(req.active_set, req.budget_bytes)
        t_validate = time.perf_counter() - t0
        async with self.lock:
            return await self._apply(req, kind, keep, details, t0, t_validate)

    async def swap_cartridge(
        self, cartridge_id: str, request_id: str, phase: str = "prefill", budget_bytes: int | None = None
    ) -> dict:
        t0 = time.perf_counter()
        if cartridge_id not in self.cartridge_defs:
            raise UnknownCartridge(cartridge_id)
        loaded = cartridge_id in self.cartridges
        if loaded:
            keep = self.cartridges[cartridge_id]
            details = {
                "resident_experts": sum(len(v) for v in keep.values()),
                "resident_bytes": resident_bytes(self.plan, keep),
            }
            details["budget_bytes"] = check_budget(self.plan, keep, budget_bytes)
        else:
            keep, _b, details = self.prepare(self.cartridge_defs[cartridge_id], budget_bytes)
            self.cartridges[cartridge_id] = keep
        details = {**details, "cartridge": cartridge_id, "cartridge_was_loaded": loaded}
        req = SwapRequest(request_id=request_id, phase=phase, active_set={}, budget_bytes=budget_bytes)
        t_validate = time.perf_counter() - t0
        async with self.lock:
            return await self._apply(req, "cartridge", keep, details, t0, t_validate)

    async def _apply(
        self, req: SwapRequest, kind: str, keep: ResidentSets, details: dict, t0: float, t_validate: float
    ) -> dict:
        rid, phase = req.request_id, req.phase
        if phase == "decode_refresh" and self.refreshes.count(rid) + 1 > self.refreshes.limit:
            raise RefreshLimitExceeded(rid, self.refreshes.limit)
        new_sig = signature(keep)
        d = delta(self.keep, keep)
        base = {
            "request_id": rid,
            "phase": phase,
            "kind": kind,
            "warm_start_only": bool(req.warm_start_only or kind == "warm"),
            "signature": new_sig,
            "previous_signature": self.sig,
            "delta": delta_summary(d),
            "validation": details,
            "mode": self.mode,
            "max_refreshes_per_request": self.refreshes.limit,
        }
        if self.validate_only:
            t1 = time.perf_counter()
            results = await self.rpc("reap_apply_residency", keep_to_wire(keep), True, False)
            failed = _errors(results)
            if failed:  # a dry run changes nothing: there is nothing to roll back
                raise SwapFailed(
                    "dry run failed: " + "; ".join(r["error"] for r in failed),
                    True,
                    failed_ranks=sorted(int(r["rank"]) for r in failed),
                    workers=[_brief(r) for r in results],
                )
            base.update(
                validate_only=True,
                noop=new_sig == self.sig,
                bytes_copied=0,
                refresh_count=self.refreshes.count(rid),
                note="REAP_SWAP_VALIDATE_ONLY: validated by the plan and dry-run on every "
                "worker; nothing changed",
                workers=[_brief(r) for r in results],
                timing=_timing(t0, {"validate": t_validate, "workers": time.perf_counter() - t1}),
            )
            self.metrics.swap(kind, "validated", time.perf_counter() - t0, 0)
            return base

        noop = new_sig == self.sig
        t1 = time.perf_counter()
        old = self.keep
        try:
            results = await self.rpc("reap_apply_residency", keep_to_wire(keep), False, True)
            cause: Exception | None = None
            message = "; ".join(r["error"] for r in _errors(results))
            failed_ranks = sorted(int(r["rank"]) for r in _errors(results))
        except Exception as exc:  # noqa: BLE001 - any worker failure
            cause, message = exc, f"{type(exc).__name__}: {exc}"
            failed_ranks = ranks_named_in(str(exc))
        if cause is not None or message:
            self.failed_count += 1
            self.metrics.swap(kind, "failed", time.perf_counter() - t0, 0)
            rolled, rb_err, after = await self._rollback(old)
            log.error(
                "reap-swap: swap to %s failed on rank(s) %s (%s); rollback to %s %s",
                new_sig,
                failed_ranks or "?",
                message,
                self.sig,
                "done" if rolled else "FAILED",
            )
            raise SwapFailed(f"worker call failed: {message}", rolled, rb_err, failed_ranks, after) from cause
        t_workers = time.perf_counter() - t1
        sigs = {r.get("signature") for r in results}
        if len(sigs) > 1:
            log.error("reap-swap: ranks disagree after swap %s: %s", new_sig, [_brief(r) for r in results])

        # statistics: what was counted since the previous open belongs to it, under its keep-set
        t2 = time.perf_counter()
        stats = aggregate_workers([{**r, "layers": r.get("stats", {})} for r in results])
        self._credit(stats, discard=req.reset_router_stats)
        if req.reset_router_stats:
            self.observed.reset(rid)
            self.missed.reset(rid)
        self.open_request = rid
        self.open_keep = keep
        self.observed.open(rid)
        self.missed.open(rid)
        refresh_count = self.refreshes.record(rid, phase)
        t_stats = time.perf_counter() - t2

        self.keep, self.sig = keep, new_sig
        bytes_copied = sum(int(r.get("bytes_copied", 0)) for r in results)
        total = time.perf_counter() - t0
        self.swap_count += 1
        self.noop_count += int(noop)
        self.last_swap_time = time.time()
        self.last_swap_seconds = total
        notes = sorted({r.get("note", "") for r in results} - {""})
        worker_phases = [r.get("phases", {}) for r in results]
        base.update(
            validate_only=False,
            noop=noop,
            refresh_count=refresh_count,
            swap_seq=self.swap_count,
            bytes_copied=bytes_copied,
            bytes_copied_per_worker=[int(r.get("bytes_copied", 0)) for r in results],
            note=(
                f"no-op: this active set (signature {new_sig}) is already resident; nothing was applied. "
                if noop
                else ""
            )
            + " ".join(notes),
            workers=[_brief(r) for r in results],
            workers_consistent=len(sigs) == 1,
            timing=_timing(
                t0, {"validate": t_validate, "workers": t_workers, "statistics": t_stats}, worker_phases
            ),
        )
        record = self.forensics.update(
            rid,
            last_swap={
                k: base[k]
                for k in (
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
            },
            last_active_set=dict(req.active_set) if req.active_set else None,
            refresh_count=refresh_count,
            plan_identity=self.plan.identity,
            swaps=(self.forensics.get(rid) or {}).get("swaps", 0) + 1,
            updated_at=self.last_swap_time,
        )
        base["forensics"] = record
        self.metrics.swap(kind, "noop" if noop else "applied", total, bytes_copied)
        return base

    async def _rollback(self, old: ResidentSets) -> tuple[bool, str | None, list[dict]]:
        """Re-apply `old` on every worker: (restored everywhere, error, each rank's brief)."""
        try:
            results = await self.rpc("reap_apply_residency", keep_to_wire(old), False, False)
        except Exception as exc:  # noqa: BLE001
            log.error("reap-swap: rollback to the previous resident set failed: %s", exc)
            return False, f"{type(exc).__name__}: {exc}", []
        failed = _errors(results)
        if failed:
            error = "; ".join(r["error"] for r in failed)
            log.error("reap-swap: rollback to the previous resident set failed: %s", error)
            return False, error, [_brief(r) for r in results]
        return True, None, [_brief(r) for r in results]

    def _credit(self, stats: Mapping[int, Mapping], discard: bool = False) -> None:
        """Credit a counter read (already reset on the workers) to the open request."""
        clean = {int(k): {"counts": v["counts"], "weights": v["weights"]} for k, v in stats.items()}
        if not clean:
            return
        missed = mask_outside(clean, self.open_keep)
        routed = sum(sum(v["counts"]) for v in clean.values())
        self.metrics.selections(routed, sum(sum(v["counts"]) for v in missed.values()))
        if discard:
            return
        if self.open_request is None:
            self.unattributed_selections += routed
            return
        self.observed.close_into(self.open_request, clean)
        self.missed.close_into(self.open_request, missed)

    # -- reads -------------------------------------------------------------------------------
    async def router_misses(self, request_id: str, reset: bool = False) -> dict | None:
        async with self.lock:
            is_open = request_id == self.open_request
            if request_id not in self.observed and not is_open:
                return None
            observed = self.observed.get(request_id) or {}
            missed = self.missed.get(request_id) or {}
            disagreement: list = []
            if is_open:
                reads = await self.rpc("reap_read_stats", bool(reset))
                live = aggregate_workers(reads)
                disagreement = [
                    dict(layer=k, **x) for k, v in live.items() for x in v.get("tp_disagreement", [])
                ]
                clean = {int(k): {"counts": v["counts"], "weights": v["weights"]} for k, v in live.items()}
                outside = mask_outside(clean, self.open_keep)
                if reset:
                    self.metrics.selections(
                        sum(sum(v["counts"]) for v in clean.values()),
                        sum(sum(v["counts"]) for v in outside.values()),
                    )
                observed = add_stats(observed, clean)
                missed = add_stats(missed, outside)
            out = summarize_router_misses(observed, missed)
            if reset:
                self.observed.reset(request_id)
                self.missed.reset(request_id)
            return {
                "request_id": request_id,
                "open": is_open,
                "reset": reset,
                "signature": self.sig
                if is_open
                else (self.forensics.get(request_id) or {}).get("last_swap", {}).get("signature"),
                "workers": self.workers,
                "tp_disagreement": disagreement,
                **out,
            }

    async def status(self) -> dict:
        async with self.lock:
            statuses = await self.rpc("reap_status")
            mine = keep_to_wire(self.keep)
            consistent = all(s.get("layers") == mine for s in statuses)
            return {
                "plan_identity": self.plan.identity,
                "plan_file": self.plan_file,
                "model": self.plan.model,
                "mode": self.mode,
                "validate_only": self.validate_only,
                "signature": self.sig,
                "layers": mine,
                "resident_experts": sum(len(v) for v in self.keep.values()),
                "resident_bytes": resident_bytes(self.plan, self.keep),
                "budget_bytes": self.plan.swappable_budget_bytes,
                "swap_count": self.swap_count,
                "noop_count": self.noop_count,
                "failed_count": self.failed_count,
                "last_swap_time": self.last_swap_time,
                "last_swap_seconds": self.last_swap_seconds,
                "open_request": self.open_request,
                "unattributed_selections": self.unattributed_selections,
                "cartridges": {
                    "defined": sorted(self.cartridge_defs),
                    "loaded": list(self.cartridges),
                    "max_loaded": self.cartridges.max_entries,
                },
                "workers": [
                    {
                        k: s.get(k)
                        for k in (
                            "rank",
                            "tp_rank",
                            "tp_size",
                            "dp_rank",
                            "mode",
                            "resident_bytes",
                            "signature",
                            "resident_experts",
                            "counting",
                            "uncounted_layers",
                        )
                    }
                    for s in statuses
                ],
                "workers_consistent": consistent,
            }


def _brief(r: Mapping) -> dict:
    return {
        k: r[k]
        for k in (
            "rank",
            "tp_rank",
            "dp_rank",
            "bytes_copied",
            "seconds",
            "signature",
            "resident_experts",
            "error",
            "rolled_back_locally",
        )
        if k in r
    }


def _timing(t0: float, phases: dict, worker_phases: list | None = None) -> dict:
    out = {"total_seconds": time.perf_counter() - t0, "phases": phases}
    if worker_phases is not None:
        out["worker_phases"] = worker_phases
    return out
