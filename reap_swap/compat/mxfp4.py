"""GPT-OSS MXFP4 experts on Hopper as vLLM 0.26.0 serves them, read for the residency engine.

On SM90 vLLM serves GPT-OSS's MXFP4 experts with `GptOssMxfp4MoEMethod` on the TRITON backend,
whose kernel `OAITritonMxfp4ExpertsMonolithic` routes inside itself (triton_kernels' `matmul_ogs`).
After `process_weights_after_loading` (mxfp4.py:330-378, oracle/mxfp4.py:1135-1174) the weight
Parameters are gone: `layer.w13_weight` / `layer.w2_weight` are plain attributes holding
triton_kernels `Tensor(Storage(data, HopperMXValueLayout))` wrappers, and the scales live on the
quant method (`w13_precision_config.weight_scale`, `HopperMXScaleLayout`). Both swizzles keep the
expert dimension outermost: `storage.data` is the `.mT` of a contiguous base [E, rows, cols] whose
expert e is one contiguous slab, and `matmul_ogs` takes every expert stride from the tensor on
every call (no TMA for MXFP4 weights on Hopper), so the base can be re-homed into the engine's
range and the wrapper re-pointed at `view.mT` before CUDA graphs are captured. The biases are fp32
Parameters. The kernel routes with triton_kernels' `topk` on the raw router logits (lower id wins a
tie, +0.0 above -0.0), which only the same `topk` reproduces exactly: `router` calls it again for the
counters.

Read in vLLM 0.26.0's CUDA wheel and its vendored triton_kernels (v3.5.1 API); **not yet verified
on a GPU**, so the whole path is off unless `REAPSWAP_MXFP4=1` (docs/models.md): until a lease shows
greedy text and MoE digests equal to stock, MXFP4 layers are refused by name and keep vLLM's path.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from reap_swap.sizing.quant.scheme import HOPPER_MX_SCALE

GATE_ENV = "REAPSWAP_MXFP4"
METHOD = "GptOssMxfp4MoEMethod"
KERNEL = "OAITritonMxfp4ExpertsMonolithic"
VALUE_LAYOUT = "HOPPER_VALUE"  # triton_kernels HopperMXValueLayout.name
SCALE_LAYOUT = "HOPPER_SCALE"  # HopperMXScaleLayout.name
# the expert tensors the wrappers hold (re-homed) and their scales (kept whole in HBM)
WEIGHTS = ("w13_weight", "w2_weight")
SCALES = {"w13_weight_scale": "w13_precision_config", "w2_weight_scale": "w2_precision_config"}


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Is the MXFP4 path turned on (`REAPSWAP_MXFP4=1`)? Off by default until verified on a GPU."""
    return environ.get(GATE_ENV, "") == "1"


def served_here(architecture: str) -> bool:
    """Does the launcher serve this model's MXFP4 experts per expert: the path on, GPT-OSS (its
    GptOssMxfp4Config picks the method read here), and a Hopper card (the only swizzle read)?"""
    from reap_swap.compat import serve

    return enabled() and architecture == "GptOssForCausalLM" and serve.device_capability() == (9, 0)


def is_oai_mxfp4(layer: Any) -> bool:
    """Does this layer run GPT-OSS MXFP4 on the monolithic OAI Triton kernel?"""
    qm = getattr(layer, "quant_method", None)
    experts = getattr(getattr(qm, "moe_kernel", None), "fused_experts", None)
    return type(qm).__name__ == METHOD and type(experts).__name__ == KERNEL


@dataclass
class Unwrapped:
    """A layer's MXFP4 tensors as torch tensors the binding rules can judge."""

    bases: dict[str, Any]  # name -> contiguous [E, rows, cols] uint8 base of the swizzled weight
    scales: dict[str, Any]  # virtual name -> contiguous base of the swizzled scale (kept whole)
    layouts: dict[str, str] = field(default_factory=dict)  # name -> layout tag for the shape rules
    _wrappers: dict[str, Any] = field(default_factory=dict)

    def repoint(self, name: str, view: Any) -> None:
        """Point the wrapper the kernel reads at `view` (the base's shape, in the engine's range):
        triton_kernels' Storage is a plain dataclass and `Tensor.data` a read-only property, so the
        storage's `data` is replaced by the view's `.mT`, the layout the swizzle left."""
        storage = self._wrappers[name].storage
        if tuple(view.shape) != tuple(storage.data.mT.shape):
            raise ValueError(
                f"{name}: view {tuple(view.shape)} is not the base {tuple(storage.data.mT.shape)}"
            )
        storage.data = view.mT
        self.bases.pop(name, None)  # the swizzled HBM copy: nothing may keep it alive past the re-home


def _base(wrapper: Any, layout: str, what: str) -> Any:
    """The contiguous base of a swizzled triton_kernels tensor, or a reason string."""
    storage = getattr(wrapper, "storage", None)
    data = getattr(storage, "data", None)
    name = getattr(getattr(storage, "layout", None), "name", None)
    if data is None or not hasattr(data, "mT"):
        return f"{what}: not a triton_kernels tensor with torch storage ({type(wrapper).__name__})"
    if name != layout:
        return f"{what}: layout {name}, not {layout} (the only swizzle whose expert slabs were read)"
    base = data.mT
    if base.dim() != 3 or not base.is_contiguous():
        return f"{what}: storage is not the .mT of a contiguous [E, rows, cols] base"
    return base


def unwrap(layer: Any) -> Unwrapped | str:
    """The layer's MXFP4 weight and scale bases, or why they cannot be read (by name)."""
    qm = getattr(layer, "quant_method", None)
    if not is_oai_mxfp4(layer):
        experts = type(getattr(getattr(qm, "moe_kernel", None), "fused_experts", None)).__name__
        return f"{type(qm).__name__} / {experts}: only {METHOD} on {KERNEL} is read"
    backend = getattr(getattr(qm, "mxfp4_backend", None), "name", None)
    if backend != "TRITON":
        return f"MXFP4 backend {backend}, not TRITON"
    if getattr(layer, "expert_map", None) is not None:
        return "expert parallelism (expert_map set) is not supported"
    out = Unwrapped({}, {})
    for name in WEIGHTS:
        wrapper = getattr(layer, name, None)
        base = _base(wrapper, VALUE_LAYOUT, name)
        if isinstance(base, str):
            return base
        out.bases[name], out._wrappers[name] = base, wrapper
    for name, config in SCALES.items():
        scale = getattr(getattr(qm, config, None), "weight_scale", None)
        base = _base(scale, SCALE_LAYOUT, f"{config}.weight_scale")
        if isinstance(base, str):
            return base
        out.scales[name], out.layouts[name] = base, HOPPER_MX_SCALE
    return out


def router(layer: Any) -> Callable[[Any, Any], tuple[Any, Any]] | None:
    """(x, router_logits) -> (topk weights, topk ids int32) exactly as the kernel routes: the same
    triton_kernels `topk` vLLM calls (gpt_oss_triton_kernels_moe.py:571-593, 0.26.0), a softmax
    over all logits first when the routing does not renormalize; None when this is not that kernel
    or triton_kernels is missing."""
    if not is_oai_mxfp4(layer):
        return None
    experts = layer.quant_method.moe_kernel.fused_experts
    try:
        from triton_kernels.topk import topk as topk_fn
    except ImportError:
        return None
    import torch

    k, sm_first = int(experts.topk), not bool(experts.renormalize)

    def route(x: Any, logits: Any) -> tuple[Any, Any]:
        if sm_first:
            logits = torch.softmax(logits, dim=-1)
        result = topk_fn(logits, k, apply_softmax=not sm_first)
        weights, ids = (result[0], result[1]) if isinstance(result, tuple) else (result.vals, result.indx)
        return weights, ids.to(torch.int32)

    return route
