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

from reap_swap.budget_startup import record_refusal
from reap_swap.compat import memory as vllm_memory
from reap_swap.memory_split import (
    BudgetError,
    Growth,
    gib,
    kv_bytes_for,
    kv_layout,
    kv_refusal,
    kv_target,
    plan_growth,
    ranked_fill,
    slots_beyond_pinned,
    split_line,
)

from .swap import apply_swap
from .vmm_store import VmmStore

logger = logging.getLogger("reap_swap.residency")


class BudgetHook:
    def __init__(self, settings: Any) -> None:
        self.budget = settings.budget_request()
        self.kv_tokens = settings.kv_tokens

    def on_state(self, st: Any) -> None:
        """Tell vLLM the KV bytes of the KV target; record the numbers on the engine state."""
        cfg = vllm_memory.current_vllm_config()
        kv = vllm_memory.kv_inputs(cfg)
        if kv["user_kv_bytes"]:
            kv_bytes, source = int(kv["user_kv_bytes"]), "--kv-cache-memory-bytes"
        else:
            layout = kv_layout(kv["hf_text_config"], kv["dtype_bytes"], kv["tp_size"])
            tokens, seqs = kv_target(kv["max_model_len"], kv["max_num_seqs"], self.kv_tokens)
            kv_bytes = kv_bytes_for(layout, tokens, seqs, kv["block_size"])
            source = f"{tokens} tokens x {seqs} seqs, {layout.kind}, {layout.bytes_per_token} B/token"
            vllm_memory.set_kv_cache_memory_bytes(cfg, kv_bytes)
        free, total = torch.cuda.mem_get_info(st.device)
        refusal = kv_refusal(
            kv_bytes=kv_bytes, pool_bytes=st.budget_bytes, total=total, free=free,
            utilization=kv["utilization"], source=source, max_model_len=kv["max_model_len"],
            bytes_per_token=None if kv["user_kv_bytes"] else layout.bytes_per_token,
        )  # fmt: skip
        if refusal:
            record_refusal(refusal)  # the launcher prints it as its one error line (budget_startup.py)
            raise BudgetError(refusal)
        st.budget_report = {"budget": self.budget, "kv_bytes": kv_bytes, "kv_source": source}
        logger.info("reap-swap budget %s: KV cache %s GiB (%s)", self.budget, gib(kv_bytes), source)


def probe(worker: Any, st: Any) -> Growth:
    """Measure and decide (nothing changes). Raises BudgetError with the numbers."""
    report = getattr(st, "budget_report", None) or {}
    activation = vllm_memory.profile_activation_peak(worker)
    free, total = torch.cuda.mem_get_info(st.device)
    mem = vllm_memory.worker_memory(worker)
    report.update(weights_bytes=mem["weights_bytes"], activation_bytes=activation)
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
    st.pool.grow(extra)
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
    """Pool slots the pinned set (core + active set) leaves: `--reap-cache-slots auto` (issue 17)."""
    return slots_beyond_pinned(st.table.num_slots, pinned)
