"""The CUDA residency engine, load time: per-expert HBM residency for vLLM's unquantized Triton MoE.

Design (measured alternatives in research.md): every supported MoE layer's `w13_weight` and
`w2_weight` are re-homed into one CUDA virtual-address range per layer, one *unit* per expert
(w13 rows then w2 rows, padded to the 2 MiB mapping granularity). Each unit is backed by a pinned
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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from reap_swap.compat import moe as vllm_moe

from . import device_cache_engine, vmm
from .refusals import LayerRefusals
from .slot_table import SlotTable
from .swap import apply_swap
from .vmm_store import VmmStore

logger = logging.getLogger("reap_swap.residency")

MAX_PADDING_OVERHEAD = 0.5  # refuse layers whose expert units would waste more than this


@dataclass
class LayerEntry:
    index: int
    name: str
    num_experts: int
    unit_bytes: int
    expert_bytes: int
    rng: vmm.MixedRange
    range_bytes: torch.Tensor  # uint8 view over the whole range (copy source)
    module: torch.nn.Module | None = None  # the RoutedExperts whose weights live in `rng`


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


def unsupported_layer(layer: torch.nn.Module) -> str | None:
    """Why this layer's experts cannot be pooled, or None."""
    reason = vllm_moe.unsupported_moe_method(layer)
    if reason is not None:
        return reason
    if getattr(layer, "expert_map", None) is not None:
        return "expert parallelism (expert_map set) is not supported"
    if getattr(layer, "w13_bias", None) is not None or getattr(layer, "w2_bias", None) is not None:
        return "expert biases are not pooled"
    w13, w2 = getattr(layer, "w13_weight", None), getattr(layer, "w2_weight", None)
    if w13 is None or w2 is None or w13.dim() != 3 or w2.dim() != 3:
        return "w13_weight / w2_weight missing or not 3-D"
    if w13.device.type != "cuda":
        return f"weights on {w13.device}, not CUDA"
    if w13.dtype not in (torch.bfloat16, torch.float16) or w2.dtype != w13.dtype:
        return f"dtype {w13.dtype} not supported (bf16/fp16 only)"
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        return "last dimension not contiguous"
    return None


def unit_bytes_for(w13: torch.Tensor, w2: torch.Tensor, granularity: int) -> tuple[int, int]:
    """(expert bytes, mapping-unit bytes): one expert's w13 and w2 rows, padded to the granularity."""
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    return expert_bytes, -(-expert_bytes // granularity) * granularity


def rehome(
    w13: torch.Tensor, w2: torch.Tensor, unit_bytes: int, device: int
) -> tuple[vmm.MixedRange, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copy [E, ...] expert weights into a new host-backed mixed range; return it and the views.

    Unit e holds w13[e] then w2[e]; the views keep the kernel's layout (last dim contiguous) with
    an expert stride of one unit.
    """
    num_experts, elem = w13.shape[0], w13.element_size()
    rng = vmm.MixedRange.create_host_backed(num_experts, unit_bytes, device)
    range_bytes = rng.as_bytes()
    flat = range_bytes.view(w13.dtype)
    unit_elems = unit_bytes // elem
    new_w13 = flat.as_strided(tuple(w13.shape), (unit_elems, w13.shape[2], 1), 0)
    new_w2 = flat.as_strided(tuple(w2.shape), (unit_elems, w2.shape[2], 1), w13[0].numel())
    new_w13.copy_(w13)
    new_w2.copy_(w2)
    torch.cuda.synchronize(device)
    return rng, range_bytes, new_w13, new_w2


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


class CudaEngine:
    """Re-homes each supported MoE layer at load time; holds the process's EngineState."""

    def __init__(self, plan: Any | None, refusals: LayerRefusals, cache: Any | None = None) -> None:
        self.plan = plan
        self.refusals = refusals
        self.cache = cache  # device_cache_engine.CacheConfig (issue 17), None: no device cache
        self.state: EngineState | None = None

    def hook_layer(self, layer: torch.nn.Module, index: int | None) -> None:
        """Attach `layer` (plan layer `index`) right after vLLM processes its loaded weights."""
        vllm_moe.install_post_load_hook(layer, lambda module: self.attach_after_load(module, index))

    def _state_for(self, layer: torch.nn.Module) -> EngineState:
        if self.state is None:
            device = layer.w13_weight.device.index or torch.cuda.current_device()
            granularity = vmm.ensure_available(device)
            plan = self.plan
            budget = int(plan.swappable_budget_bytes) if plan is not None else 0
            self.state = EngineState(device=device, plan=plan, budget_bytes=budget, granularity=granularity)
            self.state.copy_stream = torch.cuda.Stream(device=device)
        return self.state

    def _check_layer(
        self, layer: torch.nn.Module, index: int | None
    ) -> tuple[EngineState | None, str | None]:
        reason = unsupported_layer(layer)
        if reason is None and index is None:
            reason = f"cannot read the layer index from {getattr(layer, 'layer_name', '?')!r}"
        if reason is not None:
            return None, reason
        try:
            st = self._state_for(layer)
        except vmm.VmmUnavailable as exc:
            return None, f"CUDA virtual memory unavailable: {exc}"
        if st.plan is not None and index not in st.plan.layers:
            return None, f"layer {index} is not in the plan"
        expert_bytes, unit_bytes = unit_bytes_for(layer.w13_weight, layer.w2_weight, st.granularity)
        if unit_bytes > expert_bytes * (1 + MAX_PADDING_OVERHEAD):
            return None, (
                f"expert of {expert_bytes} B pads to a {unit_bytes} B mapping unit "
                f"(> {MAX_PADDING_OVERHEAD:.0%} overhead)"
            )
        if st.pool is not None and st.pool.unit_bytes != unit_bytes:
            return None, "expert unit size differs from the first layer's (mixed shapes not pooled)"
        return st, None

    def attach_after_load(self, layer: torch.nn.Module, index: int | None) -> None:
        """Re-home one loaded MoE layer into a mixed range, then make its core experts resident."""
        st, reason = self._check_layer(layer, index)
        if reason is not None:
            on_hbm = (
                not vllm_moe.is_uva_offloaded(layer.w13_weight) if hasattr(layer, "w13_weight") else False
            )
            self.refusals.refuse(getattr(layer, "layer_name", "?"), index, reason, on_hbm)
            return
        t0 = time.perf_counter()
        w13, w2 = layer.w13_weight, layer.w2_weight
        expert_bytes, unit_bytes = unit_bytes_for(w13, w2, st.granularity)
        _ensure_pool(st, unit_bytes, self.cache)
        cached = self.cache and device_cache_engine.rehome_layer(
            self.cache, st, layer, index, w13.data, w2.data, unit_bytes
        )
        rng, range_bytes, new_w13, new_w2 = (
            cached[:4] if cached else rehome(w13.data, w2.data, unit_bytes, st.device)
        )
        layer.w13_weight.data = new_w13
        layer.w2_weight.data = new_w2
        # inside vLLM's device_loading_context: without the flag it would re-offload our range
        vllm_moe.mark_uva_offloaded(layer.w13_weight)
        vllm_moe.mark_uva_offloaded(layer.w2_weight)
        layer._reap_vmm = True
        st.layers[index] = LayerEntry(
            index, layer.layer_name, w13.shape[0], unit_bytes, expert_bytes, rng, range_bytes, layer
        )
        if st.plan is not None and not (cached and self.cache.seed_core):
            current = {l: set(v) for l, v in st.table.resident().items()}
            current[index] = set(st.plan.layers[index].core)
            swap_state(st, current)
        if cached:
            device_cache_engine.engage(self.cache, st, layer, index, rng, range_bytes, cached[4])
        torch.cuda.empty_cache()
        # the old pinned copy is free now: give it back so the expert set is not held twice
        st.host_cache_release = vllm_moe.release_cached_pinned_memory()
        st.load_seconds += time.perf_counter() - t0
        logger.info(
            "reap-swap: layer %d re-homed (%d experts, unit %.2f MiB, %d resident) in %.2fs",
            index,
            w13.shape[0],
            unit_bytes / 2**20,
            len(st.table.resident().get(index, ())),
            time.perf_counter() - t0,
        )

    def release(self) -> None:
        """Give the HBM pool and the ranges back (worker shutdown)."""
        if self.state is not None:
            release_state(self.state)
            logger.info("reap-swap: HBM pool and expert ranges released")
            self.state = None


def _ensure_pool(st: EngineState, unit_bytes: int, cache: Any | None = None) -> None:
    if st.pool is not None:
        return
    per_expert = int(st.plan.per_expert_bytes) if st.plan is not None else unit_bytes
    num_slots = st.budget_bytes // max(per_expert, 1)
    t0 = time.perf_counter()
    st.pool = vmm.DeviceSlotPool.create(num_slots, unit_bytes, st.device)
    kept = cache.split(num_slots, len(st.plan.layers)) if cache and st.plan is not None else num_slots
    st.table = SlotTable(kept)  # slots [kept, num_slots) are lent to device caches (issue 17)
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
    st = EngineState(device=device, plan=None, budget_bytes=0, granularity=vmm.ensure_available(device))
    st.copy_stream = torch.cuda.Stream(device=device)
    views = {}
    for index, (w13, w2) in layers.items():
        expert_bytes, unit_bytes = unit_bytes_for(w13, w2, st.granularity)
        if st.pool is None:
            st.pool = vmm.DeviceSlotPool.create(num_slots, unit_bytes, device)
            st.table = SlotTable(num_slots)
        rng, range_bytes, v13, v2 = rehome(w13, w2, unit_bytes, device)
        st.layers[index] = LayerEntry(
            index, f"layer{index}", w13.shape[0], unit_bytes, expert_bytes, rng, range_bytes
        )
        views[index] = (v13, v2)
    return st, views
