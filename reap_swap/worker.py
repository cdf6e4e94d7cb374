"""Worker extension (--worker-extension-cls reap_swap.worker.ReapWorkerExtension).

vLLM mixes this class into its worker class in every worker process, so these methods run as
worker methods through `collective_rpc` (on every TP/PP rank, between engine steps). Importing
this module is also what registers ReapRoutedExperts (counting) before the model is built.

The extension may only add names (vLLM asserts no attribute clashes with the worker), hence the
`reap_` / `_reap_` prefixes. Arguments and results are msgpack-able: dicts keyed by strings,
lists, numbers, strings.

Plan and settings arrive in vllm_config.additional_config["reap_swap"] (written by the
launcher): the plan file is re-loaded here and must have the identity the launcher validated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from reap_swap import compat
from reap_swap.active_set import signature
from reap_swap.logs import get_logger
from reap_swap.moe_probe import MoeProbeExtension
from reap_swap.plan import Plan
from reap_swap.residency import count_kernel, counters
from reap_swap.residency import experts as _experts
from reap_swap.residency.accounting import AccountingResidency, ResidentSets
from reap_swap.residency.fault import SwapFault
from reap_swap.settings import ADDITIONAL_CONFIG_KEY, Settings, load_configured_plan, reap_config

log = get_logger("reap_swap.worker")

_experts.register()  # every worker imports this module before its model is built


class ResidencyBackend(Protocol):
    """What a residency implementation offers the worker (accounting here, CUDA in engine.py)."""

    mode: str

    def apply(
        self, keep: ResidentSets, *, dry_run: bool = False, fault: SwapFault | None = None
    ) -> dict: ...  # bytes_copied, seconds, phases, note
    def resident(self) -> ResidentSets: ...
    def status(self) -> dict: ...


def make_residency_backend(worker: Any, plan: Plan, settings: Settings) -> ResidencyBackend:
    """The one place that picks the residency backend for this worker."""
    core = plan.core_sets()
    platform = compat.platform_name()
    reason = settings.accounting_reason(platform)
    if reason is not None:
        if settings.residency == "cuda" and not settings.masks_only:
            raise RuntimeError(f"REAP_RESIDENCY=cuda but this worker's platform is {platform!r}")
        return AccountingResidency(core, plan.per_expert_bytes, reason)
    try:
        from reap_swap.residency.engine import CudaResidency

        return CudaResidency(worker, plan, settings)
    except Exception as exc:  # noqa: BLE001 - any failure to load the engine means no data path
        if settings.residency == "cuda":
            raise
        reason = f"CUDA residency engine unavailable ({type(exc).__name__}: {exc})"
        log.error("reap-swap: %s; falling back to accounting residency (no bytes will move)", reason)
        return AccountingResidency(core, plan.per_expert_bytes, reason)


class _WorkerState:
    def __init__(self, worker: Any):
        vllm_config = worker.vllm_config
        cfg = reap_config(vllm_config.additional_config)
        if not cfg:
            raise RuntimeError(
                "reap-swap worker extension loaded without additional_config"
                f"[{ADDITIONAL_CONFIG_KEY!r}]; start the server with python -m reap_swap.server"
            )
        self.settings, self.plan = load_configured_plan(cfg)
        self.rank = int(getattr(worker, "rank", 0))
        self.ranks = compat.parallel_ranks(vllm_config)
        self.layers = _experts.find_layers(worker.get_model())
        # refused per layer, not fatal: the server starts, counts what it can, says why in status
        self.uncounted = _experts.uncounted_layers(worker.get_model(), self.plan.layers)
        for layer, reason in self.uncounted.items():
            log.error("reap-swap: plan layer %d not counted: %s", layer, reason)
        uncountable = [i for i, m in self.layers.items() if not m.reap_countable]
        if uncountable:
            log.error(
                "reap-swap: layers %s use a monolithic MoE kernel that routes internally; "
                "router statistics for them are unavailable (counts stay 0)",
                uncountable,
            )
        self.backend = make_residency_backend(worker, self.plan, self.settings)
        log.info(
            "reap-swap worker rank %d: %d MoE layers counted, residency %s",
            self.rank,
            len(self.layers),
            self.backend.mode,
        )

        self.fault: SwapFault | None = None  # armed by reap_arm_swap_fault, taken by the next apply

    def header(self) -> dict:
        return {"rank": self.rank, **self.ranks}

    def resident_summary(self, resident: ResidentSets | None = None) -> dict:
        """This rank's resident set as the controller compares it: signature over the plan layers."""
        resident = self.backend.resident() if resident is None else resident
        planned = {l: v for l, v in resident.items() if l in self.plan.layers}
        return {"signature": signature(planned), "resident_experts": sum(len(v) for v in planned.values())}


class ReapWorkerExtension(MoeProbeExtension):
    """RPC methods run on every worker (see docs/architecture.md, Worker RPC); reap_moe_probe
    comes from MoeProbeExtension, which stock servers can load alone."""

    def _reap_state(self) -> _WorkerState:
        state = getattr(self, "_reap_worker_state", None)
        if state is None:
            state = _WorkerState(self)
            self._reap_worker_state = state
        return state

    def reap_status(self) -> dict:
        s = self._reap_state()
        resident = s.backend.resident()
        return {
            **s.header(),
            "mode": s.backend.mode,
            "plan_identity": s.plan.identity,
            "layers": {str(k): sorted(v) for k, v in sorted(resident.items())},
            **s.resident_summary(resident),
            "resident_bytes": sum(len(v) for v in resident.values()) * s.plan.per_expert_bytes,
            "counting": {
                **{str(k): m.reap_countable for k, m in s.layers.items()},
                **{str(k): False for k in s.uncounted},
            },
            "uncounted_layers": {str(k): reason for k, reason in s.uncounted.items()},
            "coactivation": any(getattr(m, counters.COACT) is not None for m in s.layers.values()),
            "counter_kernel": count_kernel.status(),
            "backend": s.backend.status(),
        }

    def reap_apply_residency(self, keep: dict, dry_run: bool = False, read_stats: bool = False) -> dict:
        """Apply a keep-set ({"<l>": [ids]}, every plan layer). With read_stats, the counters are
        read before and zeroed after a successful apply, in this one call, so no engine step falls
        between closing one request's statistics and changing the resident set.

        A failure is returned as {"error": ...} rather than raised: vLLM's multiproc
        collective_rpc stops reading replies at the first failing rank, so a raise on rank 0
        would leave rank 1's reply queued and shift every later RPC reply by one."""
        s = self._reap_state()
        fault, s.fault = (None, s.fault) if dry_run else (s.fault, None)  # one-shot
        try:
            parsed = _parse_keep(s.plan, keep)
            take = bool(read_stats) and not dry_run
            stats = {str(i): counters.read(m, reset=False) for i, m in s.layers.items()} if take else {}
            result = s.backend.apply(parsed, dry_run=bool(dry_run), fault=fault)
            if take:
                for m in s.layers.values():
                    counters.zero(m)
        except Exception as exc:  # noqa: BLE001 - reported to the controller, which rolls back
            log.error("reap-swap rank %d: apply failed: %s: %s", s.rank, type(exc).__name__, exc)
            return {
                **s.header(),
                "dry_run": bool(dry_run),
                "bytes_copied": 0,
                "stats": {},
                "error": f"rank {s.rank}: {type(exc).__name__}: {exc}",
                "rolled_back_locally": getattr(exc, "rolled_back", None),
                **s.resident_summary(),
            }
        return {**s.header(), "dry_run": bool(dry_run), **result, "stats": stats, **s.resident_summary()}

    def reap_arm_swap_fault(self, rank: int, after_admissions: int = 1) -> dict:
        """Test seam: make the next non-dry-run apply on worker `rank` fail (once).

        Accounting fails before its keep-set changes; CUDA fails mid-swap after
        `after_admissions` published admissions, so its local rollback runs. Other ranks ignore
        it. Arguments may arrive as strings (vLLM's dev route POST /collective_rpc)."""
        s = self._reap_state()
        try:  # answered, not raised, on every rank (see reap_apply_residency)
            rank, after_admissions = int(rank), int(after_admissions)
            if after_admissions < 0:
                raise ValueError("must be >= 0")
        except (TypeError, ValueError) as exc:
            return {
                **s.header(),
                "armed": False,
                "error": f"rank={rank!r}, after_admissions="
                f"{after_admissions!r}: expected integers, after_admissions >= 0 ({exc})",
            }
        if rank != s.rank:
            return {
                **s.header(),
                "armed": False,
                "note": f"ignored: this worker is rank {s.rank}, not {rank}",
            }
        s.fault = SwapFault(rank, after_admissions)
        log.warning(
            "reap-swap rank %d: swap fault armed (test seam; fires on the next apply, "
            "after %d admission(s) on CUDA)",
            s.rank,
            after_admissions,
        )
        return {
            **s.header(),
            "armed": True,
            "after_admissions": after_admissions,
            "note": f"the next non-dry-run swap on rank {s.rank} fails once",
        }

    def reap_selfcheck(self) -> dict:
        """Engine self-check (CUDA only): pointers, HBM backings and a timed call per memory."""
        s = self._reap_state()
        check = getattr(s.backend, "selfcheck", None)
        return {
            **s.header(),
            "mode": s.backend.mode,
            **(check() if check else {"note": "no self-check for this residency backend"}),
        }

    def reap_read_stats(self, reset: bool = False) -> dict:
        s = self._reap_state()
        layers = {str(i): counters.read(m, bool(reset)) for i, m in s.layers.items()}
        return {**s.header(), "layers": layers}

    def reap_reset_stats(self) -> dict:
        s = self._reap_state()
        for m in s.layers.values():
            counters.zero(m)
        return {"rank": s.rank}


def _parse_keep(plan: Plan, keep: Mapping) -> ResidentSets:
    """{"<l>": [ids]} -> {l: frozenset}; every plan layer, only candidate experts (defence in depth:
    the API process validated the same plan already)."""
    parsed: ResidentSets = {}
    for key, ids in keep.items():
        layer = int(key)
        if layer not in plan.layers:
            raise ValueError(f"layer {layer} is not in the plan")
        bad = sorted(set(int(e) for e in ids) - plan.layers[layer].candidates)
        if bad:
            raise ValueError(f"layer {layer}: experts {bad} are not candidates of the plan")
        parsed[layer] = frozenset(int(e) for e in ids)
    missing = sorted(set(plan.layers) - set(parsed))
    if missing:
        raise ValueError(f"keep-set lacks plan layers {missing}")
    return parsed
