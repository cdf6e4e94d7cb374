"""The KV half of `--reap-budget auto | GiB`: how many KV bytes vLLM is told to allocate.

Runs in the worker at the first MoE layer's post-load attach (inside `Worker.load_model`, where
`get_current_vllm_config()` is the worker's resolved config, before vLLM sizes its KV cache):
- on CUDA from engine/residency/budget.py `BudgetHook.on_state`, which then checks it against the
  device memory beside the plan's pool;
- on accounting residency (the CPU build) from routed_experts.py (`hook_kv_target`): there is no
  HBM pool to size, but the KV target is still what vLLM allocates, so the split line and
  /reap/status.memory_split show the computed KV bytes next to what vLLM allocated.

Uniform full attention (GQA / MLA) keeps the config sum of memory_split.kv_layout (checked on a GPU: research.md).
Hybrid linear/full attention (Qwen3-Next, Qwen3.5) and sliding-window layers take vLLM's own
grouping (compat/kv_spec.py -> kv_groups.py). A user `--kv-cache-memory-bytes` always wins.
"""

from __future__ import annotations

from typing import Any

from reap_swap import get_logger
from reap_swap.compat import memory as vllm_memory
from reap_swap.engine.refusal import record_refusal
from reap_swap.sizing.kv_groups import KvGroupsError, grouped_source, kv_bytes_grouped, needs_vllm_groups
from reap_swap.sizing.memory_split import BudgetError, gib, kv_bytes_for, kv_layout, kv_target

log = get_logger("reap_swap.engine.kv_target")


def decide(kv_tokens: int | None, budget: object) -> dict:
    """Compute the KV target's bytes and tell vLLM (cache_config.kv_cache_memory_bytes).
    Returns the report (kv_bytes, kv_source, bytes_per_token or None, inputs); raises BudgetError
    with the reason for what is not sized (recorded for the launcher's one error line)."""
    cfg = vllm_memory.current_vllm_config()
    try:
        report = _decide(cfg, kv_tokens)
    except (BudgetError, KvGroupsError) as exc:
        message = f"--reap-budget {budget}: KV target not sized: {exc}"
        record_refusal(message)
        raise BudgetError(message) from exc
    if report.pop("set"):
        vllm_memory.set_kv_cache_memory_bytes(cfg, report["kv_bytes"])
    report["budget"] = budget
    log.info(
        "reap-swap budget %s: KV cache %s GiB (%s)", budget, gib(report["kv_bytes"]), report["kv_source"]
    )
    return report


def _decide(cfg: Any, kv_tokens: int | None) -> dict:
    kv = vllm_memory.kv_inputs(cfg)
    base = {
        "max_model_len": kv["max_model_len"],
        "max_num_seqs": kv["max_num_seqs"],
        "utilization": kv["utilization"],
    }
    if kv["user_kv_bytes"]:
        return {**base, "set": False, "kv_bytes": int(kv["user_kv_bytes"]), "kv_source": "--kv-cache-memory-bytes",
                "bytes_per_token": None}  # fmt: skip
    tokens, seqs = kv_target(kv["max_model_len"], kv["max_num_seqs"], kv_tokens)
    why = needs_vllm_groups(kv["hf_text_config"])
    if why is None:
        layout = kv_layout(kv["hf_text_config"], kv["dtype_bytes"], kv["tp_size"])
        return {**base, "set": True, "kv_bytes": kv_bytes_for(layout, tokens, seqs, kv["block_size"]),
                "kv_source": f"{tokens} tokens x {seqs} seqs, {layout.kind}, {layout.bytes_per_token} B/token",
                "bytes_per_token": layout.bytes_per_token}  # fmt: skip
    from reap_swap.compat import kv_spec

    groups, check = kv_spec.kv_groups(cfg, tokens)
    # --reap-kv-tokens is one pool of tokens for the per-token groups; per-sequence state (GDN /
    # Mamba) and windows still need a block per running sequence: max_num_seqs of them
    token_seqs, state_seqs = seqs, int(kv["max_num_seqs"])
    kv_bytes = kv_bytes_grouped(groups, token_seqs, state_seqs)
    return {
        **base, "set": True, "kv_bytes": kv_bytes, "bytes_per_token": None, "kv_layout": why,
        "kv_source": f"{grouped_source(groups, tokens, token_seqs, state_seqs)} ({why}, vLLM's grouping)",
        "kv_groups": [g.__dict__ for g in groups.groups], "kv_bytes_per_block": groups.bytes_per_block,
        "kv_tensors": groups.tensors, **check,
    }  # fmt: skip


def agreement(report: dict, allocated: dict | None) -> dict:
    """After vLLM allocated its KV cache: the allocated bytes beside the computed ones."""
    if allocated is None:
        return {"kv_allocated": None, "kv_agrees": None}
    agrees = int(allocated["bytes"]) == int(report.get("kv_bytes", -1))
    if not agrees:
        log.warning(
            "reap-swap: vLLM allocated %d B of KV cache (%d blocks), reap-swap computed %d B (%s)",
            allocated["bytes"], allocated["num_blocks"], report.get("kv_bytes", -1), report.get("kv_source"),
        )  # fmt: skip
    return {"kv_allocated": allocated, "kv_agrees": agrees}
