"""The worker RPC contract: one pydantic model per request and reply, one encoding of resident sets.

Why: the API process and the workers are separate processes talking through vLLM's
`collective_rpc`, which carries msgpack-able values only (string-keyed dicts, lists, numbers).
Requests are sent as keyword arguments (`rpc(method, **Request(...).model_dump())`), validated on
the worker, and every reply is a model the controller validates back, so a renamed field fails
loudly on both sides instead of reading as a missing key. A failing worker *answers*
`{"error": ...}` instead of raising: vLLM's multiproc collective_rpc stops reading replies at the
first failing rank, so a raise on rank 0 would leave rank 1's reply queued and shift every later
reply by one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from reap_swap.plan.active_set import ResidentSets

WireResidentSets = dict[str, list[int]]  # {"<layer>": [sorted expert ids]}

APPLY_RESIDENCY = "reap_apply_residency"
STATUS = "reap_status"
READ_STATS = "reap_read_stats"
RESET_STATS = "reap_reset_stats"
ARM_SWAP_FAULT = "reap_arm_swap_fault"
SELFCHECK = "reap_selfcheck"
FILL_BUDGET = "reap_fill_budget"  # --reap-budget auto | GiB: probe, then grow (worker.py)
CACHE_TRACE = "reap_cache_trace"


def encode_resident_sets(sets: Mapping[int, Any]) -> WireResidentSets:
    """{layer: ids} -> {"<layer>": sorted ids}, layers in order (the one wire form)."""
    return {str(k): sorted(int(e) for e in v) for k, v in sorted(sets.items())}


def decode_resident_sets(wire: Mapping[Any, Any]) -> ResidentSets:
    """{"<layer>": ids} -> {layer: frozenset(ids)}."""
    return {int(k): frozenset(int(e) for e in v) for k, v in wire.items()}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WorkerHeader(_Model):
    """Who answered: the worker's global rank and its tensor/pipeline/data-parallel coordinates."""

    rank: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int = 0


class ResidentSummary(_Model):
    """A rank's resident set as the controller compares it (signature over the plan layers)."""

    signature: str
    resident_experts: int


# -- reap_apply_residency ------------------------------------------------------------------------
class ApplyResidency(_Model):
    """Make `resident` (every plan layer, core included) the worker's resident set.

    With `read_stats`, the counters are read before and zeroed after a successful apply, in this
    one call, so no engine step falls between closing one request's statistics and changing the
    resident set."""

    resident: WireResidentSets
    dry_run: bool = False
    read_stats: bool = False


class CapacityRefusal(_Model):
    """PoolCapacityError's numbers (slots, in the refusing table's units) and its sentence."""

    needed: int
    capacity: int
    message: str


class ApplyReply(WorkerHeader, ResidentSummary):
    dry_run: bool
    residency_mode: str | None = None
    bytes_copied: int = 0
    seconds: float = 0.0
    gbps: float | None = None
    phases: dict[str, float] = Field(default_factory=dict)
    evicted: int | None = None
    admitted: int | None = None
    reused: int | None = None
    ignored_layers: list[int] = Field(default_factory=list)
    experts_added: int | None = None
    grouped: dict[str, int] | None = None  # --reap-group-size: HBM and experts of the groups held
    note: str = ""
    stats: dict[str, dict] = Field(default_factory=dict)  # "<layer>" -> counters.read's answer
    error: str | None = None
    rolled_back_locally: bool | None = None  # the worker's own rollback (CUDA), when it failed
    capacity: CapacityRefusal | None = None  # a capacity refusal before anything moved


# -- the expert cache (reap_swap.cache.accounting) -----------------------------------------------
class CacheStatus(BaseModel):
    """Extra keys allowed: per-layer detail is the accounting's (engaged, reason, slots, ...)."""

    model_config = ConfigDict(extra="allow")
    engaged: bool
    reason: str | None = None
    policy: str | None = None
    totals: dict[str, int] = Field(default_factory=dict)
    layers: dict[str, dict[str, Any]] = Field(default_factory=dict)


class CacheTrace(_Model):
    reset: bool = False


class CacheTraceReply(WorkerHeader):
    recording: int  # steps kept (0: --reap-cache-record-steps is off)
    steps: list[dict[str, Any]]  # [{"request_start": bool, "layers": {"<layer>": [counts per expert]}}]


# -- reap_status ---------------------------------------------------------------------------------
class StatusReply(WorkerHeader, ResidentSummary):
    residency_mode: str
    plan_identity: str
    layers: WireResidentSets
    resident_bytes: int
    counting: dict[str, bool] = Field(default_factory=dict)
    uncounted_layers: dict[str, str] = Field(default_factory=dict)  # plan layer -> why not counted
    coactivation: bool = False
    counter_kernel: dict[str, Any] = Field(default_factory=dict)
    backend: dict[str, Any] = Field(default_factory=dict)
    cache: CacheStatus | None = None  # the expert cache (cache_accounting.CacheAccounting.status)
    # pipeline parallelism: the plan layers this stage holds (`layers` lists only these); every
    # plan layer without PP
    stage_layers: list[int] = Field(default_factory=list)
    # the worker's vLLM model runner (compat.runner.runner_status): "v1" | "v2", mask, notes
    runner: dict[str, Any] = Field(default_factory=dict)


# -- reap_read_stats / reap_reset_stats ----------------------------------------------------------
class ReadStats(_Model):
    reset: bool = False


class StatsReply(WorkerHeader):
    layers: dict[str, dict]  # "<layer>" -> {"counts": [...], "weights": [...], ("coact": ...)}


class ResetReply(_Model):
    rank: int


# -- reap_arm_swap_fault (test seam) -------------------------------------------------------------
class ArmSwapFault(_Model):
    rank: int
    after_admissions: int = Field(default=1, ge=0)


class ArmReply(WorkerHeader):
    armed: bool
    after_admissions: int | None = None
    note: str | None = None
    error: str | None = None


def replies(model: type[BaseModel], results: list) -> list:
    """Validate one reply per worker into `model` (a malformed reply is a loud error)."""
    return [model.model_validate(r) for r in results]
