"""Issue 17's two guards as numbers: a 1 GiB swap >= 50 GB/s, and all-resident single-stream
decode >= 0.97 of stock vLLM (pure: no torch, no servers; scripts/gpu_swap_guard.py and
scripts/gpu_guards.py measure, this summarises, tests/test_guard_report.py checks it).

Conventions as bench_report: medians with min-max of raw samples, ratios of medians from one run.
Decode samples carry the serve they came from, so both readings are given: the median over every
(serve, round) sample pooled, and the median of the per-serve medians (what "median of >= N serves"
means; with few serves it is the weaker one and the report says how many serves it rests on).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from typing import Any

from .bench_report import ratio, summarize

SWAP_TARGET_GBPS = 50.0
SWAP_GUARD_CASE = "1GiB_delta"
DECODE_TARGET = 0.97


def swap_summary(samples: Iterable[Mapping[str, Any]], default_arm: str, baseline_arm: str = "off") -> dict:
    """samples: {"case", "arm", "gbps", "phases": {...seconds}}. Per case and arm: GB/s and the
    publish tail / overlapped publish in ms (medians); the arm's ratio to `baseline_arm`; the guard
    on `default_arm`'s 1 GiB delta."""
    groups: dict[str, dict[str, list[Mapping]]] = {}
    for s in samples:
        groups.setdefault(s["case"], {}).setdefault(s["arm"], []).append(s)
    cases: dict[str, dict] = {}
    for case, arms in groups.items():
        rows = {}
        for arm, rs in arms.items():
            rows[arm] = {
                "gbps": summarize(r["gbps"] for r in rs),
                "publish_ms": summarize(1e3 * r["phases"].get("publish", 0.0) for r in rs),
                "publish_overlapped_ms": summarize(
                    1e3 * r["phases"].get("publish_overlapped", 0.0) for r in rs
                ),
                "admit_ms": summarize(1e3 * r["phases"].get("admit", 0.0) for r in rs),
            }
        for row in rows.values():
            row["gbps_vs_" + baseline_arm] = ratio(row["gbps"], (rows.get(baseline_arm) or {}).get("gbps"))
        cases[case] = rows
    guard_row = cases.get(SWAP_GUARD_CASE, {}).get(default_arm) or {}
    median = (guard_row.get("gbps") or {}).get("median")
    return {
        "cases": cases,
        "guard": {
            "case": SWAP_GUARD_CASE,
            "arm": default_arm,
            "gbps_median": median,
            "target_gbps": SWAP_TARGET_GBPS,
            "met": None if median is None else median >= SWAP_TARGET_GBPS,
        },
    }


def _per_serve(rows: list[Mapping]) -> dict[int, float]:
    by: dict[int, list[float]] = {}
    for r in rows:
        if r.get("tok_s") is not None:
            by.setdefault(int(r["serve"]), []).append(float(r["tok_s"]))
    return {s: statistics.median(v) for s, v in sorted(by.items())}


def decode_summary(samples: Iterable[Mapping[str, Any]], stock: str = "stock") -> dict:
    """samples: {"arm", "serve", "round", "tok_s"} (single-stream decode tok/s). Per arm: pooled
    summary, per-serve medians, median of serve medians; each arm's ratios to `stock` under both
    readings, and the guard (>= DECODE_TARGET) on each."""
    arms: dict[str, list[Mapping]] = {}
    for s in samples:
        arms.setdefault(s["arm"], []).append(s)
    out: dict[str, dict] = {}
    for arm, rows in arms.items():
        serves = _per_serve(rows)
        out[arm] = {
            "pooled": summarize(r.get("tok_s") for r in rows),
            "per_serve_median": serves,
            "serve_medians": summarize(serves.values()),
            "serves": len(serves),
        }
    base = out.get(stock) or {}
    for arm, row in out.items():
        if arm == stock:
            continue
        pooled = ratio(row["pooled"], base.get("pooled"))
        served = ratio(row["serve_medians"], base.get("serve_medians"))
        row["vs_stock"] = {
            "pooled": pooled,
            "serve_medians": served,
            "target": DECODE_TARGET,
            "met_pooled": None if pooled is None else pooled >= DECODE_TARGET,
            "met_serve_medians": None if served is None else served >= DECODE_TARGET,
        }
    return {"arms": out, "stock": stock}


def decode_markdown(summary: Mapping[str, Any]) -> str:
    """The decode guard as a markdown table (tok/s medians with min-max, ratios to stock)."""
    lines = [
        "| arm | serves | samples | pooled tok/s (min-max) | median of serve medians | vs stock (pooled / serves) |",
        "|---|---|---|---|---|---|",
    ]
    for arm, row in summary["arms"].items():
        p, s = row["pooled"] or {}, row["serve_medians"] or {}
        vs = row.get("vs_stock")
        ratios = "--" if vs is None else f"{_f(vs['pooled'], 3)} / {_f(vs['serve_medians'], 3)}"
        lines.append(
            f"| {arm} | {row['serves']} | {p.get('n', 0)} | {_f(p.get('median'))} "
            f"({_f(p.get('min'))}-{_f(p.get('max'))}) | {_f(s.get('median'))} | {ratios} |"
        )
    return "\n".join(lines)


def _f(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"
