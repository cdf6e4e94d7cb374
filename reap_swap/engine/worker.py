"""Worker extension (--worker-extension-cls reap_swap.engine.worker.ReapWorkerExtension).

vLLM mixes this class into its worker class in every worker process, so these methods run as
worker methods through `collective_rpc` (on every TP/PP rank, between engine steps). The
counting ReapRoutedExperts is registered by the `reap_swap_layers` general plugin
(reap_swap.engine.plugins), which vLLM loads in every process before the model is built.

The extension may only add names (vLLM asserts no attribute clashes with the worker), hence the
`reap_` / `_reap_` prefixes. Requests and replies are the models of reap_swap.engine.wire; the logic is
reap_swap.engine.worker_core.WorkerCore, built once per process from the worker runtime
(reap_swap.engine.runtime: plan and settings read once from additional_config["reap_swap"]).
"""

from __future__ import annotations

from typing import Any

from reap_swap import compat, get_logger
from reap_swap.cache.accounting import CacheAccounting
from reap_swap.compat import moe as vllm_moe
from reap_swap.compat import runner as vllm_runner
from reap_swap.config.settings import ADDITIONAL_CONFIG_KEY
from reap_swap.engine import routed_experts as _experts
from reap_swap.engine import runtime as worker_runtime
from reap_swap.engine.counting import counters
from reap_swap.engine.moe_probe import MoeProbeExtension
from reap_swap.engine.residency.accounting import AccountingResidency
from reap_swap.engine.residency.refusals import NothingRehomed
from reap_swap.engine.runtime import WorkerRuntime
from reap_swap.engine.worker_core import ResidencyBackend, WorkerCore, WorkerRpc

log = get_logger("reap_swap.engine.worker")


def make_residency_backend(
    runtime: WorkerRuntime, platform: str, other_stage: frozenset[int] = frozenset()
) -> ResidencyBackend:
    """The one place that picks the residency backend for this worker (`other_stage`: plan layers
    another pipeline stage holds, left out of this worker's resident set)."""
    plan, settings = runtime.plan, runtime.settings
    core = {l: ids for l, ids in plan.core_sets().items() if l not in other_stage}
    reason = settings.accounting_reason(platform)
    if reason is not None:
        if settings.residency.backend == "cuda" and not settings.residency.masks_only:
            raise RuntimeError(f"REAP_RESIDENCY=cuda but this worker's platform is {platform!r}")
        return AccountingResidency(core, plan.per_expert_bytes, reason)
    try:
        if runtime.engine is None:
            raise RuntimeError(runtime.engine_error or "no MoE layer reached the CUDA engine")
        grouped = getattr(runtime.engine.state, "grouped", None)  # --reap-group-size b > 1
        if grouped is not None and grouped.layers:
            from reap_swap.engine.residency.grouped_backend import GroupedResidency

            return GroupedResidency(runtime.engine)
        from reap_swap.engine.residency.cuda_backend import CudaResidency

        return CudaResidency(runtime.engine)
    except Exception as exc:  # noqa: BLE001 - any failure to load the engine means no data path
        if settings.residency.backend == "cuda":
            raise
        reason = f"CUDA residency engine unavailable ({type(exc).__name__}: {exc})"
        refused = getattr(getattr(runtime.engine, "refusals", None), "reasons", None)
        stuck = getattr(runtime.engine, "pending_meta", None)  # layers that never left meta: a real failure
        if isinstance(exc, NothingRehomed) and refused and not stuck:  # by design: each layer said why above
            log.warning(
                "reap-swap: all %d MoE layers keep vLLM's stock path (refused by name above); swaps run in "
                "accounting mode (no bytes will move)",
                len(refused),
            )
        else:
            log.error("reap-swap: %s; falling back to accounting residency (no bytes will move)", reason)
        return AccountingResidency(core, plan.per_expert_bytes, reason, refused)


def build_cache(runtime: WorkerRuntime, layers: dict, uncounted: dict, backend) -> CacheAccounting:
    """The expert cache of this worker: accounting state on an accounting backend, else disengaged
    with the reason (the CUDA slot-tail mechanism is built by the device-cache work, not here)."""
    settings, plan = runtime.settings, runtime.plan
    if settings.cache.policy == "off":
        return CacheAccounting.disengaged("--reap-cache off")
    top_k = max((int(getattr(m, "top_k", 1)) for m in layers.values()), default=1)
    cfg = getattr(runtime.engine, "cache", None) if backend.residency_mode == "cuda" else None
    if cfg is not None:  # the CUDA device cache: counters read from the device
        from reap_swap.engine.device_cache.serving import DeviceCacheView

        return DeviceCacheView(cfg, top_k)
    if backend.residency_mode == "cuda" and getattr(runtime, "cache_reason", None):
        return CacheAccounting.disengaged(runtime.cache_reason)
    if backend.residency_mode != "accounting":
        return CacheAccounting.disengaged(
            f"residency {backend.residency_mode}: the device cache (slot tail, device policy kernel) "
            "is not in this build; use --reap-residency accounting to run the policy as state only"
        )
    counted = {l: int(getattr(m, counters.COUNTS).shape[0]) for l, m in layers.items() if m.reap_countable}
    why = dict(uncounted)
    why.update({l: "monolithic MoE kernel" for l, m in layers.items() if not m.reap_countable})
    pool = getattr(runtime.engine, "pool_tail_slots", None)  # --reap-budget auto's interface, if present
    return CacheAccounting.build(
        plan,
        settings.cache.policy,
        settings.cache.slots,
        counted,
        why,
        top_k,
        record_steps=settings.cache.record_steps,
        pool_tail_slots=pool,
        seed=settings.cache.seed,
        cache_device=settings.cache.device,
    )


def build_core(worker: Any, runtime: WorkerRuntime) -> WorkerCore:
    """This vLLM worker's WorkerCore: its counting layers, its backend, its ranks."""
    if not runtime.configured:
        raise RuntimeError(
            "reap-swap worker extension loaded without additional_config"
            f"[{ADDITIONAL_CONFIG_KEY!r}]; start the server with python -m reap_swap.server"
        )
    plan = runtime.plan
    layers = _experts.find_layers(worker.get_model())
    # pipeline parallelism: another stage's layers are neither counted nor refused here
    other_stage = frozenset(compat.other_stage_layers(worker.get_model()) & set(plan.layers))
    # refused per layer, not fatal: the server starts, counts what it can, says why in status
    uncounted = _experts.uncounted_layers(worker.get_model(), set(plan.layers) - other_stage)
    for layer, reason in uncounted.items():
        log.error("reap-swap: plan layer %d not counted: %s", layer, reason)
    uncountable = [i for i, m in layers.items() if not m.reap_countable]
    if uncountable:
        log.error(
            "reap-swap: layers %s use a monolithic MoE kernel that routes internally; "
            "router statistics for them are unavailable (counts stay 0)",
            uncountable,
        )
    runner = runner_status(worker)
    backend = make_residency_backend(runtime, compat.platform_name(), other_stage)
    rank = int(getattr(worker, "rank", 0))
    cache = build_cache(runtime, layers, uncounted, backend)  # this stage's layers only
    core = WorkerCore(
        plan,
        layers,
        backend,
        rank,
        compat.parallel_ranks(worker.vllm_config),
        runtime.count_kernel,
        uncounted=uncounted,
        cache=cache,
        other_stage=other_stage,
        runner=runner,
    )
    if cache.caches:
        hook = vllm_moe.wrap_execute_model(worker, core.cache_before_step, core.cache_after_step)
        log.debug("reap-swap: cache fed per step through %s", hook)
    log.info(
        "reap-swap worker rank %d: %d MoE layers counted, residency %s%s",
        rank,
        len(layers),
        backend.residency_mode,
        f", plan layers {sorted(core.stage)} on this pipeline stage" if other_stage else "",
    )
    return core


def runner_status(worker: Any) -> dict:
    """This worker's model runner (Model Runner V2 or V1) for /reap/status; what it changes for
    reap-swap is logged once as an error (compat/runner.py)."""
    status = vllm_runner.runner_status(worker)
    for note in status["notes"]:
        log.error("reap-swap: %s", note)
    log.info("reap-swap: vLLM model runner %s (%s), padding mask from %s",
             status["model_runner"], status["class"], status["padding_mask"])  # fmt: skip
    return status


class ReapWorkerExtension(MoeProbeExtension, WorkerRpc):
    """RPC methods run on every worker (worker_core.WorkerRpc; docs/architecture.md, Worker RPC);
    reap_moe_probe comes from MoeProbeExtension, which stock servers can load alone."""

    def _reap_core(self) -> WorkerCore:
        core = getattr(self, "_reap_worker_core", None)
        if core is None:
            runtime = worker_runtime.for_config(self.vllm_config.additional_config)
            core = build_core(self, runtime)
            self._reap_worker_core = core
            hook = vllm_moe.add_worker_teardown(self, ReapWorkerExtension, runtime.close)
            log.debug("reap-swap: runtime teardown through %s", hook)
        return core

    def reap_fill_budget(self, extra_slots: int | None = None) -> dict:
        """--reap-budget auto | GiB (engine/residency/budget.py): without `extra_slots`, measure and answer
        how many slots this rank could add; with it, grow the pool by that many and fill them."""
        runtime = worker_runtime.for_config(self.vllm_config.additional_config)
        self._reap_core()  # the backend exists (and checked the engine) before the pool grows
        st = runtime.engine.state if runtime.engine is not None else None
        if runtime.settings.budget.pool == "plan" or st is None or st.pool is None:
            why = (
                "--reap-budget plan" if runtime.settings.budget.pool == "plan" else _no_device_budget(runtime)
            )
            reply = {"rank": self._reap_core().rank, "active": False, "reason": why}
            if runtime.kv_report is not None:  # accounting: the KV half applied (kv_target.py)
                reply["kv"] = _kv_reply(self, runtime)
            return reply
        from reap_swap.engine.residency import budget
        from reap_swap.sizing.memory_split import BudgetError

        try:
            if extra_slots is None:
                st.budget_growth = budget.probe(self, st)
                return {"rank": self._reap_core().rank, "active": True, **st.budget_growth.__dict__}
            return {
                "rank": self._reap_core().rank,
                "active": True,
                **budget.grow_and_fill(st, st.budget_growth, int(extra_slots)),
            }
        except BudgetError as exc:
            return {"rank": self._reap_core().rank, "active": True, "error": str(exc)}

    def destroy_worker_extension(self) -> None:
        """vLLM 0.33+ calls this on shutdown (compat.moe.add_worker_teardown): free the HBM pool."""
        worker_runtime.for_config(self.vllm_config.additional_config).close()


def _kv_reply(worker: Any, runtime: WorkerRuntime) -> dict:
    """The KV target's report with what vLLM allocated, and the accounting pool (the plan's budget)."""
    from reap_swap.compat import kv_spec
    from reap_swap.engine.kv_target import agreement

    report = dict(runtime.kv_report or {})
    report.update(agreement(report, kv_spec.allocated_kv(worker)))
    report["pool_bytes"] = int(runtime.plan.swappable_budget_bytes) if runtime.plan is not None else 0
    return report


def _no_device_budget(runtime: WorkerRuntime) -> str:
    why = runtime.settings.accounting_reason(compat.platform_name()) or runtime.engine_error
    return (
        f"--reap-budget {runtime.settings.budget.pool}: no HBM pool here ({why or 'no layer re-homed'}); "
        + ("the resident set is the plan's budget")
    )
