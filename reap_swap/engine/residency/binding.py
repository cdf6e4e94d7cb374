"""From a loaded MoE layer's real tensors to the binding rules' verdict and the unit layout.

Why: the engine must re-home exactly the tensors the kernel reads per expert (weights, packed
int4 included) and leave the small per-expert ones (scales, zero points, biases, g_idx) whole in
HBM, for every format by the same rules (`reap_swap.sizing.quant.layout`), never by method name. This
module reads the layer after vLLM's `process_weights_after_loading` -- every `w13_*` / `w2_*`
parameter or tensor attribute: name, shape, element size, strides, which names share a storage
(AWQ's `w13_weight` is `w13_qweight`) -- builds the `LayerSpec`, asks `bind_layer`, and adds
what only the real tensors can tell: where they live (a kept-whole tensor in host memory would be
read over PCIe for every expert: refused by name) and which dtypes the engine has been checked
on. The result is either a refusal naming every tensor and reason, or the tensors to re-home,
their aliases, the kept-whole tensors (fixed HBM, counted) and the private-unit layout.
torch only; every vLLM attribute comes from `reap_swap.compat.moe` via the caller.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from reap_swap.sizing.quant.layout import Decision, LayerBinding, LayerSpec, ParamSpec, StrideMode, bind_layer
from reap_swap.sizing.quant.methods import stride_mode_for
from reap_swap.sizing.unit_layout import UnitLayout, plan_unit

PREFIXES = ("w13_", "w2_")
# weight dtypes the engine has been checked with per scheme kind (the binder checks the bytes)
UNQUANTIZED_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class LayerSizes:
    num_experts: int
    hidden_size: int
    intermediate_size: int  # per partition


@dataclass
class BoundLayer:
    binding: LayerBinding
    refusal: str | None = None
    rehome: dict[str, torch.Tensor] = field(default_factory=dict)  # primary name -> tensor
    aliases: dict[str, str] = field(default_factory=dict)  # alias name -> primary name
    kept: dict[str, torch.Tensor] = field(default_factory=dict)  # kept whole in HBM
    layout: UnitLayout | None = None
    contiguous: bool = False  # the kernel implies stride = slab: only the contiguous group layout binds it
    # how a re-homed tensor held outside a Parameter is pointed at its view (MXFP4's wrappers)
    repoint: Callable[[str, torch.Tensor], None] | None = None

    @property
    def kept_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kept.values())


def _tensor_names(layer: torch.nn.Module) -> list[str]:
    names = {n for n in vars(layer) if n.startswith(PREFIXES)} | {
        n for n in layer._parameters if n.startswith(PREFIXES)
    }
    # parameters first, then plain attributes: of two names for one storage the first is primary
    return sorted(names, key=lambda n: (n not in layer._parameters, n))


def layer_tensors(layer: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, str]]:
    """(primary tensors, alias -> primary, non-tensor name -> type) of the layer's expert tensors."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    opaque: dict[str, str] = {}
    for name in _tensor_names(layer):
        value = layer._parameters.get(name, getattr(layer, name, None))
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            if hasattr(value, "shape"):  # e.g. triton_kernels Tensor wrappers (MXFP4)
                opaque[name] = type(value).__name__
            continue
        primary = next(
            (
                p
                for p, t in tensors.items()
                if value.numel() > 0
                and t.numel() > 0
                and not value.is_meta
                and t.data_ptr() == value.data_ptr()
            ),
            None,
        )
        if primary is None:
            tensors[name] = value
        elif (tensors[primary].shape, tensors[primary].stride(), tensors[primary].dtype) == (
            value.shape,
            value.stride(),
            value.dtype,
        ):
            aliases[name] = primary
        else:
            opaque[name] = f"a different view of {primary}'s storage"
    return tensors, aliases, opaque


def has_w13_tensor(layer: torch.nn.Module) -> bool:
    """The layer has its gate_up weight as a tensor: `w13_weight` (every method but one), or
    `w13_qweight` (vLLM 0.26.0's MoeWNA16Method registers no `w13_weight` alias)."""
    return any(isinstance(getattr(layer, n, None), torch.Tensor) for n in ("w13_weight", "w13_qweight"))


def meta_tensors(layer: torch.nn.Module) -> list[str]:
    """The layer's expert tensors still on the meta device (no data yet).

    vLLM 0.26's online quantization (`--quantization fp8` of a bf16 checkpoint:
    Fp8PerTensorOnlineMoEMethod, `uses_meta_device`) creates the weights on meta and materializes,
    loads and quantizes them layer by layer (model_loader/reload/layerwise.py `_layerwise_process`);
    a post-load call that sees meta tensors must wait for the call that follows the real data."""
    values = {n: layer._parameters.get(n, getattr(layer, n, None)) for n in _tensor_names(layer)}
    return [n for n, t in values.items() if isinstance(t, torch.Tensor) and t.is_meta]


def layer_spec(
    tensors: Mapping[str, torch.Tensor],
    sizes: LayerSizes,
    quant_config: Mapping[str, Any],
    method: str,
    experts: str | None,
    layouts: Mapping[str, str] | None = None,
) -> LayerSpec:
    params = tuple(
        ParamSpec(
            name=n,
            shape=tuple(int(x) for x in t.shape),
            elem_bytes=t.element_size(),
            dtype=str(t.dtype).replace("torch.", ""),
            strides=tuple(int(x) for x in t.stride()),
            layout=(layouts or {}).get(n, ""),
        )
        for n, t in tensors.items()
    )
    return LayerSpec(
        params=params,
        num_experts=sizes.num_experts,
        hidden_size=sizes.hidden_size,
        intermediate_size=sizes.intermediate_size,
        quant_config=dict(quant_config),
        method=method,
        stride_mode=stride_mode_for(method, experts),
        kernel=experts or "",
    )


def _unquantized_dtype_problem(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """An unquantized layer's weights must be bf16/fp16 (what the engine was checked with)."""
    for name in ("w13_weight", "w2_weight"):
        t = tensors.get(name)
        if t is not None and t.dtype not in UNQUANTIZED_DTYPES:
            return f"dtype {t.dtype} not supported (bf16/fp16 only)"
    return None


def on_cuda(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def _placement_problems(bound: BoundLayer, is_host: Any, on_device: Any) -> dict[str, str]:
    problems: dict[str, str] = {}
    for name, t in bound.rehome.items():
        if not on_device(t):
            problems[name] = f"on {t.device}, not CUDA"
    for name, t in bound.kept.items():
        if t.numel() and (not on_device(t) or is_host(t)):
            problems[name] = (
                "kept whole but in host memory (UVA offloaded): every expert would read it over PCIe; "
                "do not offload it (--cpu-offload-params w13_weight w2_weight)"
            )
    return problems


def bind_module(
    layer: torch.nn.Module,
    sizes: LayerSizes,
    quant_config: Mapping[str, Any],
    names: tuple[str, str | None],
    granularity: int,
    is_host: Any = lambda t: False,
    on_device: Any = on_cuda,
    contiguous_ok: bool = False,
    unwrapped: Any = None,
) -> BoundLayer:
    """Bind one loaded layer; `names` = (method, experts class), `is_host(t)`: vLLM's UVA flag;
    `on_device(t)`: is the tensor device memory (CUDA; CPU tests substitute their own);
    `contiguous_ok`: the engine groups layers (--reap-group-size not 1), so a kernel that implies
    the expert stride is bound (`bound.contiguous`) for the contiguous group layout instead of refused;
    `unwrapped`: tensors held outside the layer's Parameters, read by compat (MXFP4's
    `compat.mxfp4.Unwrapped`: the swizzled weights' bases, their scales, a `repoint`)."""
    from reap_swap.sizing.quant.scheme import scheme_from_config

    tensors, aliases, opaque = layer_tensors(layer)
    layouts = None
    if unwrapped is not None:
        tensors.update(unwrapped.bases)
        tensors.update(unwrapped.scales)
        opaque = {n: why for n, why in opaque.items() if n not in unwrapped.bases}
        layouts = unwrapped.layouts
    spec = layer_spec(tensors, sizes, quant_config, *names, layouts=layouts)
    binding = bind_layer(spec)
    bound = BoundLayer(binding, aliases=aliases, repoint=getattr(unwrapped, "repoint", None))
    if scheme_from_config(quant_config).kind == "unquantized":
        bound.refusal = _unquantized_dtype_problem(tensors)
        if bound.refusal:
            return bound
    problems = dict(binding.refusals)
    problems.update({n: f"not a torch tensor ({why})" for n, why in opaque.items()})
    bound.contiguous = spec.stride_mode is StrideMode.CONTIGUOUS
    if binding.ok and bound.contiguous and scheme_from_config(quant_config).kind == "mxfp4":
        problems["<layout>"] = (  # INT4's contiguous groups are CPU-tested; FE2M1f Marlin never checked
            f"{spec.kernel or spec.method}: MXFP4 through Marlin is not verified with contiguous groups "
            "(no GPU test yet); kept on vLLM's stock path"
        )
    elif binding.ok and bound.contiguous and not contiguous_ok:
        problems["<layout>"] = (
            f"{spec.kernel or spec.method} implies the expert stride (= slab bytes, no padding): "
            "private units would be read at the wrong address; only contiguous groups of whole pages "
            "bind it (--reap-group-size auto; research.md, INT4 in contiguous groups)"
        )
    bound.rehome = {n: tensors[n] for n in binding.names(Decision.REHOME) if n in tensors}
    bound.kept = {n: tensors[n] for n in binding.names(Decision.KEEP_WHOLE) if n in tensors}
    problems.update(_placement_problems(bound, is_host, on_device))
    if problems:
        bound.refusal = "; ".join(f"{n}: {r}" for n, r in problems.items())
        return bound
    slabs = [(n, int(t[0].numel() * t.element_size())) for n, t in bound.rehome.items()]
    bound.layout = plan_unit(slabs, granularity)
    return bound
