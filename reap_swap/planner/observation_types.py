"""What the observation files say, as the planner and evaluation read them: pure dataclasses.

observations.py turns ``torch.save`` files into these (numpy arrays, no torch); planner/inputs.py
merges several files' statistics.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class LayerStats:
    """One MoE layer's router statistics over some tokens. Optional fields are None when absent."""

    total_tokens: int
    expert_frequency: np.ndarray  # [E] int64: routed selections per expert
    weighted_frequency: np.ndarray | None = None  # [E] float64: summed routed gate weight
    coactivation: np.ndarray | None = None  # [E, E] int64: tokens on which both were routed
    reap: np.ndarray | None = None  # [E] REAP saliency (mean over routed tokens of g * ||out||)
    weighted_ean_sum: np.ndarray | None = None  # [E] sum over routed tokens of g * ||out||
    ean_sum: np.ndarray | None = None  # [E] sum over routed tokens of ||out||
    max_activations: np.ndarray | None = None  # [E] largest activation seen (super experts)
    raw_key: str = ""  # the layer's key in the file

    @property
    def num_experts(self) -> int:
        return int(self.expert_frequency.shape[0])


@dataclass(frozen=True)
class RecordCounts:
    """Per-record routed counts (observe --per-request): what per-request evaluation needs."""

    layers: tuple[int, ...]
    counts: np.ndarray  # [R, len(layers), E] routed selections per record, layer, expert
    tags: tuple[str, ...]  # [R]
    tokens: np.ndarray  # [R] prompt tokens per record
    lines: np.ndarray  # [R] corpus line numbers (1-based)


@dataclass(frozen=True)
class Observations:
    """One observation file, converted: all tokens, per corpus tag, optionally per record."""

    label: str  # names this input in sourceSummaries / signalsBySummary (the file's stem)
    digest: str  # sha256 hex of the file's bytes
    layers: Mapping[int, LayerStats]
    tags: Mapping[str, Mapping[int, LayerStats]] = field(default_factory=dict)
    records: RecordCounts | None = None
    fmt: str = "reap"  # "reap" (CerebrasResearch/reap observer) or "reap-swap" (our observe)
    fields: tuple[str, ...] = ()  # field names the file had (first layer)
    meta: Mapping[str, Any] = field(default_factory=dict)
