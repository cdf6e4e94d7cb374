"""The CUDA residency engine, load time: per-expert HBM residency for vLLM's stride-taking MoE kernels.

Design (measured alternatives in research.md): which of a MoE layer's tensors move with their
expert is decided by the binding rules (`binding.bind_module` over `reap_swap.quant_layout`), the
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
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from reap_swap.compat import moe as vllm_moe
from reap_swap.compat import pinning as vllm_pinning
from reap_swap.host_memory import RELEASE_BLOCK_BYTES
from reap_swap.quant_budget import pool_slots

from . import device_cache_engine, grouped_engine, pool_reserve, vmm
from . import grouped as grouped_units
from .binding import BoundLayer, LayerSizes, bind_module, has_w13_tensor, meta_tensors
from .refusals import LayerRefusals
from .slot_table import SlotTable
from .swap import apply_swap, publish_mode, reads_masters
from .unit_layout import UnitLayout, plan_unit
from .vmm_store import VmmStore

logger = logging.getLogger("reap_swap.residency")

MAX_PADDING_OVERHEAD = 0.5  # refuse layers whose expert units would waste more than this


@dataclass
class LayerEntry:
    index: int
    name: str
    num_experts: int
    unit_bytes: int
    expert_bytes: int  # bytes a swap copies per expert (the unit's payload)
    rng: vmm.MixedRange
    range_bytes: torch.Tensor  # uint8 view over the whole range (copy source)
    module: torch.nn.Module | None = None  # the RoutedExperts whose weights live in `rng`
    layout: UnitLayout | None = None  # where each re-homed tensor's slab sits in a unit
    aliases: dict[str, str] = field(default_factory=dict)  # alias name -> re-homed name
    kept_bytes: int = 0  # HBM of the tensors kept whole (scales, biases): fixed, every expert


@dataclass
class EngineState:
    """The device-side state: one per worker process (one GPU)."""

    device: int
    plan: Any | None
    budget_bytes: int
    granularity: int
    layers: dict[int, LayerEntry] = field(default_factory=dict)
    pool: vmm.DeviceSlotPool | None = None
    table: SlotTable | None = None
    copy_stream: torch.cuda.Stream | None = None
    swaps: int = 0
    bytes_copied_total: int = 0
    load_seconds: float = 0.0
    host_cache_release: str | None = None  # the torch call that returned vLLM's old pinned copies
    exact_pinned_released: int = 0  # bytes of --reap-exact-pinning copies unregistered after re-homing
    grouped: grouped_units.GroupedState | None = None  # --reap-group-size b > 1 layers (grouped_engine)
    layouts: dict[int, dict] = field(default_factory=dict)  # per layer: layout, b, why (/reap/status)
    publish_every: int | None = None  # --reap-swap-publish as swap.py's value; None: swap.PUBLISH_EVERY

    @property
    def kept_hbm_bytes(self) -> int:
        """HBM held by kept-whole per-layer tensors of the re-homed layers (outside the pool)."""
        return sum(e.kept_bytes for e in self.layers.values())


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


def rehome(
    tensors: Mapping[str, torch.Tensor],
    layout: UnitLayout,
    device: int,
    num_units: int | None = None,
    on_copied: Callable[[int, int], int] | None = None,
) -> tuple[vmm.MixedRange, torch.Tensor, dict[str, torch.Tensor]]:
    """Copy [E, ...] expert tensors into a new host-backed mixed range; return it and the views.

    Unit e holds slab e of each tensor at `layout.offset_of(name)`; each view keeps its tensor's
    shape and inner strides, with an expert stride of one unit. `num_units` >= E leaves room for
    extra units after the experts' (a device cache's slots); the views cover the first E.
    `on_copied(e0, e1)`: called once experts [e0, e1) are copied (blocks of ~RELEASE_BLOCK_BYTES, each
    block's units allocated just before it), so their source can be given back during the copy
    (--reap-exact-pinning: the sources are then vLLM's CPU copies, unregistered by compat/pinning.py
    `drain`; each block is one pageable copy).
    """
    num_experts = next(iter(tensors.values())).shape[0]
    total = num_units or num_experts
    if on_copied is None:
        rng = vmm.MixedRange.create_host_backed(total, layout.unit_bytes, device)
    else:  # in blocks, a unit's host bytes are allocated just before its expert is copied (rng.grow)
        rng = vmm.MixedRange.create_host_backed(total, layout.unit_bytes, device, allocate=0)
    range_bytes = rng.as_bytes()
    views = {}
    for name, t in tensors.items():
        elem = t.element_size()
        flat = range_bytes.view(t.dtype)
        strides = (layout.unit_bytes // elem, *t.stride()[1:])
        views[name] = flat.as_strided(tuple(t.shape), strides, layout.offset_of(name) // elem)
    per_expert = sum(t[0].numel() * t.element_size() for t in tensors.values()) if num_experts else 1
    step = num_experts if on_copied is None else max(1, RELEASE_BLOCK_BYTES // max(per_expert, 1))
    for e0 in range(0, num_experts, max(step, 1)):
        e1 = min(num_experts, e0 + step)
        if on_copied is not None:
            rng.grow(e1)
        for name, t in tensors.items():
            views[name][e0:e1].copy_(t[e0:e1])
        if on_copied is not None:
            torch.cuda.synchronize(device)  # the source is read by the copy until here
            on_copied(e0, e1)
    if on_copied is not None:
        rng.grow(total)  # a device cache's extra units
    torch.cuda.synchronize(device)
    return rng, range_bytes, views


def swap_state(st: EngineState, target: Mapping[int, Any]):
    """apply_swap over an engine state's VMM store (CudaResidency.apply minus the bookkeeping)."""
    return apply_swap(st.table, VmmStore(st), target)


def release_state(st: EngineState) -> None:
    """Unmap and free every layer range and the slot pool (nothing may read them afterwards)."""
    for entry in st.layers.values():
        entry.rng.release()
    if st.pool is not None:
        st.pool.release()
    st.layers.clear()
    st.pool = None
    if st.grouped is not None:
        grouped_units.release(st.grouped)
        st.grouped = None


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
        bound = bind_module(
            layer,
            sizes,
            quant_config,
            vllm_moe.moe_kernel_names(layer),
            granularity,
            vllm_moe.is_uva_offloaded,
            contiguous_ok=self.group_size != "1",
        )
        return bound.refusal or bound

    def _check_layer(
        self, layer: torch.nn.Module, index: int | None
    ) -> tuple[EngineState | None, BoundLayer | None, str | None]:
        reason = unsupported_layer(layer)
        if reason is None and index is None:
            reason = f"cannot read the layer index from {getattr(layer, 'layer_name', '?')!r}"
        if reason is None and not has_w13_tensor(layer):  # w13_weight, or MoeWNA16Method's w13_qweight
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
        exact = vllm_pinning.pointers(bound.rehome.values())  # --reap-exact-pinning copies, released below
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
        on_hbm = isinstance(w13, torch.Tensor) and not vllm_moe.is_uva_offloaded(w13)
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
    """Point the re-homed parameters (aliases too) at the range's views, flagged as offloaded."""
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


def standalone_state(
    layers: Mapping[int, tuple[torch.Tensor, torch.Tensor]], num_slots: int, device: int = 0
) -> tuple[EngineState, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """An engine over plain [E, ...] weight tensors, outside vLLM (GPU tests and benchmarks).

    Returns the state and, per layer, the (w13, w2) views that a kernel should read.
    """
    named = {i: {"w13_weight": w13, "w2_weight": w2} for i, (w13, w2) in layers.items()}
    st, views = standalone_tensors_state(named, num_slots, device)
    return st, {i: (v["w13_weight"], v["w2_weight"]) for i, v in views.items()}


def standalone_tensors_state(
    layers: Mapping[int, Mapping[str, torch.Tensor]], num_slots: int, device: int = 0
) -> tuple[EngineState, dict[int, dict[str, torch.Tensor]]]:
    """As standalone_state for any set of re-homed [E, ...] tensors per layer (name -> tensor,
    in unit order): the quantized layouts' GPU tests re-home FP8 weights this way."""
    st = EngineState(device=device, plan=None, budget_bytes=0, granularity=vmm.ensure_available(device))
    st.copy_stream = torch.cuda.Stream(device=device)
    views = {}
    for index, tensors in layers.items():
        slabs = [(n, t[0].numel() * t.element_size()) for n, t in tensors.items()]
        layout = plan_unit(slabs, st.granularity)
        if st.pool is None:
            st.pool = vmm.DeviceSlotPool.create(num_slots, layout.unit_bytes, device)
            st.table = SlotTable(num_slots)
        rng, range_bytes, views[index] = rehome(tensors, layout, device)
        num_experts = next(iter(tensors.values())).shape[0]
        st.layers[index] = LayerEntry(
            index, f"layer{index}", num_experts, layout.unit_bytes, layout.payload_bytes, rng, range_bytes,
            layout=layout,
        )  # fmt: skip
    return st, views
