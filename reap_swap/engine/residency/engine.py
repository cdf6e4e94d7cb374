"""The CUDA residency engine, load time: per-expert HBM residency for vLLM's stride-taking MoE kernels.

Design (measured alternatives in research.md): which of a MoE layer's tensors move with their
expert is decided by the binding rules (`binding.bind_module` over `reap_swap.sizing.quant.layout`), the
same for bf16, FP8 (block, per-tensor, channel, online) and bf16 with expert biases (GPT-OSS):
every REHOME tensor (the weights) is re-homed into one CUDA virtual-address range per layer, one
*unit* per expert (expert e's slab of each re-homed tensor at an aligned offset, padded to the
2 MiB mapping granularity: `unit_layout.plan_unit`); KEEP_WHOLE tensors (scales, biases, input
scales) stay where vLLM put them in HBM and are counted as fixed HBM. Kernels that imply the
expert stride (Marlin, moe_wna16_gemm) and monolithic ones are refused by name. Each unit is backed by a pinned
host allocation (the master copy) or by an HBM slot from a pool reserved at load time. The
parameters become strided views of that range, so vLLM's unchanged Triton kernel reads resident
experts from HBM and the rest over PCIe in one launch, with bit-identical results, and a swap
only remaps units: addresses never change, so captured CUDA graphs stay valid.

Lifecycle in a worker process (one `CudaEngine`, owned by the worker runtime):
1. `hook_layer(layer, index)` (from ReapRoutedExperts.__init__) makes `attach_after_load` run
   right after vLLM's `process_weights_after_loading` of that layer. The first attach reserves
   the HBM slot pool (the plan's budget) -- before vLLM profiles memory, so the KV cache is sized
   with the pool accounted for. Each layer is converted and its core experts made resident.
   Unsupported layers are refused with a logged reason and keep vLLM's stock path.
2. `cuda_backend.CudaResidency(engine).apply(resident)` (worker RPC, between engine steps) swaps.
3. `release()` at worker shutdown frees the ranges and the pool.

The state it builds (`EngineState`, `rehome`, `swap_state`, standalone states) is in state.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import torch

from reap_swap.compat import moe as vllm_moe
from reap_swap.compat import mxfp4 as vllm_mxfp4
from reap_swap.compat import pinning as vllm_pinning
from reap_swap.engine import vmm
from reap_swap.engine.device_cache import lending as device_cache_engine
from reap_swap.engine.residency import grouped_engine, pool_reserve
from reap_swap.engine.residency.binding import (
    BoundLayer,
    LayerSizes,
    bind_module,
    has_w13_tensor,
    meta_tensors,
)
from reap_swap.engine.residency.refusals import LayerRefusals
from reap_swap.engine.residency.state import EngineState, LayerEntry, rehome, release_state, swap_state
from reap_swap.engine.residency.swap import publish_mode, reads_masters
from reap_swap.sizing.quant.budget import pool_slots

logger = logging.getLogger("reap_swap.engine.residency")

MAX_PADDING_OVERHEAD = 0.5  # refuse layers whose expert units would waste more than this


def unsupported_layer(layer: torch.nn.Module) -> str | None:
    """Why no binding can serve this layer (its MoE path, EP), or None: the rules decide the rest."""
    reason = vllm_moe.unsupported_moe_method(layer)
    if reason is not None:
        return reason
    if getattr(layer, "expert_map", None) is not None:
        return "expert parallelism (expert_map set) is not supported"
    return None


def layer_sizes(layer: torch.nn.Module) -> LayerSizes | None:
    """vLLM's sizes of the layer; a stand-in layer without them (tests) falls back to the
    unquantized weight shapes [E, 2N, K] / [E, K, N]."""
    sizes = vllm_moe.moe_layer_sizes(layer)
    if sizes is not None:
        return LayerSizes(*sizes)
    w13, w2 = getattr(layer, "w13_weight", None), getattr(layer, "w2_weight", None)
    if (
        not isinstance(w13, torch.Tensor)
        or not isinstance(w2, torch.Tensor)
        or w13.dim() != 3
        or w2.dim() != 3
    ):
        return None
    return LayerSizes(int(w13.shape[0]), int(w13.shape[2]), int(w2.shape[2]))


class CudaEngine:
    """Re-homes each supported MoE layer at load time; holds the process's EngineState."""

    def __init__(
        self,
        plan: Any | None,
        refusals: LayerRefusals,
        cache: Any | None = None,
        group_size: str = "1",
        publish_every: int | None = None,
    ) -> None:
        self.plan = plan
        self.publish_every = publish_every  # --reap-swap-publish (swap.publish_every_of); None: the default
        self.refusals = refusals
        self.cache = cache  # device_cache_engine.CacheConfig, None: no device cache
        self.group_size = str(group_size)  # --reap-group-size: "1" (default) is today's private units
        self._perms: dict | None = None  # the plan's physical orders (grouped_engine), made once
        self.state: EngineState | None = None
        self._quant_configs: dict[int, dict | None] = {}  # id(layer) -> config read at hook time
        self.pending_meta: dict[str, int | None] = {}  # layers seen only on meta so far (online quant)

    def hook_layer(self, layer: torch.nn.Module, index: int | None, quant_config: dict | None = None) -> None:
        """Attach `layer` (plan layer `index`) right after vLLM processes its loaded weights.

        `quant_config`: the model's quantization config as the binding rules read it; by default
        read from vLLM's current config now, while the layer is built (maybe not current at load
        time). GPU tests without vLLM's config pass it."""
        if quant_config is None:
            quant_config = vllm_moe.model_quant_config()
        self._quant_configs[id(layer)] = quant_config
        vllm_moe.install_post_load_hook(layer, lambda module: self.attach_after_load(module, index))

    def _state_for(self, layer: torch.nn.Module) -> EngineState:
        if self.state is None:
            device = layer.w13_weight.device.index or torch.cuda.current_device()
            granularity = vmm.ensure_available(device)
            plan = self.plan
            budget = int(plan.swappable_budget_bytes) if plan is not None else 0
            self.state = EngineState(
                device=device,
                plan=plan,
                budget_bytes=budget,
                granularity=granularity,
                publish_every=self.publish_every,
            )
            self.state.copy_stream = torch.cuda.Stream(device=device)
            if getattr(self, "on_state", None) is not None:  # --reap-budget auto | GiB
                self.on_state(self.state, layer, len(self._quant_configs))  # hooked MoE layers
        return self.state

    def _bind(self, layer: torch.nn.Module, granularity: int) -> BoundLayer | str:
        """The binding rules over the layer's real tensors, or the reason it cannot be bound."""
        sizes = layer_sizes(layer)
        if sizes is None:
            return "no layer sizes and no 3-D w13_weight / w2_weight to read them from"
        quant_config = self._quant_configs.get(id(layer))
        if quant_config is None:
            quant_config = vllm_moe.model_quant_config()
        if quant_config is None:
            method = vllm_moe.moe_kernel_names(layer)[0]
            if method != "UnquantizedFusedMoEMethod":
                return f"{method}: the model's quantization config is unknown (no vLLM config current)"
            quant_config = {}
        unwrapped = None
        if vllm_mxfp4.is_oai_mxfp4(layer):  # its weights are triton_kernels tensors, not Parameters
            unwrapped = vllm_mxfp4.unwrap(layer)
            if isinstance(unwrapped, str):
                return unwrapped
            if self.group_size != "1":
                return (
                    f"--reap-group-size {self.group_size}: {vllm_mxfp4.KERNEL} routes inside itself, "
                    "so expert ids cannot be mapped to a grouped order (MXFP4 is served per expert)"
                )
        bound = bind_module(
            layer,
            sizes,
            quant_config,
            vllm_moe.moe_kernel_names(layer),
            granularity,
            vllm_moe.is_uva_offloaded,
            contiguous_ok=self.group_size != "1",
            unwrapped=unwrapped,
        )
        if unwrapped is not None and bound.refusal is None and set(bound.rehome) != set(unwrapped.bases):
            return f"re-homed {sorted(bound.rehome)}, but only {sorted(unwrapped.bases)} can be re-pointed"
        return bound.refusal or bound

    def _check_layer(
        self, layer: torch.nn.Module, index: int | None
    ) -> tuple[EngineState | None, BoundLayer | None, str | None]:
        reason = unsupported_layer(layer)
        if reason is None and index is None:
            reason = f"cannot read the layer index from {getattr(layer, 'layer_name', '?')!r}"
        if reason is None and not (has_w13_tensor(layer) or vllm_mxfp4.is_oai_mxfp4(layer)):
            # w13_weight, or MoeWNA16Method's w13_qweight; MXFP4's is a triton_kernels tensor
            reason = "no w13_weight tensor on the layer"
        if reason is not None:
            return None, None, reason
        try:
            st = self._state_for(layer)
        except vmm.VmmUnavailable as exc:
            return None, None, f"CUDA virtual memory unavailable: {exc}"
        # what the layer cannot do first (dtype, format, kernel): a more useful reason than the plan's
        bound = self._bind(layer, st.granularity)
        if isinstance(bound, str):
            return None, None, bound
        if st.plan is not None and index not in st.plan.layers:
            return None, None, f"layer {index} is not in the plan"
        lay = bound.layout
        if lay.padding_overhead > MAX_PADDING_OVERHEAD and not bound.contiguous:  # contiguous: groups
            return (
                None,
                None,
                (
                    f"expert of {lay.expert_bytes} B pads to a {lay.unit_bytes} B mapping unit "
                    f"(> {MAX_PADDING_OVERHEAD:.0%} overhead)"
                ),
            )
        if st.pool is not None and st.pool.unit_bytes != lay.unit_bytes:
            return None, None, "expert unit size differs from the first layer's (mixed shapes not pooled)"
        return st, bound, None

    def attach_after_load(self, layer: torch.nn.Module, index: int | None) -> None:
        """Re-home one loaded MoE layer into a mixed range, then make its core experts resident."""
        if not self._ready_to_attach(layer, index):
            return
        st, bound, reason = self._check_layer(layer, index)
        if reason is not None:
            self._refuse(layer, index, reason)
            return
        if self.group_size != "1" and grouped_engine.attach(self, st, layer, index, bound):
            return  # re-homed in groups, or refused by name (b = 1 continues on the private path)
        t0 = time.perf_counter()
        _ensure_pool(st, bound.layout.unit_bytes, self.cache)
        # --reap-exact-pinning copies (those a repack replaced too), released below
        exact = vllm_pinning.layer_copies(layer, bound.rehome.values())
        rng, range_bytes, views, cached = self._rehome(st, layer, index, bound)
        _point_params(layer, bound, views)
        st.exact_pinned_released += vllm_pinning.release(exact)
        num_experts = next(iter(views.values())).shape[0]
        st.layers[index] = LayerEntry(
            index, layer.layer_name, num_experts, bound.layout.unit_bytes, bound.layout.payload_bytes,
            rng, range_bytes, layer, bound.layout, dict(bound.aliases), bound.kept_bytes,
        )  # fmt: skip
        self._seed(st, layer, index, cached)
        _settle(st, t0)
        logger.info(
            "reap-swap: layer %d re-homed (%d experts, %s, unit %.2f MiB, kept whole %s = %.2f MiB, "
            "%d resident) in %.2fs",
            index, num_experts, "+".join(bound.layout.names), bound.layout.unit_bytes / 2**20,
            ",".join(bound.kept) or "-", bound.kept_bytes / 2**20,
            len(st.table.resident().get(index, ())), time.perf_counter() - t0,
        )  # fmt: skip

    def _ready_to_attach(self, layer: torch.nn.Module, index: int | None) -> bool:
        """False on a repeated call (0.26's online fp8: layerwise processing, then the loader's pass)
        and while the weights are on meta (online quantization: the call after materializing attaches)."""
        name = getattr(layer, "layer_name", "?")
        if getattr(layer, "_reap_vmm", False) or name in self.refusals.reasons:
            return False
        waiting = meta_tensors(layer)
        if waiting:
            self.pending_meta[name] = index
            logger.debug("reap-swap: layer %s still on meta (%s): attach deferred", name, ",".join(waiting))
            return False
        self.pending_meta.pop(name, None)
        return True

    def _refuse(self, layer: torch.nn.Module, index: int | None, reason: str) -> None:
        """Leave the layer on vLLM's stock path; record whether its experts sit in HBM or host (UVA)."""
        w13 = getattr(layer, "w13_weight", None)
        mxfp4 = vllm_mxfp4.is_oai_mxfp4(layer)  # its swizzle always writes new HBM tensors
        on_hbm = mxfp4 or (isinstance(w13, torch.Tensor) and not vllm_moe.is_uva_offloaded(w13))
        replaced = vllm_moe.keep_replaced_on_device(layer)  # an INT4 repack in HBM stays there, as stock
        if mxfp4:  # its loaded weights were deleted: their pinned blocks are free
            vllm_moe.release_cached_pinned_memory()
        if replaced:
            freed = vllm_pinning.release(replaced)
            logger.info("reap-swap: refused layer %s keeps its repacked experts in HBM (%d B of host copies given back)",
                        getattr(layer, "layer_name", "?"), freed)  # fmt: skip
        self.refusals.refuse(getattr(layer, "layer_name", "?"), index, reason, on_hbm)

    def _rehome(self, st: EngineState, layer: torch.nn.Module, index: int, bound: BoundLayer):
        """(range, bytes, views, cache result): with the device cache's slot units where it engages."""
        tensors = {n: t.data for n, t in bound.rehome.items()}
        cached = self.cache and device_cache_engine.rehome_plain(self.cache, st, layer, index, tensors, bound)
        if cached:
            return cached[0], cached[1], {"w13_weight": cached[2], "w2_weight": cached[3]}, cached
        sources, on_copied = vllm_pinning.drain(tensors)  # --reap-exact-pinning copies, given back as copied
        rng, range_bytes, views = rehome(sources, bound.layout, st.device, on_copied=on_copied)
        return rng, range_bytes, views, cached

    def _seed(self, st: EngineState, layer: torch.nn.Module, index: int, cached: Any) -> None:
        """Make the plan core resident (unless the device cache is seeded with it), then engage the cache."""
        if st.plan is not None and not (cached and self.cache.seed_core):
            current = {l: set(v) for l, v in st.table.resident().items()}
            current[index] = set(st.plan.layers[index].core)
            swap_state(st, current)
        if reads_masters(publish_mode(None, st)):  # what VmmStore(st) will copy from
            vmm.map_masters_at_load(st.layers[index].rng, f"layer {index}")
        if cached:
            device_cache_engine.engage(self.cache, st, layer, index, cached[0], cached[1], cached[4])

    def release(self) -> None:
        """Give the HBM pool and the ranges back (worker shutdown)."""
        if self.state is not None:
            release_state(self.state)
            logger.info("reap-swap: HBM pool and expert ranges released")
            self.state = None


def _point_params(layer: torch.nn.Module, bound: BoundLayer, views: Mapping[str, torch.Tensor]) -> None:
    """Point the re-homed parameters (aliases too) at the range's views, flagged as offloaded;
    tensors held outside Parameters (MXFP4's wrappers) through the binding's `repoint`."""
    if bound.repoint is not None:
        for name in list(bound.rehome):
            bound.repoint(name, views[name])
            bound.rehome[name] = views[name]  # drop the swizzled copy: _settle frees it with this layer
        layer._reap_vmm = True
        return
    for name in (*bound.rehome, *bound.aliases):
        param = getattr(layer, name)
        param.data = views[bound.aliases.get(name, name)]
        # inside vLLM's device_loading_context: without the flag it would re-offload our range
        vllm_moe.mark_uva_offloaded(param)
    layer._reap_vmm = True


def _settle(st: EngineState, t0: float) -> None:
    """Free the old tensors' HBM and pinned host copy (the expert set is not held twice); count the time."""
    torch.cuda.empty_cache()
    st.host_cache_release = vllm_moe.release_cached_pinned_memory()
    st.load_seconds += time.perf_counter() - t0


def _ensure_pool(st: EngineState, unit_bytes: int, cache: Any | None = None) -> None:
    if st.pool is not None:
        return
    per_expert = int(st.plan.per_expert_bytes) if st.plan is not None else unit_bytes
    num_slots = pool_slots(st.budget_bytes, max(per_expert, 1))  # the plan's experts (quant_budget)
    t0 = time.perf_counter()
    what = f"{num_slots} expert slots of {unit_bytes / 2**20:.2f} MiB, the plan's budget"
    (st.pool,) = pool_reserve.reserve_pools(what, [(num_slots, unit_bytes)], st.device)
    # slots [K, num_slots) are lent to device caches; the table's refusal names them
    st.table = device_cache_engine.swap_table(cache, num_slots, st.plan)
    logger.info(
        "reap-swap: reserved HBM pool of %d expert slots (%.2f GiB, unit %.2f MiB) in %.2fs",
        num_slots,
        st.pool.nbytes / 2**30,
        unit_bytes / 2**20,
        time.perf_counter() - t0,
    )
