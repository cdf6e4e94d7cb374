"""The controller's answers: a swap's response, each rank's brief, the status document.

Pure shaping of what the workers replied (reap_swap.engine.wire models) and the controller holds, kept
apart so the state machine in controller.py reads as its steps.
"""

from __future__ import annotations

import time
from typing import Any

from reap_swap.engine import wire
from reap_swap.plan.active_set import resident_bytes
from reap_swap.plan.model import format_ranges
from reap_swap.server import cache_status as cache_surface
from reap_swap.server.swap_failure import stages_agree

_BRIEF_KEYS = {
    "rank",
    "tp_rank",
    "pp_rank",
    "dp_rank",
    "bytes_copied",
    "seconds",
    "signature",
    "resident_experts",
    "error",
    "rolled_back_locally",
    "grouped",
}
_STATUS_WORKER_KEYS = (
    "rank",
    "tp_rank",
    "tp_size",
    "pp_rank",
    "pp_size",
    "dp_rank",
    "stage_layers",
    "resident_bytes",
    "signature",
    "resident_experts",
    "counting",
    "uncounted_layers",
)


def brief(reply: wire.ApplyReply) -> dict:
    """One rank's line in a swap response (what it holds after the call, and its error)."""
    return reply.model_dump(include=_BRIEF_KEYS, exclude_none=True)


def timing(t0: float, phases: dict, worker_phases: list | None = None) -> dict:
    out = {"total_seconds": time.perf_counter() - t0, "phases": phases}
    if worker_phases is not None:
        out["worker_phases"] = worker_phases
    return out


def swap_response(
    base: dict, results: list[wire.ApplyReply], *, noop: bool, refresh_count: int, swap_seq: int
) -> dict:
    """The response to an applied swap (timing and forensics are added by the caller)."""
    notes = sorted({r.note for r in results} - {""})
    noop_note = (
        f"no-op: this active set (signature {base['signature']}) is already resident; nothing was applied. "
        if noop
        else ""
    )
    return {
        **base,
        "validate_only": False,
        "noop": noop,
        "refresh_count": refresh_count,
        "swap_seq": swap_seq,
        "bytes_copied": sum(r.bytes_copied for r in results),
        "bytes_copied_per_worker": [r.bytes_copied for r in results],
        "note": noop_note + " ".join(notes),
        "workers": [brief(r) for r in results],
        "workers_consistent": stages_agree([(r.pp_rank, r.signature) for r in results]),
    }


def status_report(ctl: Any, statuses: list[wire.StatusReply]) -> dict:
    """GET /reap/status: the controller's view and each worker's (ctl: controller.SwapController)."""
    mine = wire.encode_resident_sets(ctl.resident)
    return {
        "plan_identity": ctl.plan.identity,
        "plan_file": ctl.plan_file,
        "plan_given": not ctl.plan.bare,  # False: started without a plan (plan/bare.py)
        "model": ctl.plan.model,
        "mode": ctl.residency_mode,
        "validate_only": ctl.validate_only,
        "signature": ctl.sig,
        "layers": mine,
        "resident_experts": sum(len(v) for v in ctl.resident.values()),
        "resident_bytes": resident_bytes(ctl.plan, ctl.resident),
        "budget_bytes": ctl.plan.swappable_budget_bytes,
        "pool": _pool(ctl),  # --reap-budget auto | GiB: what swaps fill (pool_fill.py)
        "memory_split": getattr(ctl, "budget_report", None),  # --reap-budget (server/budget.py)
        "swap_count": ctl.swap_count,
        "noop_count": ctl.noop_count,
        "failed_count": ctl.failed_count,
        "last_swap_time": ctl.last_swap_time,
        "last_swap_seconds": ctl.last_swap_seconds,
        "open_request": ctl.open_request,
        "unattributed_selections": ctl.unattributed_selections,
        "cartridges": {
            "defined": sorted(ctl.cartridge_defs),
            "loaded": list(ctl.cartridges),
            "max_loaded": ctl.cartridges.max_entries,
        },
        "workers": [
            {
                **{k: getattr(s, k) for k in _STATUS_WORKER_KEYS},
                "mode": s.residency_mode,
                "budget": s.backend.get("budget"),
                "engine": engine_summary(s.backend),
                "runner": s.runner,  # vLLM's model runner (V1 / V2) and what it changes here
            }
            for s in statuses
        ],
        "workers_consistent": all(s.layers == _stage_part(mine, s) for s in statuses),
        "stages": stage_coverage(ctl.plan.layers, statuses),
        "cache": cache_surface.report(statuses),
        "group_size": group_size_report(getattr(ctl.plan, "group_size", 1), [s.backend for s in statuses]),
    }


def startup_resident(statuses: list[wire.StatusReply], plan_layers) -> dict:
    """The resident set the workers start with, joined over pipeline stages: every rank of a
    stage must hold the same set, and the stages together every plan layer exactly once (without
    PP: every rank the same set of every layer). RuntimeError naming the disagreement."""
    stages: dict[int, dict] = {}
    for s in statuses:
        if stages.setdefault(s.pp_rank, s.layers) != s.layers:
            raise RuntimeError(f"workers disagree about the resident set at startup: {statuses}")
    if not stage_coverage(plan_layers, statuses)["every_layer_once"]:
        raise RuntimeError(f"pipeline stages do not hold every plan layer exactly once: {statuses}")
    joined: dict = {}
    for pp_rank in sorted(stages):
        joined.update(wire.decode_resident_sets(stages[pp_rank]))
    return dict(sorted(joined.items()))


def _stage_part(mine: dict, s: wire.StatusReply) -> dict:
    """The controller's resident set restricted to the layers worker `s` holds."""
    stage = {str(l) for l in s.stage_layers} if s.stage_layers else set(mine)
    return {k: v for k, v in mine.items() if k in stage}


def stage_coverage(plan_layers, statuses: list[wire.StatusReply]) -> dict:
    """Which workers hold each plan layer, and whether every (dp_rank, tp_rank) sees each plan
    layer on exactly one pipeline stage (always, without pipeline parallelism)."""
    every = sorted(int(l) for l in plan_layers)
    holders: dict[str, list[int]] = {str(l): [] for l in every}
    groups: dict[tuple[int, int], list[int]] = {}
    for s in statuses:
        stage = list(s.stage_layers) or every
        for layer in stage:
            holders.setdefault(str(layer), []).append(s.rank)
        groups.setdefault((s.dp_rank, s.tp_rank), []).extend(stage)
    return {
        "pp_size": max((s.pp_size for s in statuses), default=1),
        "layer_workers": holders,
        "every_layer_once": bool(groups) and all(sorted(v) == every for v in groups.values()),
    }


def group_size_report(plan_b: int, backends: list[dict]) -> dict:
    """The plan's groupSize against the engine's b of every re-homed layer, per worker. A
    difference is a warning, not a refusal: the plan still serves, its core and slices are just
    not whole groups of the engine's b (boundary passengers), or whole groups of a b not used."""
    engine: dict[int, int] = {}
    differ: dict[int, int] = {}
    for backend in backends:
        layouts = backend.get("layouts") if isinstance(backend.get("layouts"), dict) else {}
        for layer in backend.get("layers_rehomed") or ():
            b = int((layouts.get(str(layer)) or {}).get("group_size", 1))
            engine[int(layer)] = b
            if b != plan_b:
                differ[int(layer)] = b
    out: dict[str, Any] = {
        "plan": plan_b,
        "engine": {str(l): b for l, b in sorted(engine.items())},
        "matches": not differ,
        "warning": None,
    }
    if not engine:
        out["matches"] = None
        out["warning"] = None if plan_b == 1 else "no re-homed layer reports a group size: not checked"
    elif differ:
        by_b: dict[int, list[int]] = {}
        for l, b in sorted(differ.items()):
            by_b.setdefault(b, []).append(l)
        where = "; ".join(f"b = {b} on layers {format_ranges(ls)}" for b, ls in sorted(by_b.items()))
        out["warning"] = (
            f"the plan was made for groups of {plan_b} (groupSize), the engine uses {where}: "
            "cores and slices are not sized in the engine's groups (boundary groups carry "
            "passengers, or the plan gave up experts to round for groups the engine does not use); "
            "re-plan with reap-swap plan --group-size matching --reap-group-size"
        )
    return out


# what a worker's residency backend reports about the engine (cuda_backend.CudaResidency.status,
# accounting.AccountingResidency.status): pool, mapping unit, kept-whole HBM, per-layer refusals
_ENGINE_KEYS = (
    "reason",
    "layers_rehomed",
    "refused_layers",
    "pool_slots",
    "pool_hbm_bytes",
    "unit_bytes",
    "kept_whole_hbm_bytes",
    "rehomed_tensors",
    "bytes_copied_total",
    "layout",  # --reap-group-size: private | grouped, b, per-layer layout and why
    "group_size",
    "layouts",
    "hbm_used_bytes",
    "bytes_per_expert",
    "capacity_experts",
)


def engine_summary(backend: dict) -> dict:
    """One worker's engine facts for /reap/status (absent keys: that backend has no such fact)."""
    out = {k: backend[k] for k in _ENGINE_KEYS if k in backend}
    if isinstance(out.get("rehomed_tensors"), dict):  # int layer keys: JSON wants strings
        out["rehomed_tensors"] = {str(k): v for k, v in out["rehomed_tensors"].items()}
    return out


def _pool(ctl: Any) -> dict | None:
    pool = getattr(ctl, "pool", None)
    if pool is None:
        return None
    return {
        "slots": pool.slots,
        "bytes": pool.nbytes(ctl.plan),
        "layers": sorted(pool.layers),
        "source": pool.source,
    }
