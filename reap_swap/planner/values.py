"""Per-expert values: what one expert of a layer is worth to the planner, in a total order.

An expert's value is its share of its layer's routed selections, router mass or REAP saliency;
ties break on a secondary signal, then on the id, so the same inputs always give the same order.
"""

from __future__ import annotations

import numpy as np

from reap_swap.planner.config import PlannerError
from reap_swap.planner.observation_types import LayerStats

_FLOAT_DIGITS = 8


def rounded(x: float) -> float:
    """Rounded float: stable, short JSON."""
    return round(float(x), _FLOAT_DIGITS)


def share(values: np.ndarray | None) -> np.ndarray | None:
    if values is None:
        return None
    values = np.asarray(values, dtype=np.float64)
    s = values.sum()
    return values / s if s > 0 else np.zeros_like(values)


def layer_values(stats: LayerStats, signal: str) -> np.ndarray:
    """Per-expert value in [0, 1], summing to 1 over the layer (0 everywhere if nothing routed)."""
    if signal == "frequency":
        return share(stats.expert_frequency)
    if signal == "router_mass":
        if stats.weighted_frequency is None:
            raise PlannerError(
                f"signal router_mass needs weighted_expert_frequency_sum (missing in layer {stats.raw_key!r})"
            )
        return share(stats.weighted_frequency)
    if stats.reap is None:
        raise PlannerError(f"signal reap needs REAP's 'reap' field (missing in layer {stats.raw_key!r})")
    return share(np.maximum(stats.reap, 0.0))


def value_order(values: np.ndarray, secondary: np.ndarray) -> list[int]:
    """Experts by value desc, then secondary desc, then id asc: a total, reproducible order."""
    n = len(values)
    return sorted(range(n), key=lambda e: (-values[e], -secondary[e], e))


def secondary_values(stats: LayerStats) -> np.ndarray:
    """Tie-breaker after the value: router mass, else REAP impact, else zeros."""
    if stats.weighted_frequency is not None:
        return share(stats.weighted_frequency)
    if stats.weighted_ean_sum is not None:
        return share(stats.weighted_ean_sum)
    return np.zeros(stats.num_experts)


def signal_description(signal: str) -> str:
    return {
        "frequency": "expert_frequency / layer total (share of routed selections)",
        "router_mass": "weighted_expert_frequency_sum / layer total (share of routed gate weight)",
        "reap": "reap / layer sum (REAP saliency share; a baseline, not a hit-rate signal)",
    }[signal]
