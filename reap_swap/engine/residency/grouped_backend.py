"""The worker's residency backend over grouped layers (`--reap-group-size`).

Beside `cuda_backend.CudaResidency` (private units, untouched): built by the worker when the
engine re-homed its layers in groups (`grouped_engine`). Swaps take *logical* resident sets, as
everywhere: a group is made resident if any member is wanted (`group_layout.groups_for`), the
capacity is checked in groups before anything moves (PoolCapacityError), and a failed step rolls
back through `swap.apply_swap` as for private units. `resident()` answers the logical experts
that are really in HBM (the wanted ones and their passengers: `residents_of`), so applying
`resident()` again is a no-op and the fault seam's undo restores the same groups. Status says per
layer: layout, b, why, strides, resident groups and the HBM they take.
Status: CPU-tested over a fake store (tests/test_group_wiring.py); served on the H200 (FP8 block
b = 2; INT4 identity-order groups of 8), text identical to stock (research.md).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from reap_swap.compat import pinning as vllm_pinning
from reap_swap.engine.residency import grouped
from reap_swap.engine.residency.backend_base import ResidencyBase, refuse_misplaced
from reap_swap.engine.residency.refusals import LayerRefusals, NothingRehomed
from reap_swap.engine.residency.swap import ExpertStore
from reap_swap.sizing.groups import group_target, residents_of, set_cost


def misplaced_tensors(entry: grouped.GroupedLayer) -> list[str]:
    """The re-homed tensors (aliases included) that no longer start at their range's base."""
    names = {n: n for n in entry.layout.names} | dict(entry.aliases)
    return [
        name
        for name, primary in names.items()
        if getattr(entry.module, name, None) is None
        or getattr(entry.module, name).data_ptr() != entry.ranges[primary].base
    ]


class GroupedResidency(ResidencyBase):
    """apply / resident / status / selfcheck over an engine state's GroupedState."""

    def __init__(self, engine: Any) -> None:
        st = engine.state
        gs = getattr(st, "grouped", None)
        if gs is None or not gs.layers:
            raise NothingRehomed(
                "no MoE layer was re-homed in groups at load time: " + engine.refusals.summary()
            )
        refuse_misplaced(gs.layers, misplaced_tensors, "grouped ranges")
        self._init(st, grouped.GroupedStore(gs), engine.refusals)

    def _init(self, st: Any, store: ExpertStore, refusals: LayerRefusals) -> None:
        super()._init(st, store, refusals)
        self.gs = st.grouped

    @property
    def group_bytes(self) -> int:
        return next(iter(self.gs.layers.values())).layout.group_bytes

    def capacity_bytes(self) -> int:
        """HBM of the grouped pools (group slots x group bytes)."""
        return self.gs.table.num_slots * self.group_bytes

    def apply(self, resident: Mapping[int, Any], *, dry_run: bool = False) -> dict:
        """Make the groups holding `resident` (logical ids, core included) resident, exactly those.
        Raises PoolCapacityError (in groups) before anything moves, SwapStepFailed after a failed step."""
        gs = self.gs
        target = {int(l): sorted(int(e) for e in v) for l, v in resident.items() if int(l) in gs.layers}
        ignored = sorted(int(l) for l in resident if int(l) not in gs.layers)
        if dry_run:
            perms = {i: e.perm for i, e in gs.layers.items()}
            sizes = {i: e.layout.group_size for i, e in gs.layers.items()}
            plan = gs.table.plan(group_target(target, perms, sizes))  # raises PoolCapacityError
            return {
                "bytes_copied": 0, "seconds": 0.0, "phases": {}, "evicted": len(plan.evict),
                "admitted": len(plan.admit), "reused": plan.reused, "ignored_layers": ignored,
                "note": "dry run: nothing moved (counts are groups)",
            }  # fmt: skip
        t0 = time.perf_counter()
        out = grouped.apply_logical(gs, target, self.store)
        seconds = time.perf_counter() - t0
        return {
            "bytes_copied": out["bytes_copied"],
            "seconds": seconds,
            "gbps": (out["bytes_copied"] / seconds / 1e9) if seconds > 0 else 0.0,
            "phases": out["phases"],
            "evicted": out["evicted_groups"],
            "admitted": out["admitted_groups"],
            "reused": out["reused_groups"],
            "ignored_layers": ignored,
            "grouped": {
                "hbm_bytes": out["hbm_bytes"],
                "wanted_experts": out["wanted_experts"],
                "resident_experts": out["resident_experts"],
                "groups_resident": gs.table.used,
            },
            "note": "groups of experts remapped between pinned host memory and HBM slots (CUDA VMM); "
            "evicted/admitted/reused count groups",
        }

    def resident(self) -> dict[int, frozenset[int]]:
        """Logical experts in HBM per layer (wanted and passengers); refused layers as in CudaResidency."""
        gs = self.gs
        groups = gs.table.resident()
        out = {l: residents_of(groups.get(l, ()), e.perm, e.layout.group_size) for l, e in gs.layers.items()}
        return self.with_refused(out)

    def layouts(self) -> dict[str, dict]:
        """Per layer: the layout (b, why, strides, bytes per expert), resident groups and their HBM."""
        groups = self.gs.table.resident()
        out = {str(i): dict(v) for i, v in sorted(getattr(self.st, "layouts", {}).items())}
        for i, e in sorted(self.gs.layers.items()):
            held = residents_of(groups.get(i, ()), e.perm, e.layout.group_size)
            cost = set_cost(held, e.perm, e.layout)
            out[str(i)] = {
                **out.get(str(i), {}),
                "resident_groups": cost.groups,
                "resident_experts": cost.resident,
                "hbm_bytes": cost.hbm_bytes,
                "kept_whole_permuted": list(e.kept),
            }
        return out

    def status(self) -> dict:
        st, gs = self.st, self.gs
        first = next(iter(gs.layers.values())).layout
        return {
            "mode": self.residency_mode,
            "device": st.device,
            "layout": "grouped",
            "group_size": first.group_size,
            "layers_rehomed": sorted(gs.layers),
            "refused_layers": dict(self.refusals.reasons),
            "pool_slots": gs.table.num_slots,  # group slots
            "pool_slots_used": gs.table.used,
            "pool_hbm_bytes": sum(p.nbytes for p in gs.pools.values()),
            "hbm_used_bytes": gs.table.used * first.group_bytes,
            "unit_bytes": first.group_bytes,  # one group's pages of every tensor
            "bytes_per_expert": first.bytes_per_expert,
            "rehomed_tensors": {i: list(e.layout.names) + list(e.aliases) for i, e in gs.layers.items()},
            "kept_whole_hbm_bytes": sum(e.kept_bytes for e in gs.layers.values()),
            "capacity_bytes": self.capacity_bytes(),
            "capacity_experts": gs.table.num_slots * first.group_size,
            "layouts": self.layouts(),
            "swaps": gs.swaps,
            "bytes_copied_total": gs.bytes_copied_total,
            "load_seconds": st.load_seconds,
            "host_cache_release": st.host_cache_release,
            "exact_pinned_released_bytes": st.exact_pinned_released,  # --reap-exact-pinning
            "exact_pinned_held_bytes": vllm_pinning.registered_bytes(),  # refused layers keep theirs
            "budget": getattr(st, "budget_report", None),
        }

    def selfcheck(self, iters: int = 20) -> dict:
        """Pointers and backings per layer; one timed call on resident and on host physical ids."""
        from reap_swap.engine.residency.cuda_backend import _time_layer

        report: dict[str, Any] = {"layers": {}}
        resident = self.gs.table.resident()
        for index, e in self.gs.layers.items():
            report["layers"][str(index)] = {
                "params_in_range": not misplaced_tensors(e),
                "hbm_groups": {n: sum(b is not None for b in r.backing) for n, r in e.ranges.items()},
                "table_resident_groups": len(resident.get(index, ())),
            }
        index, e = next(iter(self.gs.layers.items()))
        on_hbm = sorted(p for g in resident.get(index, ()) for p in e.layout.members(g))
        on_host = sorted(set(range(e.layout.num_experts)) - set(on_hbm))
        for label, physical in (("hbm", on_hbm), ("host", on_host)):  # the kernel's own (physical) ids
            us = _time_layer(e.module, physical, iters)
            if us is not None:
                report[f"layer{index}_{label}_us"] = us
        return report
