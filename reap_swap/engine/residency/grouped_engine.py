"""CudaEngine's grouped path (`--reap-group-size auto|2|4|8`; research.md "Padding"): one loaded layer
-> a `grouped.GroupedLayer` (the layout of reap_swap.engine.residency.grouped, GPU-tested at kernel level).

Called by `CudaEngine.attach_after_load` only when the setting is not 1 (the default path is
untouched), after the binding rules accepted the layer (stride-taking kernel; monolithic kernels
were refused before; Marlin / moe_wna16 reach `decide_contiguous`, which binds them in
identity-order contiguous groups). `decide` picks b per layer and says why; b = 1 goes
back to the private path with the reason recorded in `st.layouts` (what /reap/status shows). For
b > 1: the layer's REHOME slabs -> `group_layout.plan_groups`, the plan's permutation of that
layer (`plan_permutations`: core, slices, fill order), one grouped pool per tensor sized in groups
(`group_layout.group_pool_slots`: no more HBM than the private pool it replaces), the weights
copied in physical order, every per-expert kept-whole tensor (FP8 scales, biases) permuted in
place, the parameters (and aliases) re-pointed to the views, and `layer.reap_group_map` set: the
logical -> physical id map that `ReapRoutedExperts.forward_modular` applies after counting.
Nothing is half-applied: a failure before the parameters are re-pointed releases the ranges.

One layout per engine: the first re-homed layer decides (private or grouped with its group
units); a later layer that would need the other, or other group units, is refused by name.
Status: CPU-tested with fake layers and a fake VMM (tests/test_group_wiring.py); on the H200, FP8 block
(b = 2) and bf16 served identical to stock; INT4 permuted groups were not bitwise, so INT4 layers bind
in identity order only (`permutation_for`): awq, gptq and ct-w4a16 at auto (b = 8) served identical to
stock (research.md, "INT4 groups not bitwise on Marlin").
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from reap_swap.cache.slot_table import SlotTable
from reap_swap.compat import moe as vllm_moe
from reap_swap.compat import pinning as vllm_pinning
from reap_swap.engine import vmm
from reap_swap.engine.residency import grouped, pool_reserve, swap
from reap_swap.sizing.contiguous_groups import (
    ContiguousLayoutError,
    contiguous_group_size,
    identity_fill,
    plan_contiguous_groups,
)
from reap_swap.sizing.groups import (
    GroupLayout,
    Permutation,
    choose_group_size,
    group_pool_slots,
    layer_status,
    plan_groups,
    plan_permutations,
    residents_of,
)
from reap_swap.sizing.quant.budget import pool_slots

logger = logging.getLogger("reap_swap.engine.residency")

PRIVATE_FIRST = "the engine's first re-homed layer uses private units (one layout per engine)"
CACHE_ON = "--reap-cache-device on: the device cache maps ids to its own slots; private units"


def slabs_of(bound: Any) -> list[tuple[str, int]]:
    return [(n, int(t[0].numel() * t.element_size())) for n, t in bound.rehome.items()]


def decide_contiguous(engine: Any, st: Any, bound: Any) -> tuple[int, str]:
    """(b, why) for a kernel that implies stride = slab (Marlin, moe_wna16); b = 0: refused, `why`
    says why. Never private units: they would be read at the wrong address. The groups are bound in
    identity order (`permutation_for`; contiguous_groups' docstring says why)."""
    if engine.cache is not None:
        return (
            0,
            f"{CACHE_ON.split(';')[0]}; this layer's kernel implies stride = slab: contiguous groups only",
        )
    if st.layers:
        return 0, f"{PRIVATE_FIRST}; this layer's kernel implies stride = slab: contiguous groups only"
    num_experts = int(next(iter(bound.rehome.values())).shape[0])
    try:
        return contiguous_group_size(slabs_of(bound), num_experts, str(engine.group_size), st.granularity)
    except ContiguousLayoutError as exc:
        return 0, f"contiguous kernel: {exc}"


def decide(engine: Any, st: Any, bound: Any) -> tuple[int, str]:
    """(b, why) for this layer under the engine's --reap-group-size (b = 0: refused)."""
    if getattr(bound, "contiguous", False):
        return decide_contiguous(engine, st, bound)
    requested = str(engine.group_size)
    if requested == "1":
        return 1, "--reap-group-size 1 (default): private units"
    if engine.cache is not None:
        return 1, CACHE_ON
    if st.layers:  # private layers exist: their pool is in private units
        return 1, PRIVATE_FIRST
    b, why = choose_group_size(slabs_of(bound), requested, st.granularity)
    if b == 1 and why.startswith("auto"):
        why = f"{why}: private units already waste {bound.layout.padding_overhead:.1%}"
    return b, why


def permutation_for(
    engine: Any, st: Any, index: int, num_experts: int, contiguous: bool = False
) -> Permutation:
    """The plan's physical order of this layer; identity for a contiguous (Marlin / moe_wna16)
    layer, whose kernel's numerics depend on the expert ids' order (research.md int4perm)."""
    if st.plan is None or contiguous:
        return Permutation.identity(num_experts)
    if engine._perms is None:
        engine._perms = plan_permutations(st.plan)
    return engine._perms[index]


def layout_problem(st: Any, layout: GroupLayout, perm: Permutation) -> str | None:
    """Why this layer's group layout cannot join the engine's grouped pool (None: it can)."""
    if perm.num_experts != layout.num_experts:
        return f"the plan's layer has {perm.num_experts} experts, the loaded layer {layout.num_experts}"
    if layout.padding_overhead > 0.5:
        return f"groups of {layout.group_size} waste {layout.padding_overhead:.0%} (> 50 %)"
    gs = st.grouped
    if gs is not None and gs.pools:
        first = next(iter(gs.layers.values()))
        if (first.layout.group_size, first.layout.unit_bytes) != (layout.group_size, layout.unit_bytes):
            return (
                f"group units {layout.unit_bytes} B (b = {layout.group_size}) differ from the first "
                f"grouped layer's {first.layout.unit_bytes} B (b = {first.layout.group_size}): "
                "mixed layouts are not pooled"
            )
    return None


def ensure_pools(st: Any, layout: GroupLayout, private_unit_bytes: int, groups_per_layer: int) -> None:
    """The grouped state and its per-tensor pools, sized in groups, on the first grouped layer."""
    if st.grouped is None:
        st.grouped = grouped.GroupedState(
            device=st.device, granularity=st.granularity, publish_every=st.publish_every
        )
        st.grouped.copy_stream = st.copy_stream
    gs = st.grouped
    if gs.pools:
        return
    plan = st.plan
    per_expert = int(plan.per_expert_bytes) if plan is not None else private_unit_bytes
    expert_slots = pool_slots(st.budget_bytes, max(per_expert, 1))  # what the private pool would get
    layers = len(plan.layers) if plan is not None else 1
    slots = group_pool_slots(expert_slots, private_unit_bytes, layout, layers * groups_per_layer)
    what = f"{slots} group slots of b = {layout.group_size}, the plan's budget"
    pools = pool_reserve.reserve_pools(what, [(slots, unit) for unit in layout.unit_bytes], st.device)
    gs.pools.update(zip(layout.names, pools))
    gs.table = SlotTable(slots)
    logger.info(
        "reap-swap: reserved grouped HBM pools of %d group slots (b = %d, %.2f GiB; the private pool "
        "would hold %d expert units of %.2f MiB)",
        slots, layout.group_size, slots * layout.group_bytes / 2**30, expert_slots,
        private_unit_bytes / 2**20,
    )  # fmt: skip


def _refuse(engine: Any, layer: torch.nn.Module, index: int, why: str) -> bool:
    engine._refuse(layer, index, why)  # engine.CudaEngine._refuse: stock path, HBM or host recorded
    return True


def attach(engine: Any, st: Any, layer: torch.nn.Module, index: int, bound: Any) -> bool:
    """Re-home `layer` in groups when b > 1 applies; False: the caller takes the private path
    (the reason is in st.layouts). A layer that cannot join the grouped pool is refused here."""
    b, why = decide(engine, st, bound)
    num_experts = int(next(iter(bound.rehome.values())).shape[0])
    if b == 0:
        return _refuse(engine, layer, index, f"--reap-group-size {engine.group_size}: {why}")
    if b == 1 and not bound.contiguous:
        if st.grouped is not None and st.grouped.layers:
            return _refuse(
                engine, layer, index, f"{why}; the engine's pool is grouped: mixed layouts are not pooled"
            )
        st.layouts[index] = {"layout": "private", "group_size": 1, "why": why}
        return False
    try:
        plan = plan_contiguous_groups if bound.contiguous else plan_groups
        layout = plan(slabs_of(bound), num_experts, b, st.granularity)
    except ValueError as exc:
        return _refuse(engine, layer, index, f"--reap-group-size {engine.group_size}: {exc}")
    perm = permutation_for(engine, st, index, num_experts, contiguous=bound.contiguous)
    if bound.contiguous:
        why = f"{why}; identity order (served identical to stock: research.md): ids as stock"
    problem = layout_problem(st, layout, perm)
    if problem is not None:
        return _refuse(engine, layer, index, f"--reap-group-size {engine.group_size}: {problem}")
    t0 = time.perf_counter()
    ensure_pools(st, layout, bound.layout.unit_bytes, layout.num_groups)
    _convert(st, layer, index, bound, layout, perm, why)
    st.layouts[index] = layer_status(layout, perm, why)
    st.load_seconds += time.perf_counter() - t0
    logger.info(
        "reap-swap: layer %d re-homed in groups of %d (%d experts, %s, %.2f MiB per expert, "
        "kept whole and permuted %s, %d groups resident) in %.2fs",
        index, b, num_experts, "+".join(layout.names), layout.bytes_per_expert / 2**20,
        ",".join(st.grouped.layers[index].kept) or "-",
        len(st.grouped.table.resident().get(index, ())), time.perf_counter() - t0,
    )  # fmt: skip
    return True


def _convert(st, layer, index, bound, layout, perm, why) -> None:
    gs = st.grouped
    # --reap-exact-pinning copies (those a repack replaced too), released below
    exact = vllm_pinning.layer_copies(layer, bound.rehome.values())
    tensors = {n: t.data for n, t in bound.rehome.items()}
    ranges, views = grouped.rehome_grouped(tensors, layout, perm, st.device)  # releases on failure
    id_map = torch.tensor(perm.to_physical, dtype=torch.int32, device=views[layout.names[0]].device)
    # from here on the layer reads physical ids: weights, kept-whole rows and the id map together
    for pname in (*bound.rehome, *bound.aliases):
        param = getattr(layer, pname)
        param.data = views[bound.aliases.get(pname, pname)]
        vllm_moe.mark_uva_offloaded(param)  # inside vLLM's device_loading_context: keep our range
    kept = tuple(n for n, t in bound.kept.items() if grouped.permute_rows_(t.data, perm))
    layer.reap_group_map = id_map
    layer._reap_vmm = True
    gs.layers[index] = grouped.GroupedLayer(
        index, layout, perm, ranges, views, id_map, why, kept,
        module=layer, aliases=dict(bound.aliases), kept_bytes=bound.kept_bytes,
    )  # fmt: skip
    if st.plan is not None:
        current = {
            l: residents_of(g, gs.layers[l].perm, gs.layers[l].layout.group_size)
            for l, g in gs.table.resident().items()
        }
        core = set(st.plan.layers[index].core)
        if bound.contiguous and layout.group_size > 1:  # identity order, no packing: best-covered groups
            core = set(identity_fill(core, layout.group_size))
        current[index] = core
        grouped.apply_logical(gs, current, count=False)
    if swap.reads_masters(swap.publish_mode(None, gs)):  # what GroupedStore(gs) will copy from
        for name, rng in ranges.items():
            vmm.map_masters_at_load(rng, f"layer {index} {name}")
    del tensors
    st.exact_pinned_released += vllm_pinning.release(exact)
    torch.cuda.empty_cache()
    st.host_cache_release = vllm_moe.release_cached_pinned_memory()
