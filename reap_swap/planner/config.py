"""The planner's knobs and its refusal: PlannerConfig (recorded verbatim in the plan) and PlannerError."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from reap_swap.sizing.model_shape import ModelShape

GIB = 1 << 30


class PlannerError(ValueError):
    """The observations and the model or the budget do not admit a plan; the message says why."""


class PlannerConfig(BaseModel):
    """Every knob of the planner; recorded verbatim in scorerArtifacts.parameters."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    budget_ratio: float | None = Field(
        default=None, gt=0, le=1, description="resident budget as a fraction of all expert bytes"
    )
    budget_gib: float | None = Field(default=None, gt=0, description="resident budget in GiB")
    core_fraction: float = Field(default=0.75, ge=0, le=1)
    signal: Literal["frequency", "router_mass", "reap"] = "frequency"
    layer_allocation: Literal["greedy", "uniform"] = "greedy"
    slices_per_request: int = Field(default=2, ge=1, description="slices a request may add per layer")
    slice_size: int | None = Field(default=None, ge=1, description="experts per slice; default derived")
    candidate_pool_multiplier: float = Field(default=1.25, ge=1)
    reap_guard: bool = True
    reap_guard_multiple: float = Field(default=2.0, gt=0)
    reap_guard_max_fraction: float = Field(default=0.1, ge=0, le=1)
    super_experts: bool = True
    super_expert_quantile: float = Field(default=99.5, gt=0, le=100)
    super_expert_max_divisor: float = Field(default=10.0, ge=1)
    max_refreshes_per_request: int = Field(default=1, ge=0)
    cache_tail: int | Literal["auto"] = Field(
        default=0,
        description="cap the core so that the device cache's pinned form (core+dlfu, (pool - core) // "
        "layers tail slots per layer) keeps at least this many tail slots per layer: core <= budget slots "
        "- layers x N, a layer's core <= its experts - N; auto: 2 x the model's top_k; 0: no cap "
        "(today's plans, unchanged bytes)",
    )
    group_size: Literal["auto", "1", "2", "4", "8"] | None = Field(
        default=None,
        description="plan for the grouped engine's groups of b experts (planner_groups); None: today's "
        "planner, experts priced at checkpoint bytes, no groupSize in the plan",
    )

    def recorded(self) -> dict:
        """scorerArtifacts.parameters: every knob; group_size only when given, cache_tail only when
        not 0 (old plans' bytes)."""
        exclude = {"group_size"} if self.group_size is None else set()
        if self.cache_tail == 0:
            exclude.add("cache_tail")
        return self.model_dump(mode="json", exclude=exclude or None)

    def tail_slots(self, top_k: int) -> int:
        """The cache tail the core must leave per layer: cache_tail, or 2 x top_k for auto."""
        return 2 * int(top_k) if self.cache_tail == "auto" else int(self.cache_tail)

    @model_validator(mode="after")
    def _one_budget(self) -> PlannerConfig:
        if (self.budget_ratio is None) == (self.budget_gib is None):
            raise ValueError("give exactly one of budget_ratio and budget_gib")
        if self.cache_tail != "auto" and self.cache_tail < 0:
            raise ValueError(f"cache_tail {self.cache_tail}: give auto, 0 (no cap) or a positive slot count")
        if self.cache_tail != 0 and self.group_size is not None:
            raise ValueError(
                "cache_tail with group_size: the grouped engine refuses the device cache "
                "(--reap-group-size with --reap-cache-device on), so there is no tail to leave room for"
            )
        return self


def budget_bytes(shape: ModelShape, config: PlannerConfig) -> int:
    total = shape.total_expert_bytes
    if config.budget_ratio is not None:
        return int(math.floor(config.budget_ratio * total))
    return int(math.floor(config.budget_gib * GIB))
