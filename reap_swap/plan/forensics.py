"""Router statistics turned into answers: how much routed traffic hit experts that were not resident.

Workers only count (per layer and expert: routed selections and routed gate weight). This module
merges their reports without double counting, compares them with a resident set, and remembers per
request what was observed and what was asked for, within a fixed memory bound.

One worker's raw report (what ``worker.reap_read_stats`` returns)::

    {"rank": int, "tp_rank": int, "tp_size": int, "pp_rank": int, "pp_size": int, "dp_rank": int,
     "layers": {"<layer>": {"counts": [E ints], "weights": [E floats]}}}

Under pipeline parallelism each stage's workers hold (and report) only that stage's layers, so a
tensor-parallel group is one (dp_rank, pp_rank): stages are summed like data-parallel groups, and
a layer that two stages of one data-parallel group both report is listed in ``tp_disagreement``
(with its ``pp_rank``) and counted once, from the lower stage.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from reap_swap.plan.bounded_map import DEFAULT_MAX_ENTRIES, LRUDict

LayerStats = dict[int, dict[str, list]]  # layer -> {"counts": [E ints], "weights": [E floats]}


def _same(a: Mapping, b: Mapping) -> bool:
    if len(a["weights"]) != len(b["weights"]):
        return False
    return list(a["counts"]) == list(b["counts"]) and all(
        math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-9)
        for x, y in zip(a["weights"], b["weights"], strict=True)
    )


def _add_into(total: dict[str, list], stats: Mapping, where: str) -> None:
    if len(stats["counts"]) != len(total["counts"]) or len(stats["weights"]) != len(total["weights"]):
        raise ValueError(f"{where}: {len(stats['counts'])} experts, expected {len(total['counts'])}")
    total["counts"] = [a + b for a, b in zip(total["counts"], stats["counts"])]
    total["weights"] = [a + b for a, b in zip(total["weights"], stats["weights"])]


def _copy(stats: Mapping) -> dict[str, list]:
    return {"counts": [int(c) for c in stats["counts"]], "weights": [float(w) for w in stats["weights"]]}


def _accumulate(into: dict[int, dict], layer_stats: Mapping[Any, Mapping], where: str) -> None:
    """Add each layer of ``layer_stats`` into ``into`` (a layer new to ``into`` is copied);
    ``where`` names the sum in a width-mismatch error."""
    for key, stats in layer_stats.items():
        layer = int(key)
        if layer in into:
            _add_into(into[layer], stats, f"{where}layer {layer}")
        else:
            into[layer] = _copy(stats)


def tp_groups(reports: Sequence[Mapping]) -> dict[tuple[int, int], list[Mapping]]:
    """(dp_rank, pp_rank) -> that tensor-parallel group's reports, lowest tp rank first (the
    reference rank)."""
    groups: dict[tuple[int, int], list[Mapping]] = {}
    for report in reports:
        key = (int(report.get("dp_rank", 0)), int(report.get("pp_rank", 0)))
        groups.setdefault(key, []).append(report)
    return {
        key: sorted(members, key=lambda r: int(r.get("tp_rank", 0)))
        for key, members in sorted(groups.items())
    }


def aggregate_workers(reports: Sequence[Mapping]) -> dict[int, dict]:
    """layer -> {"counts", "weights", "tp_disagreement"} over all workers.

    Tensor-parallel ranks route the same tokens identically, so summing them would multiply
    every count by tp_size: take the lowest tp rank (normally 0) of each (dp_rank, pp_rank) group,
    sum over groups, and list in ``tp_disagreement`` every (dp_rank, tp_rank) whose counts differ
    from its group's reference (a bug worth seeing, never silently averaged away).
    """
    out: dict[int, dict] = {}
    owner: dict[tuple[int, int], int] = {}  # (dp_rank, layer) -> the pp stage it was counted from
    for (dp_rank, pp_rank), members in tp_groups(reports).items():
        reference = {int(k): v for k, v in members[0].get("layers", {}).items()}
        for layer, stats in reference.items():
            if (dp_rank, layer) in owner:  # two stages report one layer: count it once, say so
                bad = {"dp_rank": dp_rank, "pp_rank": pp_rank, "tp_rank": int(members[0].get("tp_rank", 0))}
                out[layer]["tp_disagreement"].append(bad)
                continue
            owner[(dp_rank, layer)] = pp_rank
            if layer not in out:
                out[layer] = {**_copy(stats), "tp_disagreement": []}
            else:
                _add_into(out[layer], stats, f"layer {layer}, dp_rank {dp_rank}")
        for other in members[1:]:
            layers = {int(k): v for k, v in other.get("layers", {}).items()}
            for layer in sorted(set(layers) | set(reference)):
                if layer in layers and layer in reference and _same(reference[layer], layers[layer]):
                    continue
                if layer not in out:  # only this non-reference rank saw the layer: count nothing
                    width = len(layers[layer]["counts"])
                    out[layer] = {"counts": [0] * width, "weights": [0.0] * width, "tp_disagreement": []}
                out[layer]["tp_disagreement"].append(
                    {"dp_rank": dp_rank, "tp_rank": int(other.get("tp_rank", 0))}
                )
    return dict(sorted(out.items()))


def mask_outside(
    layer_stats: Mapping[Any, Mapping], resident_sets: Mapping[int, frozenset[int]]
) -> dict[int, dict]:
    """The part of the statistics that hit experts outside `resident_sets` (the misses).

    A layer absent from ``resident_sets`` is not managed by the plan (all its experts resident): no misses.
    """
    out = {}
    for layer, st in layer_stats.items():
        resident = resident_sets.get(int(layer))
        counts, weights = list(st["counts"]), list(st["weights"])
        if resident is None:
            out[int(layer)] = {"counts": [0] * len(counts), "weights": [0.0] * len(weights)}
        else:
            out[int(layer)] = {
                "counts": [0 if e in resident else c for e, c in enumerate(counts)],
                "weights": [0.0 if e in resident else w for e, w in enumerate(weights)],
            }
    return out


def add_stats(a: Mapping[Any, Mapping] | None, b: Mapping[Any, Mapping]) -> dict[int, dict]:
    """Layer-wise sum of two statistics maps (a layer in only one of them is copied)."""
    out = {int(k): _copy(v) for k, v in (a or {}).items()}
    _accumulate(out, b, "")
    return out


def summarize_router_misses(observed: Mapping[Any, Mapping], missed: Mapping[Any, Mapping]) -> dict:
    """Per layer and in total: routed selections and mass, and the part that hit non-resident experts.

    ``missed`` is ``observed`` masked to the experts outside the resident set (mask_outside). The
    controller masks each statistics segment when it closes, against the resident set resident during
    that segment, so a request whose set changed mid-way (decode refresh) is measured correctly.
    A layer absent from ``missed`` had no misses.
    """
    missed = {int(k): v for k, v in missed.items()}
    layers: dict[str, dict] = {}
    totals = {
        "observed_selections": 0,
        "missed_selections": 0,
        "observed_mass": 0.0,
        "inactive_mass": 0.0,
        "inactive_experts": 0,
    }
    for key, stats in sorted(observed.items(), key=lambda kv: int(kv[0])):
        layer = int(key)
        counts, weights = list(stats["counts"]), list(stats["weights"])
        miss = missed.get(layer, {"counts": [], "weights": []})
        observed_n, mass = int(sum(counts)), float(sum(weights))
        missed_n, inactive_mass = int(sum(miss["counts"])), float(sum(miss["weights"]))
        inactive = [e for e, c in enumerate(miss["counts"]) if c > 0]
        layers[str(layer)] = {
            "observed_selections": observed_n,
            "missed_selections": missed_n,
            "observed_mass": mass,
            "inactive_mass": inactive_mass,
            "inactive_experts": inactive,
            "expert_counts": [int(c) for c in counts],
            "miss_ratio": missed_n / observed_n if observed_n else 0.0,
            "inactive_mass_ratio": inactive_mass / mass if mass else 0.0,
        }
        for name in ("observed_selections", "missed_selections", "observed_mass", "inactive_mass"):
            totals[name] += layers[str(layer)][name]
        totals["inactive_experts"] += len(inactive)
    totals["miss_ratio"] = (
        totals["missed_selections"] / totals["observed_selections"] if totals["observed_selections"] else 0.0
    )
    totals["inactive_mass_ratio"] = (
        totals["inactive_mass"] / totals["observed_mass"] if totals["observed_mass"] else 0.0
    )
    return {"layers": layers, "totals": totals}


class StatsLedger:
    """Accumulated router statistics per request id, bounded to the most recent ``max_entries``.

    ``open`` starts a request (keeping what it already has, so a decode refresh of the same request
    continues its total); ``close_into`` credits a counter read to a request.
    """

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES):
        self._entries: LRUDict[str, LayerStats] = LRUDict(max_entries)

    def open(self, request_id: str) -> None:
        self._entries[request_id] = self._entries.get(request_id, {})

    def close_into(self, request_id: str, layer_stats: Mapping[Any, Mapping]) -> None:
        entry = self._entries.get(request_id, {})
        _accumulate(entry, layer_stats, f"request {request_id!r}, ")
        self._entries[request_id] = entry

    def get(self, request_id: str) -> LayerStats | None:
        entry = self._entries.get(request_id)
        return None if entry is None else {layer: _copy(stats) for layer, stats in entry.items()}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)


class ForensicsLog:
    """Per request: the last swap payload, refresh count, plan identity and whatever else the
    server wants to show at GET /forensics/{request_id}; bounded like every per-request map."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES):
        self._entries: LRUDict[str, dict[str, Any]] = LRUDict(max_entries)

    def update(self, request_id: str, **fields: Any) -> dict[str, Any]:
        """Merge ``fields`` (e.g. last_swap=..., refresh_count=..., plan_identity=...) into the record."""
        record = {**self._entries.get(request_id, {"request_id": request_id}), **fields}
        self._entries[request_id] = record
        return dict(record)

    def get(self, request_id: str) -> dict[str, Any] | None:
        record = self._entries.get(request_id)
        return None if record is None else dict(record)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)
