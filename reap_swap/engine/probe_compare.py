"""Comparing two MoE-layer probes (reap_swap.engine.moe_probe digests): pure, so reports on machines
without torch can use it."""

from __future__ import annotations

from collections.abc import Mapping


def compare_probes(reference: Mapping, other: Mapping) -> dict:
    """Which (layer, size) digests differ between two probes (of one rank each)."""
    if reference.get("inputs") != other.get("inputs"):
        return {"comparable": False, "why": "different probe inputs (seed, sizes, dtype)"}
    differ = [
        f"{name}@{n}"
        for name, row in reference["layers"].items()
        for n, d in row.items()
        if (other["layers"].get(name) or {}).get(n) != d
    ]
    total = sum(len(row) for row in reference["layers"].values())
    return {"comparable": True, "equal": total - len(differ), "of": total, "differ": differ}
