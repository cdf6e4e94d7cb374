"""The worker's RPC logic without vLLM: resident-set checks, apply with counter reads, statistics.

Why separate from worker.py: everything a worker answers depends only on the plan, the counting
layers (modules carrying counters' buffers), the residency backend and the rank, none of which
needs vLLM. worker.ReapWorkerExtension builds one WorkerCore from its vLLM worker and delegates;
the tests' fake workers are WorkerCores over plain torch modules and the accounting backend, so
the controller's tests exercise the same reply paths (including `{"error": ...}`) as production.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from pydantic import ValidationError

from reap_swap import get_logger
from reap_swap.cache.slot_table import PoolCapacityError
from reap_swap.engine import wire
from reap_swap.engine.counting import counters
from reap_swap.engine.residency.fault import FaultInjectingBackend
from reap_swap.plan.active_set import ResidentSets, signature
from reap_swap.plan.document import Plan

log = get_logger("reap_swap.engine.worker")


class ResidencyBackend(Protocol):
    """What a residency implementation offers the worker (accounting, or cuda_backend.CudaResidency)."""

    residency_mode: str

    def apply(self, resident: ResidentSets, *, dry_run: bool = False) -> dict: ...  # bytes_copied, ...
    def resident(self) -> ResidentSets: ...
    def status(self) -> dict: ...


def check_resident_sets(plan: Plan, resident: ResidentSets) -> ResidentSets:
    """Every plan layer, only expert ids the layer has (defence in depth: the API process validated
    the active set against the plan's candidates already; with --reap-budget auto | GiB the pool is
    also filled from the plan's fill order, which ranks every expert: pool_fill.py). Raises
    ValueError naming the layer."""
    for layer, ids in resident.items():
        if layer not in plan.layers:
            raise ValueError(f"layer {layer} is not in the plan")
        bad = sorted(e for e in ids if not 0 <= e < plan.layers[layer].num_experts)
        if bad:
            raise ValueError(
                f"layer {layer}: experts {bad} are outside the layer's {plan.layers[layer].num_experts}"
            )
    missing = sorted(set(plan.layers) - set(resident))
    if missing:
        raise ValueError(f"resident set lacks plan layers {missing}")
    return resident


class WorkerCore:
    def __init__(
        self,
        plan: Plan,
        layers: Mapping[int, Any],
        backend: ResidencyBackend,
        rank: int,
        ranks: Mapping[str, int],
        counter_kernel: Any = None,
        uncounted: Mapping[int, str] | None = None,
        cache: Any = None,
        other_stage: Iterable[int] = (),
        runner: Mapping[str, Any] | None = None,
    ) -> None:
        self.plan = plan
        # pipeline parallelism: plan layers another stage holds (compat.other_stage_layers); this
        # worker records, counts and answers for the rest only (its `stage`)
        self.stage = frozenset(plan.layers) - frozenset(int(l) for l in other_stage)
        self.layers = dict(layers)  # plan layer index -> counting module
        self.backend = FaultInjectingBackend(backend, rank)
        self.rank = rank
        self.ranks = dict(ranks)  # tp_rank, tp_size, pp_rank, pp_size, dp_rank
        self.counter_kernel = counter_kernel
        self.uncounted = dict(uncounted or {})  # plan layer -> why it has no counting module
        self.cache = cache  # cache_accounting.CacheAccounting (accounting mode), or None
        self._step_snapshot: dict[int, Any] = {}
        self._last_full: ResidentSets | None = None  # the whole set last applied (PP: _changes)
        self.runner = dict(runner or {})  # compat.runner.runner_status: which vLLM model runner

    def header(self) -> dict:
        return {"rank": self.rank, **self.ranks}

    def resident_summary(self, resident: ResidentSets | None = None) -> dict:
        resident = self.backend.resident() if resident is None else resident
        planned = self.mine(resident)
        return {"signature": signature(planned), "resident_experts": sum(len(v) for v in planned.values())}

    def _changes(self, full: ResidentSets, mine: ResidentSets) -> bool:
        """Does a swap to `full` change the resident set? Without PP: this worker's set against
        its backend's. A PP stage compares the whole set last applied (the plan core before the
        first), so a swap changing only another stage's layers counts as a change here too."""
        if self.stage == frozenset(self.plan.layers):
            return mine != self.backend.resident()
        last = self._last_full if self._last_full is not None else self.plan.core_sets()
        return full != {**last, **self.backend.resident()}

    def mine(self, resident: ResidentSets) -> ResidentSets:
        """The part of a resident set this worker's stage holds (all plan layers without PP)."""
        return {l: v for l, v in resident.items() if l in self.stage}

    def read_counters(self, reset: bool) -> dict[str, dict]:
        return {str(i): counters.read(m, reset) for i, m in self.layers.items()}

    def zero_counters(self) -> None:
        for m in self.layers.values():
            counters.zero(m)

    # -- the cache's per-step stream (cache_accounting's module docstring) ------------------------
    def cache_before_step(self) -> None:
        """Snapshot every counted layer's selection counts before an engine step."""
        if self.cache is not None and self.cache.caches:
            self._step_snapshot = {l: getattr(m, counters.COUNTS).clone() for l, m in self.layers.items()}

    def cache_after_step(self, request_start: bool) -> None:
        """Feed the step's counter delta (selections per expert, per layer) to the cache."""
        if self.cache is None or not self._step_snapshot:
            return
        rows = {
            l: (getattr(m, counters.COUNTS) - self._step_snapshot[l]).cpu().numpy()
            for l, m in self.layers.items()
        }
        self._step_snapshot = {}
        self.cache.step(rows, request_start)

    def cache_trace(self, request: Mapping[str, Any]) -> dict:
        req = wire.CacheTrace.model_validate(request)
        record = getattr(self.cache, "record", None)
        steps = self.cache.trace(req.reset) if self.cache is not None else []
        return wire.CacheTraceReply(
            **self.header(), recording=record.maxlen if record is not None else 0, steps=steps
        ).model_dump(exclude_none=True)

    # -- RPCs --------------------------------------------------------------------------------
    def status(self) -> dict:
        resident = self.mine(self.backend.resident())
        return wire.StatusReply(
            **self.header(),
            **self.resident_summary(resident),
            residency_mode=self.backend.residency_mode,
            plan_identity=self.plan.identity,
            layers=wire.encode_resident_sets(resident),
            resident_bytes=sum(len(v) for v in resident.values()) * self.plan.per_expert_bytes,
            counting={
                **{str(k): bool(getattr(m, "reap_countable", True)) for k, m in self.layers.items()},
                **{str(k): False for k in self.uncounted},
            },
            uncounted_layers={str(k): reason for k, reason in self.uncounted.items()},
            coactivation=any(getattr(m, counters.COACT, None) is not None for m in self.layers.values()),
            counter_kernel=self.counter_kernel.status() if self.counter_kernel is not None else {},
            backend=self.backend.status(),
            cache=self.cache.status() if self.cache is not None else None,
            stage_layers=sorted(self.stage),
            runner=self.runner,
        ).model_dump(exclude_none=True)

    def apply(self, request: Mapping[str, Any]) -> dict:
        """reap_apply_residency: a failure is answered as {"error": ...}, never raised (wire.py)."""
        dry_run = bool(request.get("dry_run", False)) if isinstance(request, Mapping) else False
        try:
            req = wire.ApplyResidency.model_validate(request)
            full = check_resident_sets(self.plan, wire.decode_resident_sets(req.resident))
            resident = self.mine(full)
            take = req.read_stats and not req.dry_run
            stats = self.read_counters(reset=False) if take else {}
            changed = self._changes(full, resident)
            check = getattr(self.cache, "check_swap", None)  # accounting: the device's swap capacity
            if check is not None:  # raises PoolCapacityError before anything changes, as CUDA's apply
                check(resident)
            result = self.backend.apply(resident, dry_run=req.dry_run)
            if not req.dry_run:
                self._last_full = full
            if self.cache is not None and not req.dry_run and changed:
                # a swap that changes the set (on any layer, any stage) pins it; the cache's tail
                # yields (a no-op swap, e.g. a plain client's bookkeeping swap to the core, leaves
                # the cache alone)
                self.cache.pin(resident)
            if take:
                self.zero_counters()
        except Exception as exc:  # noqa: BLE001 - reported to the controller, which rolls back
            log.error("reap-swap rank %d: apply failed: %s: %s", self.rank, type(exc).__name__, exc)
            return wire.ApplyReply(
                **self.header(),
                **self.resident_summary(),
                dry_run=dry_run,
                error=f"rank {self.rank}: {type(exc).__name__}: {exc}",
                rolled_back_locally=getattr(exc, "rolled_back", None),
                capacity=(
                    {"needed": exc.needed, "capacity": exc.capacity, "message": str(exc)}
                    if isinstance(exc, PoolCapacityError)
                    else None
                ),
            ).model_dump(exclude_none=True)
        return wire.ApplyReply(
            **self.header(),
            **self.resident_summary(),
            **result,
            dry_run=req.dry_run,
            residency_mode=self.backend.residency_mode,
            stats=stats,
        ).model_dump(exclude_none=True)

    def arm_swap_fault(self, request: Mapping[str, Any]) -> dict:
        """Test seam: the next non-dry-run apply on worker `rank` fails once (engine/residency/fault.py).
        Other ranks ignore it. Arguments may arrive as strings (vLLM's dev route)."""
        try:
            req = wire.ArmSwapFault.model_validate(request)
        except ValidationError as exc:
            return wire.ArmReply(
                **self.header(),
                armed=False,
                error=f"rank={request.get('rank')!r}, after_admissions="
                f"{request.get('after_admissions', 1)!r}: expected integers, after_admissions >= 0 "
                f"({exc.errors()[0]['msg']})",
            ).model_dump(exclude_none=True)
        if req.rank != self.rank:
            note = f"ignored: this worker is rank {self.rank}, not {req.rank}"
            return wire.ArmReply(**self.header(), armed=False, note=note).model_dump(exclude_none=True)
        self.backend.arm(req.after_admissions)
        log.warning(
            "reap-swap rank %d: swap fault armed (test seam; fires on the next apply, "
            "after %d admission(s) on CUDA)",
            self.rank,
            req.after_admissions,
        )
        return wire.ArmReply(
            **self.header(),
            armed=True,
            after_admissions=req.after_admissions,
            note=f"the next non-dry-run swap on rank {self.rank} fails once",
        ).model_dump(exclude_none=True)

    def selfcheck(self) -> dict:
        check = getattr(self.backend.inner, "selfcheck", None)
        return {
            **self.header(),
            "mode": self.backend.residency_mode,
            **(check() if check else {"note": "no self-check for this residency backend"}),
        }

    def read_stats(self, request: Mapping[str, Any]) -> dict:
        req = wire.ReadStats.model_validate(request)
        return wire.StatsReply(**self.header(), layers=self.read_counters(req.reset)).model_dump(
            exclude_none=True
        )

    def reset_stats(self) -> dict:
        """The controller's startup reset: the router counters, and the device cache's own
        (cumulative from here on; a swap's stats read zeroes only the router counters)."""
        self.zero_counters()
        reset = getattr(self.cache, "reset_counters", None)
        if reset is not None:
            reset()
        return wire.ResetReply(rank=self.rank).model_dump(exclude_none=True)


class WorkerRpc:
    """The worker RPC methods (names in wire.py), over `self._reap_core()` -> WorkerCore.

    Mixed into the vLLM worker by worker.ReapWorkerExtension and into the tests' fake workers, so
    both answer through the same methods. Only `reap_` names: vLLM asserts an extension adds no
    attribute the worker class already has.
    """

    def _reap_core(self) -> WorkerCore:
        raise NotImplementedError

    def reap_status(self) -> dict:
        """-> wire.StatusReply"""
        return self._reap_core().status()

    def reap_apply_residency(self, **request) -> dict:
        """wire.ApplyResidency(resident=..., dry_run=..., read_stats=...) -> wire.ApplyReply."""
        return self._reap_core().apply(request)

    def reap_arm_swap_fault(self, rank: Any, after_admissions: Any = 1) -> dict:
        """Test seam (engine/residency/fault.py): wire.ArmSwapFault -> wire.ArmReply. Positional
        arguments are kept for vLLM's dev route POST /collective_rpc (research/gpu/gpu_e2e.py)."""
        return self._reap_core().arm_swap_fault({"rank": rank, "after_admissions": after_admissions})

    def reap_selfcheck(self) -> dict:
        """Engine self-check (CUDA only): pointers, HBM backings and a timed call per memory."""
        return self._reap_core().selfcheck()

    def reap_read_stats(self, reset: bool = False) -> dict:
        """wire.ReadStats -> wire.StatsReply"""
        return self._reap_core().read_stats({"reset": reset})

    def reap_fill_budget(self, extra_slots: int | None = None) -> dict:
        """--reap-budget auto | GiB: workers without an HBM pool (tests' fakes) answer inactive;
        the vLLM worker (worker.ReapWorkerExtension) overrides this."""
        return {"rank": self._reap_core().rank, "active": False, "reason": "no HBM pool in this worker"}

    def reap_reset_stats(self) -> dict:
        """-> wire.ResetReply"""
        return self._reap_core().reset_stats()

    def reap_cache_trace(self, reset: bool = False) -> dict:
        """wire.CacheTrace -> wire.CacheTraceReply: the steps the cache was fed (when recording)."""
        return self._reap_core().cache_trace({"reset": reset})
