"""`--reap-budget auto | GiB` on CUDA: the KV bytes vLLM is told at load, the pool's growth after.

Two entry points (the arithmetic is memory_split.py's; the reasons are in its docstring):
- `BudgetHook(settings).on_state(st)`: called once by the CudaEngine when it creates its state
  (the first MoE layer's post-load attach, before vLLM profiles memory). Sets
  `cache_config.kv_cache_memory_bytes` to the KV target (unless the user gave
  --kv-cache-memory-bytes) and refuses, with the numbers, a KV target that cannot fit beside the
  plan's pool under --gpu-memory-utilization.
- `probe(worker, st)` / `grow_and_fill(st, extra_slots)`: the worker RPC `reap_fill_budget`, sent
  once by the API process before it serves (routes.py): measure (activation peak of a profile
  forward, mem_get_info), agree on the smallest growth over TP ranks, grow the pool by new HBM
  slots and fill them from the plan's ranked order through the normal swap path.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from reap_swap.compat import kv_spec
from reap_swap.compat import memory as vllm_memory
from reap_swap.compat import moe as vllm_moe
from reap_swap.compat import runner as vllm_runner
from reap_swap.engine import kv_target
from reap_swap.engine.refusal import record_refusal
from reap_swap.engine.residency import pool_reserve
from reap_swap.engine.residency.swap import apply_swap
from reap_swap.engine.residency.vmm_store import VmmStore
from reap_swap.sizing.cache_tail import slots_beyond_pinned
from reap_swap.sizing.memory_split import (
    BudgetError,
    Growth,
    experts_in_hbm_at_attach,
    kv_refusal,
    plan_growth,
    ranked_fill,
    split_line,
)

logger = logging.getLogger("reap_swap.engine.residency")


class BudgetHook:
    def __init__(self, settings: Any) -> None:
        self.budget = settings.budget.request()
        self.kv_tokens = settings.budget.kv_tokens

    def on_state(self, st: Any, layer: Any = None, moe_layers: int = 1) -> None:
        """Tell vLLM the KV bytes of the KV target (kv_target.py); refuse, with the numbers, a
        target that cannot fit beside the plan's pool; record the numbers on the engine state.
        `layer`: the MoE layer whose attach created the state; `moe_layers`: the layers hooked."""
        report = kv_target.decide(self.kv_tokens, self.budget)
        free, total = torch.cuda.mem_get_info(st.device)
        leaving = experts_leaving_hbm(layer, moe_layers)
        report["experts_in_hbm_at_load_bytes"] = leaving
        refusal = kv_refusal(
            kv_bytes=report["kv_bytes"], pool_bytes=st.budget_bytes, total=total, free=free,
            utilization=report["utilization"], source=report["kv_source"],
            max_model_len=report["max_model_len"], bytes_per_token=report["bytes_per_token"],
            leaving=leaving,
        )  # fmt: skip
        if refusal:
            record_refusal(refusal)  # the launcher prints it as its one error line (server/budget.py)
            raise BudgetError(refusal)
        st.budget_report = report


def experts_leaving_hbm(layer: Any, moe_layers: int) -> int:
    """HBM the MoE layers' expert weights hold at the first attach and the engine moves to its
    host-backed ranges before vLLM sizes the KV cache (memory_split.experts_in_hbm_at_attach: this
    layer's bytes on the device, times the hooked layers only where no weight offloader is set)."""
    nbytes = 0
    for name in ("w13_weight", "w2_weight"):
        t = getattr(layer, name, None)
        if isinstance(t, torch.Tensor) and t.is_cuda and not vllm_moe.is_uva_offloaded(t):
            nbytes += t.numel() * t.element_size()
    if nbytes == 0:
        return 0
    return experts_in_hbm_at_attach(nbytes, moe_layers, vllm_runner.weight_offloader_active())


def probe(worker: Any, st: Any) -> Growth:
    """Measure and decide (nothing changes). Raises BudgetError with the numbers."""
    report = getattr(st, "budget_report", None) or {}
    activation = vllm_memory.profile_activation_peak(worker)
    free, total = torch.cuda.mem_get_info(st.device)
    mem = vllm_memory.worker_memory(worker)
    report.update(weights_bytes=mem["weights_bytes"], activation_bytes=activation)
    report.update(kv_target.agreement(report, kv_spec.allocated_kv(worker)))
    st.budget_report = report
    return plan_growth(
        total_bytes=total,
        free_bytes=free,
        utilization=mem["utilization"],
        activation_bytes=activation,
        unit_bytes=st.pool.unit_bytes,
        slots_before=st.table.num_slots,
        max_slots=sum(e.num_experts for e in st.layers.values()),
        budget=report.get("budget", "auto"),
    )


def grow_and_fill(st: Any, growth: Growth, extra_slots: int) -> dict:
    """Grow the pool by `extra_slots` (<= growth.extra_slots), fill from the plan's ranked order."""
    extra = max(0, min(int(extra_slots), growth.extra_slots))
    lent = lent_slots(st)
    if extra and lent:
        # SlotTable.grow numbers new slots from its own end, which is the first lent slot: the
        # swap table would map plan experts onto device-cache slots (two owners, one HBM page)
        raise BudgetError(
            f"--reap-budget growth with the device cache on: pool slots {st.table.num_slots}.."
            f"{st.pool.num_slots - 1} ({lent}) are lent to the cache tails and growing would hand them "
            "to the swap table; use --reap-budget plan with --reap-cache-device on"
        )
    pool_reserve.grow_pool(st.pool, extra, st.device)  # a driver OOM: BudgetError, nothing grown
    st.table.grow(extra)
    order, source = st.plan.fill_order() if st.plan is not None else ([], "no plan")
    target = ranked_fill(order, st.table.resident(), st.table.num_slots, st.layers)
    result = apply_swap(st.table, VmmStore(st), target)
    st.bytes_copied_total += result.bytes_copied
    resident = st.table.used
    experts = sum(e.num_experts for e in st.layers.values())
    line = split_line(
        growth if extra == growth.extra_slots else Growth(**{**growth.__dict__, "extra_slots": extra}),
        weights_bytes=st.budget_report.get("weights_bytes", 0),
        kv_bytes=st.budget_report.get("kv_bytes", 0),
        kv_allocated=(st.budget_report.get("kv_allocated") or {}).get("bytes"),
        resident=resident,
        experts=experts,
    )
    logger.info("%s; fill order: %s; %d B copied", line, source, result.bytes_copied)
    st.budget_report.update(
        line=line,
        pool_slots=st.table.num_slots,
        pool_bytes=st.pool.nbytes,
        extra_slots=extra,
        resident_experts=resident,
        experts=experts,
        fill_order=source,
        fill_bytes_copied=result.bytes_copied,
        cap_bytes=growth.cap_bytes,
        total_bytes=growth.total_bytes,
        margin_bytes=growth.margin_bytes,
    )
    return dict(st.budget_report)


def lent_slots(st: Any) -> int:
    """Pool slots past the swap table's: lent to device caches (device_cache_engine.CacheConfig)."""
    pool = getattr(st, "pool", None)
    return 0 if pool is None or st.table is None else max(int(pool.num_slots) - int(st.table.num_slots), 0)


def pool_slots_beyond_pinned(st: Any, pinned: Any) -> int:
    """Pool slots the pinned set (core + active set) leaves: `--reap-cache-slots auto`."""
    return slots_beyond_pinned(st.table.num_slots, pinned)
