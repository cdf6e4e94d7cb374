"""The CUDA residency engine: per-expert HBM residency for vLLM's unquantized Triton MoE layers.

Design (measured alternatives in research.md): every supported MoE layer's `w13_weight` and
`w2_weight` are re-homed into one CUDA virtual-address range per layer, one *unit* per expert
(w13 rows then w2 rows, padded to the 2 MiB mapping granularity). Each unit is backed by a pinned
host allocation (the master copy) or by an HBM slot from a pool reserved at load time. The
parameters become strided views of that range, so vLLM's unchanged Triton kernel reads resident
experts from HBM and the rest over PCIe in one launch, with bit-identical results, and a swap
only remaps units: addresses never change, so captured CUDA graphs stay valid.

Lifecycle in a worker process:
1. `attach_after_load(layer)` runs right after vLLM's `process_weights_after_loading` of each
   RoutedExperts (installed by `install_post_load_hook`, called from ReapRoutedExperts). The first
   call reserves the HBM slot pool (the plan's budget) — before vLLM profiles memory, so the KV
   cache is sized with the pool accounted for. Each layer is converted and its core experts made
   resident. Unsupported layers are refused with a logged reason and keep vLLM's stock path.
2. `CudaResidency(...).apply(keep)` (worker RPC, between engine steps) swaps: evict, copy, publish.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from reap_swap.compat import moe as vllm_moe

from . import vmm
from .slot_table import SlotTable
from .swap import apply_swap

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
    """Process-global: one per worker process (one GPU)."""

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


_STATE: EngineState | None = None
_CONFIG: dict[str, Any] = {}


def configure(plan: Any) -> None:
    """Give the engine its plan (the HBM pool is its budget) before the model loads (worker process)."""
    _CONFIG["plan"] = plan


def _configure_from_vllm() -> None:
    """Read the plan named in additional_config["reap_swap"] (set by the launcher), once."""
    if "plan" in _CONFIG:
        return
        from ..settings import load_configured_plan, reap_config

    cfg = reap_config(vllm_moe.current_additional_config())
    configure(load_configured_plan(cfg)[1] if cfg and cfg.get("plan_file") else None)


def prepare(layer: torch.nn.Module) -> None:
    """Called from ReapRoutedExperts.__init__ on CUDA (model construction, config is current)."""
    _configure_from_vllm()
    install_post_load_hook(layer)


def state() -> EngineState | None:
    return _STATE


# ------------------------------------------------------------------------------------------------
# Load time
# ------------------------------------------------------------------------------------------------
def install_post_load_hook(layer: torch.nn.Module) -> None:
    """Run `attach_after_load(layer)` right after vLLM processes this layer's loaded weights."""
    vllm_moe.install_post_load_hook(layer, attach_after_load)


def _refusal(layer: torch.nn.Module) -> str | None:
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


def _layer_index(layer: torch.nn.Module) -> int | None:
    from .experts import layer_index_from_name  # imports vLLM's layer class: only at load time

    return layer_index_from_name(getattr(layer, "layer_name", ""))


def _state_for(layer: torch.nn.Module) -> EngineState:
    global _STATE
    if _STATE is None:
        device = layer.w13_weight.device.index or torch.cuda.current_device()
        granularity = vmm.ensure_available(device)
        plan = _CONFIG.get("plan")
        _STATE = EngineState(device=device, plan=plan, budget_bytes=0, granularity=granularity)
        _STATE.copy_stream = torch.cuda.Stream(device=device)
        if plan is not None:
            _STATE.budget_bytes = int(plan.swappable_budget_bytes)
    return _STATE


def _ensure_pool(st: EngineState, unit_bytes: int) -> None:
    if st.pool is not None:
        return
    per_expert = int(st.plan.per_expert_bytes) if st.plan is not None else unit_bytes
    num_slots = st.budget_bytes // max(per_expert, 1)
    t0 = time.perf_counter()
    st.pool = vmm.DeviceSlotPool.create(num_slots, unit_bytes, st.device)
    st.table = SlotTable(num_slots)
    logger.info(
        "reap-swap: reserved HBM pool of %d expert slots (%.2f GiB, unit %.2f MiB) in %.2fs",
        num_slots,
        st.pool.nbytes / 2**30,
        unit_bytes / 2**20,
        time.perf_counter() - t0,
    )


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


_REFUSED: dict[str, str] = {}  # layer name -> reason (kept even when no engine state exists)
_REFUSED_ON_HBM: dict[int, bool] = {}  # refused layer index -> its experts sit in HBM (not UVA)


def _refuse(layer: torch.nn.Module, index: int | None, reason: str) -> None:
    """Leave this layer on vLLM's stock path, loudly: each refusal names its reason."""
    name = getattr(layer, "layer_name", "?")
    _REFUSED[name] = reason
    if index is not None:
        _REFUSED_ON_HBM[index] = not vllm_moe.is_uva_offloaded(layer.w13_weight)
    logger.warning("reap-swap: layer %s keeps vLLM's stock expert path: %s", name, reason)


def _check_layer(layer: torch.nn.Module, index: int | None) -> tuple[EngineState | None, str | None]:
    reason = _refusal(layer)
    if reason is None and index is None:
        reason = f"cannot read the layer index from {getattr(layer, 'layer_name', '?')!r}"
    if reason is not None:
        return None, reason
    try:
        st = _state_for(layer)
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


def attach_after_load(layer: torch.nn.Module) -> None:
    """Re-home one loaded MoE layer into a mixed range, then make its core experts resident."""
    index = _layer_index(layer)
    st, reason = _check_layer(layer, index)
    if reason is not None:
        _refuse(layer, index, reason)
        return
    t0 = time.perf_counter()
    w13, w2 = layer.w13_weight, layer.w2_weight
    name, num_experts = layer.layer_name, w13.shape[0]
    expert_bytes, unit_bytes = unit_bytes_for(w13, w2, st.granularity)
    _ensure_pool(st, unit_bytes)
    rng, range_bytes, new_w13, new_w2 = rehome(w13.data, w2.data, unit_bytes, st.device)
    layer.w13_weight.data = new_w13
    layer.w2_weight.data = new_w2
    # inside vLLM's device_loading_context: without the flag it would re-offload our range
    vllm_moe.mark_uva_offloaded(layer.w13_weight)
    vllm_moe.mark_uva_offloaded(layer.w2_weight)
    layer._reap_vmm = True
    st.layers[index] = LayerEntry(index, name, num_experts, unit_bytes, expert_bytes, rng, range_bytes, layer)

    if st.plan is not None:
        core = {index: sorted(st.plan.layers[index].core)}
        current = {l: set(v) for l, v in st.table.resident().items()}
        current[index] = set(core[index])
        swap_state(st, current)
    torch.cuda.empty_cache()
    st.load_seconds += time.perf_counter() - t0
    logger.info(
        "reap-swap: layer %d re-homed (%d experts, unit %.2f MiB, %d resident) in %.2fs",
        index,
        num_experts,
        unit_bytes / 2**20,
        len(st.table.resident().get(index, ())),
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


def swap_state(st: EngineState, target: Mapping[int, Any], fault: Any = None):
    """apply_swap over an engine state (what CudaResidency.apply does, minus the bookkeeping).

    `fault` (residency.fault.SwapFault) wraps the store so the swap fails mid-way (test seam).
    """
    store = _Store(st)
    return apply_swap(st.table, fault.wrap(store) if fault is not None else store, target)


# ------------------------------------------------------------------------------------------------
# Swap time
# ------------------------------------------------------------------------------------------------
class _Store:
    """swap.ExpertStore over the VMM ranges and the slot pool."""

    def __init__(self, st: EngineState) -> None:
        self.st = st
        # only the payload moves: the unit's padding to the mapping granularity is never read
        self.bytes_per_expert = next(iter(st.layers.values())).expert_bytes if st.layers else 0

    def quiesce(self) -> None:
        torch.cuda.synchronize(self.st.device)

    def map_host(self, layer: int, expert: int) -> None:
        self.st.layers[layer].rng.map_host(expert, defer_access=True)

    def start_copy(self, layer: int, expert: int, slot: int) -> Any:
        pool, stream = self.st.pool, self.st.copy_stream
        src = self.st.layers[layer].rng.unit_address(expert)
        vmm.copy_async(pool.unit_address(slot), src, self.bytes_per_expert, stream.cuda_stream)
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait_copy(self, token: Any) -> None:
        token.synchronize()

    def map_slot(self, layer: int, expert: int, slot: int) -> None:
        self.st.layers[layer].rng.map_device(expert, self.st.pool.handles[slot], defer_access=True)

    def publish(self) -> None:
        for entry in self.st.layers.values():
            entry.rng.flush_access()


def _points_into_range(entry: LayerEntry) -> bool:
    """Do the layer's parameters still read the engine's range (what swaps remap)?"""
    lo = entry.rng.base
    hi = lo + entry.rng.num_units * entry.rng.unit_bytes
    return entry.module.w13_weight.data_ptr() == lo and lo <= entry.module.w2_weight.data_ptr() < hi


class CudaResidency:
    """The worker's residency backend on CUDA (see worker.make_residency_backend)."""

    mode = "cuda"

    def __init__(self, worker: Any = None, plan: Any = None, settings: Any = None) -> None:
        if _STATE is None or not _STATE.layers:
            reasons = "; ".join(f"{k}: {v}" for k, v in _REFUSED.items())
            raise RuntimeError(
                "no MoE layer was re-homed at load time" + (f" ({reasons})" if reasons else "")
            )
        self.st = _STATE
        moved = [i for i, e in self.st.layers.items() if not _points_into_range(e)]
        if moved:
            raise RuntimeError(
                f"layers {moved}: the expert parameters no longer point into the engine's ranges "
                "(something replaced them after re-homing); swaps would move bytes the kernel never reads"
            )

    def capacity_bytes(self) -> int:
        plan = self.st.plan
        per_expert = int(plan.per_expert_bytes) if plan is not None else self.st.pool.unit_bytes
        return self.st.table.num_slots * per_expert

    def apply(self, keep: Mapping[int, Any], *, dry_run: bool = False, fault: Any = None) -> dict:
        """Make exactly `keep` (core included) resident on the re-homed layers.

        An armed `fault` fails this swap after its admissions were partly published, so
        apply_swap's local rollback runs; a swap with too few admissions to fail mid-way is
        undone here and fails after it, so an armed fault always fails the call.
        """
        target = {int(l): sorted(int(e) for e in v) for l, v in keep.items() if int(l) in self.st.layers}
        ignored = sorted(int(l) for l in keep if int(l) not in self.st.layers)
        if dry_run:  # capacity check only (raises PoolCapacityError); nothing moves
            plan = self.st.table.plan(target)
            return {
                "mode": self.mode,
                "bytes_copied": 0,
                "seconds": 0.0,
                "phases": {},
                "evicted": len(plan.evict),
                "admitted": len(plan.admit),
                "reused": plan.reused,
                "ignored_layers": ignored,
                "note": "dry run: nothing moved",
            }
        t0 = time.perf_counter()
        previous = self.st.table.resident() if fault is not None else None
        result = swap_state(self.st, target, fault)  # PoolCapacityError: nothing moved
        if fault is not None and not fault.fired:
            swap_state(self.st, previous)
            fault.fire(f"after a swap of {len(result.plan.admit)} admission(s), undone")
        seconds = time.perf_counter() - t0
        self.st.swaps += 1
        self.st.bytes_copied_total += result.bytes_copied
        return {
            "mode": self.mode,
            "bytes_copied": result.bytes_copied,
            "seconds": seconds,
            "gbps": (result.bytes_copied / seconds / 1e9) if seconds > 0 else 0.0,
            "phases": result.phases,
            "evicted": len(result.plan.evict),
            "admitted": len(result.plan.admit),
            "reused": result.plan.reused,
            "ignored_layers": ignored,
            "note": "experts remapped between pinned host memory and HBM slots (CUDA VMM)",
        }

    def resident(self) -> dict[int, frozenset[int]]:
        out = {l: frozenset() for l in self.st.layers}
        out.update(self.st.table.resident())
        for index, on_hbm in _REFUSED_ON_HBM.items():
            if index not in out:
                num = (
                    self.st.plan.layers[index].num_experts
                    if self.st.plan and index in self.st.plan.layers
                    else 0
                )
                out[index] = frozenset(range(num)) if on_hbm else frozenset()
        return out

    def selfcheck(self, iters: int = 20) -> dict:
        """Is what the kernel reads what the table says? Pointers, backings and one timed call.

        For every re-homed layer: the parameters still point into the engine's range and the
        number of HBM-backed units equals the table's resident count. On the first layer, one
        token routed to top-k resident experts and one routed to top-k host experts are timed
        through the layer's own quant method (the serving path), eagerly.
        """
        report: dict[str, Any] = {"layers": {}}
        resident = self.st.table.resident()
        for index, entry in self.st.layers.items():
            report["layers"][str(index)] = {
                "params_in_range": _points_into_range(entry),
                "hbm_units": sum(b is not None for b in entry.rng.backing),
                "table_resident": len(resident.get(index, ())),
            }
        index, entry = next(iter(self.st.layers.items()))
        m = entry.module
        k = int(getattr(m, "top_k", 8))
        on_hbm = sorted(resident.get(index, ()))
        on_host = sorted(set(range(entry.num_experts)) - set(on_hbm))
        x = torch.randn(1, m.w13_weight.shape[2], device=m.w13_weight.device, dtype=m.w13_weight.dtype)
        for label, experts in (("hbm", on_hbm), ("host", on_host)):
            if len(experts) < k:
                continue
            ids = torch.tensor([experts[:k]], device=x.device, dtype=torch.int32)
            w = torch.full((1, k), 1.0 / k, device=x.device, dtype=torch.float32)

            def run(m=m, x=x, w=w, ids=ids):
                return vllm_moe.run_routed_experts(m, x, w, ids)

            run()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                run()
            end.record()
            torch.cuda.synchronize()
            report[f"layer{index}_{label}_us"] = start.elapsed_time(end) / iters * 1000
        return report

    def status(self) -> dict:
        st = self.st
        return {
            "mode": self.mode,
            "device": st.device,
            "layers_rehomed": sorted(st.layers),
            "refused_layers": dict(_REFUSED),
            "pool_slots": st.table.num_slots,
            "pool_slots_used": st.table.used,
            "pool_hbm_bytes": st.pool.nbytes,
            "unit_bytes": st.pool.unit_bytes,
            "capacity_bytes": self.capacity_bytes(),
            "swaps": st.swaps,
            "bytes_copied_total": st.bytes_copied_total,
            "load_seconds": st.load_seconds,
        }
