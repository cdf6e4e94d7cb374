"""Slices: the non-core experts of a layer grouped by true co-activation, and their catalog entries.

Experts routed on the same tokens go together (Ochiai coefficient of the co-activation counts,
greedy from the most valuable seed). REAP's ``pairwise_expert_frequency`` is freq[i] + freq[j]
and says nothing about co-firing, so without our ``coactivation`` the slices are consecutive
experts in value order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from reap_swap.planner.allocation import LayerWork
from reap_swap.planner.observation_types import LayerStats
from reap_swap.planner.values import rounded, share


def ochiai(coact: np.ndarray, freq: np.ndarray) -> np.ndarray:
    """C_ij / sqrt(f_i f_j): 1 when two experts are always routed together, 0 when never."""
    coact = np.asarray(coact, dtype=np.float64)
    denom = np.sqrt(np.outer(freq, freq).astype(np.float64))
    out = np.divide(coact, denom, out=np.zeros_like(coact), where=denom > 0)
    np.fill_diagonal(out, 0.0)
    return out


def group_by_coactivation(experts: list[int], affinity: np.ndarray, size: int) -> list[list[int]]:
    """Greedy groups of `size`: seed = first unassigned expert (callers pass value order), then add
    the unassigned expert with the highest mean affinity to the group (ties: earlier in `experts`)."""
    left = list(experts)
    groups = []
    while left:
        group = [left.pop(0)]
        while left and len(group) < size:
            scores = affinity[np.ix_(left, group)].mean(axis=1)
            best = int(np.argmax(scores))  # argmax returns the first maximum: earlier wins ties
            group.append(left.pop(best))
        groups.append(group)
    return groups


def slice_groups(rest: list[int], affinity: np.ndarray | None, size: int) -> list[list[int]]:
    """The layer's non-core experts (value order) in groups of `size`: by co-activation when known."""
    if affinity is not None:
        return group_by_coactivation(rest, affinity, size)
    return [rest[k : k + size] for k in range(0, len(rest), size)]


def slice_entries(
    w: LayerWork,
    groups: list[list[int]],
    pe: int,
    sources: Sequence[tuple[str, LayerStats]],
    tags: Mapping[str, LayerStats],
    affinity: np.ndarray | None,
) -> list[dict]:
    s = w.stats
    freq_share = share(s.expert_frequency)
    mass_share = share(s.weighted_frequency)
    reap_share = share(np.maximum(s.reap, 0.0)) if s.reap is not None else None
    source_shares = [(label, share(st.expert_frequency)) for label, st in sources]
    tag_shares = {tag: share(st.expert_frequency) for tag, st in sorted(tags.items())}
    entries = []
    for group in groups:
        experts = sorted(group)
        idx = np.array(experts)
        entry: dict[str, Any] = {
            "experts": experts,
            "byteCost": len(experts) * pe,
            "activationMass": rounded(freq_share[idx].sum()),
            "rawActivationMass": rounded((mass_share if mass_share is not None else freq_share)[idx].sum()),
            "expertFrequencyMass": rounded(s.expert_frequency[idx].sum()),
        }
        if reap_share is not None:
            entry["reapMass"] = rounded(reap_share[idx].sum())
        if s.weighted_ean_sum is not None:
            entry["weightedEanMass"] = rounded(np.asarray(s.weighted_ean_sum)[idx].sum())
        if affinity is not None and len(experts) > 1:
            pairs = affinity[np.ix_(idx, idx)]
            entry["coactivationScore"] = rounded(pairs.sum() / (len(experts) * (len(experts) - 1)))
        entry["signalsBySummary"] = {label: rounded(share[idx].sum()) for label, share in source_shares}
        priors = {"global": entry["activationMass"]}
        priors.update({tag: rounded(share[idx].sum()) for tag, share in tag_shares.items()})
        entry["taskPriors"] = priors
        entries.append(entry)
    # catalog order: most routed mass first; ids follow the order
    entries.sort(key=lambda x: (-x["activationMass"], x["experts"][0]))
    width = max(2, len(str(len(entries) - 1)))
    for n, entry in enumerate(entries):
        entry["sliceId"] = f"layer_{w.index}_slice_{n:0{width}d}"
    return entries
