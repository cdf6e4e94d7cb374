"""The worker's residency backend on CUDA: swaps between engine steps over the re-homed layers.

Built by the worker (worker.make_residency_backend) from the process's CudaEngine once the model
has loaded; refuses to exist if no layer was re-homed or a layer's parameters left the engine's
range (swaps would then move bytes the kernel never reads).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from reap_swap.compat import moe as vllm_moe
from reap_swap.compat import pinning as vllm_pinning
from reap_swap.engine.device_cache.seeded import seeded_pins
from reap_swap.engine.residency.backend_base import ResidencyBase, refuse_misplaced
from reap_swap.engine.residency.engine import CudaEngine
from reap_swap.engine.residency.refusals import NothingRehomed
from reap_swap.engine.residency.state import EngineState, LayerEntry
from reap_swap.engine.residency.swap import apply_swap
from reap_swap.engine.residency.vmm_store import VmmStore


def misplaced_tensors(entry: LayerEntry) -> list[str]:
    """The re-homed tensors (aliases included) that no longer start where the engine put them in
    its range (what swaps remap): empty when every one is in place."""
    layout, base = entry.layout, entry.rng.base
    names = {n: n for n in layout.names} | dict(entry.aliases)
    return [
        name
        for name, primary in names.items()
        if getattr(entry.module, name, None) is None
        or getattr(entry.module, name).data_ptr() != base + layout.offset_of(primary)
    ]


def points_into_range(entry: LayerEntry) -> bool:
    """Do the layer's re-homed tensors still read the engine's range at their unit offsets?"""
    return not misplaced_tensors(entry)


class CudaResidency(ResidencyBase):
    """apply / resident / status / selfcheck over one EngineState and its ExpertStore."""

    st: EngineState

    def __init__(self, engine: CudaEngine) -> None:
        st = engine.state
        if st is None or not st.layers:
            reasons = engine.refusals.summary()
            if getattr(engine, "pending_meta", None):
                reasons += f"; never left the meta device (no post-load call with data): {sorted(engine.pending_meta)}"
            raise NothingRehomed(
                "no MoE layer was re-homed at load time" + (f" ({reasons})" if reasons else "")
            )
        refuse_misplaced(st.layers, misplaced_tensors, "ranges")
        self._init(st, VmmStore(st), engine.refusals)
        cache = getattr(engine, "cache", None)  # device_cache_engine.CacheConfig
        self.device_caches = cache.caches if cache is not None else None
        self.seeded = seeded_pins(engine)  # --reap-cache-seed seeded: swaps pin inside the cache slots

    def capacity_bytes(self) -> int:
        plan = self.st.plan
        per_expert = int(plan.per_expert_bytes) if plan is not None else self.st.pool.unit_bytes
        lent = sum(self.seeded.caches_slots().values()) if self.seeded is not None else 0
        return (self.st.table.num_slots + lent) * per_expert  # seeded: swaps pin in the cache slots too

    def apply(self, resident: Mapping[int, Any], *, dry_run: bool = False) -> dict:
        """Make exactly `resident` (core included) resident on the re-homed layers.

        Raises PoolCapacityError before anything moves, swap.SwapStepFailed after a failed step
        (rolled back locally)."""
        target = {int(l): sorted(int(e) for e in v) for l, v in resident.items() if int(l) in self.st.layers}
        ignored = sorted(int(l) for l in resident if int(l) not in self.st.layers)
        now = self.resident() if self.seeded else {}  # WorkerCore's rule: a changed set pins every layer
        changed = any(frozenset(v) != now.get(l, frozenset()) for l, v in target.items())
        seeded = {l: target.pop(l) for l in list(target) if self.seeded and l in self.seeded.layers()}
        if seeded:  # validated before anything moves (raises SeededCapacityError, a PoolCapacityError)
            self.seeded.plan(seeded)
        if dry_run:  # capacity check only (raises PoolCapacityError); nothing moves
            plan = self.st.table.plan(target)
            return {
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
        result = apply_swap(self.st.table, self.store, target)
        copied, pinned = self.seeded.apply(seeded, force=changed) if seeded else (0, 0)
        if self.device_caches is not None and self.seeded is None:  # the tail yields to the swap
            from reap_swap.engine.device_cache.serving import on_swap

            on_swap(self.device_caches, target)
        seconds = time.perf_counter() - t0
        moved = result.bytes_copied + copied
        self.st.swaps += 1
        self.st.bytes_copied_total += moved
        return {
            "bytes_copied": moved,
            "seconds": seconds,
            "gbps": (moved / seconds / 1e9) if seconds > 0 else 0.0,
            "phases": result.phases,
            "evicted": len(result.plan.evict),
            "admitted": len(result.plan.admit) + pinned,
            "reused": result.plan.reused,
            "ignored_layers": ignored,
            "note": "experts remapped between pinned host memory and HBM slots (CUDA VMM)",
        }

    def resident(self) -> dict[int, frozenset[int]]:
        out = {l: frozenset() for l in self.st.layers}
        out.update(self.st.table.resident())
        out.update(self.seeded.resident() if self.seeded is not None else {})
        return self.with_refused(out)

    def selfcheck(self, iters: int = 20) -> dict:
        """Is what the kernel reads what the table says? Pointers, backings and one timed call.

        For every re-homed layer: the parameters still point into the engine's range and the
        number of HBM-backed units equals the table's resident count. On the first layer, one
        token routed to top-k resident experts and one routed to top-k host experts are timed
        through the layer's own quant method (the serving path), eagerly.
        """
        report: dict[str, Any] = {"layers": {}}
        resident = dict(self.st.table.resident())
        if self.seeded is not None:  # seeded: a swap's set is HBM-backed in the cache's slots
            resident.update({l: frozenset(p) for l, p in self.seeded.pinned.items()})
        for index, entry in self.st.layers.items():
            report["layers"][str(index)] = {
                "params_in_range": points_into_range(entry),
                "hbm_units": sum(b is not None for b in entry.rng.backing),
                "table_resident": len(resident.get(index, ())),
            }
        index, entry = next(iter(self.st.layers.items()))
        on_hbm = sorted(resident.get(index, ()))
        on_host = sorted(set(range(entry.num_experts)) - set(on_hbm))
        for label, experts in (("hbm", on_hbm), ("host", on_host)):
            us = _time_layer(entry.module, experts, iters)
            if us is not None:
                report[f"layer{index}_{label}_us"] = us
        return report

    def status(self) -> dict:
        st = self.st
        layouts = getattr(st, "layouts", None)  # --reap-group-size given: each layer's b and why
        extra = {"layout": "private", "layouts": {str(k): v for k, v in layouts.items()}} if layouts else {}
        return {
            **extra,
            "mode": self.residency_mode,
            "device": st.device,
            "layers_rehomed": sorted(st.layers),
            "refused_layers": dict(self.refusals.reasons),
            "pool_slots": st.table.num_slots,
            "pool_slots_used": st.table.used,
            "pool_hbm_bytes": st.pool.nbytes,
            "unit_bytes": st.pool.unit_bytes,
            "rehomed_tensors": {i: list(e.layout.names) + list(e.aliases) for i, e in st.layers.items()},
            "kept_whole_hbm_bytes": st.kept_hbm_bytes,  # scales / biases, outside the pool
            "capacity_bytes": self.capacity_bytes(),
            "swaps": st.swaps,
            "bytes_copied_total": st.bytes_copied_total,
            "load_seconds": st.load_seconds,
            "host_cache_release": st.host_cache_release,
            "exact_pinned_released_bytes": st.exact_pinned_released,  # --reap-exact-pinning
            "exact_pinned_held_bytes": vllm_pinning.registered_bytes(),  # refused layers keep theirs
            "budget": getattr(st, "budget_report", None),  # --reap-budget auto | GiB split
        }


def _time_layer(m: torch.nn.Module, experts: list[int], iters: int) -> float | None:
    """Microseconds of one token routed to the first top-k of `experts` (None: fewer than top-k,
    or a kernel that routes inside itself)."""
    k = int(getattr(m, "top_k", 8))
    if len(experts) < k or vllm_moe.is_monolithic(m):  # a monolithic kernel takes logits, not ids
        return None
    w13 = m.w13_weight
    dtype = vllm_moe.activation_dtype(m, w13.dtype if w13.dtype in (torch.bfloat16, torch.float16) else None)
    hidden = int(getattr(m, "hidden_size", w13.shape[2]))
    x = torch.randn(1, hidden, device=w13.device, dtype=dtype or torch.bfloat16)
    ids = torch.tensor([experts[:k]], device=x.device, dtype=torch.int32)
    w = torch.full((1, k), 1.0 / k, device=x.device, dtype=torch.float32)
    vllm_moe.run_routed_experts(m, x, w, ids)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        vllm_moe.run_routed_experts(m, x, w, ids)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1000
