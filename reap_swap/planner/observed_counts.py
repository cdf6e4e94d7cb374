"""The router counts an observation run reads from its workers: merged over ranks, accumulated
over records, and checked (every layer routes tokens x top_k selections) before anything is written.
Pure (numpy)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np


class CountMismatch(RuntimeError):
    """Counters disagree with tokens x top_k: something was counted twice or not at all."""


def worker_layers(reports: Sequence[Mapping]) -> dict[int, dict[str, np.ndarray]]:
    """One worker report per rank -> per layer counts/weights(/coact) as numpy.

    Tensor-parallel ranks route identically: counts and weights go through
    forensics.aggregate_workers (lowest tp rank per data-parallel group, summed over groups);
    the co-activation matrix is taken from the same rank."""
    from reap_swap.plan.forensics import aggregate_workers, tp_groups

    agg = aggregate_workers(reports)
    for layer, stats in agg.items():
        if stats.get("tp_disagreement"):
            raise CountMismatch(f"layer {layer}: tensor-parallel ranks disagree: {stats['tp_disagreement']}")
    coact: dict[int, np.ndarray] = {}
    for members in tp_groups(reports).values():
        report = members[0]
        for key, stats in report.get("layers", {}).items():
            if stats.get("coact") is not None:
                m = np.asarray(stats["coact"], dtype=np.int64)
                coact[int(key)] = coact[int(key)] + m if int(key) in coact else m
    out = {}
    for layer, stats in agg.items():
        item = {
            "counts": np.asarray(stats["counts"], dtype=np.int64),
            "weights": np.asarray(stats["weights"], dtype=np.float64),
        }
        if layer in coact:
            item["coact"] = coact[layer]
        out[layer] = item
    return out


class CountAccumulator:
    """Per layer running sums over some records."""

    def __init__(self):
        self.tokens = 0
        self.layers: dict[int, dict[str, np.ndarray]] = {}

    def add(self, tokens: int, layers: Mapping[int, Mapping[str, np.ndarray]]) -> None:
        self.tokens += tokens
        for layer, stats in layers.items():
            mine = self.layers.setdefault(layer, {k: np.zeros_like(v) for k, v in stats.items()})
            for k, v in stats.items():
                mine[k] = mine[k] + v

    def layer_stats(self):
        from reap_swap.planner.observation_types import LayerStats

        return {
            layer: LayerStats(
                total_tokens=self.tokens,
                expert_frequency=s["counts"],
                weighted_frequency=s["weights"],
                coactivation=s.get("coact"),
                raw_key=str(layer),
            )
            for layer, s in sorted(self.layers.items())
        }


def check_counts(
    layers: Mapping[int, Mapping[str, np.ndarray]], tokens: int, top_k: int, expected_layers: Iterable[int]
) -> None:
    missing = sorted(set(expected_layers) - set(layers))
    if missing:
        raise CountMismatch(f"no counters for MoE layers {missing}: is the worker extension counting?")
    for layer, s in sorted(layers.items()):
        got = int(s["counts"].sum())
        if got != tokens * top_k:
            raise CountMismatch(
                f"layer {layer}: {got} routed selections for {tokens} tokens x top_k {top_k} = {tokens * top_k}"
                " (prefix caching, preemption recompute or a second forward of the same tokens?)"
            )
        if "coact" in s and not np.array_equal(np.diag(s["coact"]), s["counts"]):
            raise CountMismatch(f"layer {layer}: co-activation diagonal != counts")
