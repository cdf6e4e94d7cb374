"""The two performance guards as numbers: a 1 GiB swap >= 50 GB/s, and all-resident single-stream
decode >= 0.97 of stock vLLM (pure: no torch, no servers; research/gpu/gpu_swap_guard.py and
research/gpu/gpu_guards.py measure, this summarises, tests/test_guard_report.py checks it).

Conventions as bench_report: medians with min-max of raw samples, ratios of medians from one run.
Decode samples carry the serve they came from, so both readings are given: the median over every
(serve, round) sample pooled, and the median of the per-serve medians (what "median of >= N serves"
means; with few serves it is the weaker one and the report says how many serves it rests on), and
the paired reading: per (serve, round) the arm's rate over stock's rate in the same round, median per
serve, median of those (round-wide drift, which can be large, cancels in the pair). An arm
refused by name (the cache arm whose cache did not engage: ``cache_not_engaged``) reads "not
measured": no ratio, no guard verdict.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from typing import Any

from reap_swap.bench.report import ratio, summarize

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


def cache_not_engaged(
    cache: Mapping | None, layers: int, slots_per_layer: int, ran: bool = False
) -> str | None:
    """None when /reap/status's "cache" section shows the device cache engaged on all `layers`
    layers with `slots_per_layer` tail slots each (and, with ``ran``, counting steps), else why not."""
    if not cache:
        return "no cache section in /reap/status"
    if not cache.get("engaged") or cache.get("mode") != "device":
        return f"cache not engaged (mode {cache.get('mode')}): {cache.get('reason') or '-'}"
    per_layer = cache.get("layers") or {}
    engaged = [l for l, row in per_layer.items() if row.get("engaged")]
    if len(engaged) != layers:
        off = {l: row.get("reason") for l, row in per_layer.items() if not row.get("engaged")}
        return f"cache engaged on {len(engaged)} of {layers} layers (refused: {off})"[:600]
    short = {l: per_layer[l].get("slots") for l in engaged if per_layer[l].get("slots") != slots_per_layer}
    if short:
        return f"cache slots per layer {short}, expected {slots_per_layer}"[:600]
    if ran and not cache.get("steps"):
        return "the cache counted no step during the timed rounds"
    return None


def _paired(rows: list[Mapping], base: dict[tuple[int, int], float]) -> dict[int, float]:
    """Per serve: the median of (arm / stock) over the rounds both measured."""
    by: dict[int, list[float]] = {}
    for r in rows:
        b = base.get((int(r["serve"]), int(r["round"])))
        if r.get("tok_s") is not None and b:
            by.setdefault(int(r["serve"]), []).append(float(r["tok_s"]) / b)
    return {s: statistics.median(v) for s, v in sorted(by.items())}


def _verdicts(pooled: float | None, served: float | None, paired: float | None) -> dict:
    out = {"pooled": pooled, "serve_medians": served, "paired": paired, "target": DECODE_TARGET}
    for name, v in (("pooled", pooled), ("serve_medians", served), ("paired", paired)):
        out["met_" + name] = None if v is None else v >= DECODE_TARGET
    return out


def decode_summary(
    samples: Iterable[Mapping[str, Any]], stock: str = "stock", refused: Mapping[str, str] | None = None
) -> dict:
    """samples: {"arm", "serve", "round", "tok_s"} (single-stream decode tok/s). Per arm: pooled
    summary, per-serve medians, median of serve medians; each arm's ratios to `stock` under the
    three readings (pooled, serve medians, paired), and the guard (>= DECODE_TARGET) on each.
    ``refused``: arm -> why it was not measured (its row says so, no ratios)."""
    samples = list(samples)
    arms: dict[str, list[Mapping]] = {a: [] for a in (refused or {})}
    for s in samples:
        arms.setdefault(s["arm"], []).append(s)
    base = {
        (int(s["serve"]), int(s["round"])): float(s["tok_s"])
        for s in samples
        if s["arm"] == stock and s.get("tok_s")
    }
    out: dict[str, dict] = {}
    for arm, rows in arms.items():
        serves = _per_serve(rows)
        out[arm] = {
            "pooled": summarize(r.get("tok_s") for r in rows),
            "per_serve_median": serves,
            "serve_medians": summarize(serves.values()),
            "serves": len(serves),
        }
        if arm != stock:
            out[arm]["paired_per_serve"] = _paired(rows, base)
    ref = out.get(stock) or {}
    for arm, row in out.items():
        if arm == stock:
            continue
        if arm in (refused or {}):
            row["not_measured"] = refused[arm]
            row["vs_stock"] = _verdicts(None, None, None)
            continue
        paired = summarize(row["paired_per_serve"].values())
        row["vs_stock"] = _verdicts(
            ratio(row["pooled"], ref.get("pooled")),
            ratio(row["serve_medians"], ref.get("serve_medians")),
            None if paired is None else paired["median"],
        )
    return {"arms": out, "stock": stock}


def decode_markdown(summary: Mapping[str, Any]) -> str:
    """The decode guard as a markdown table (tok/s medians with min-max, ratios to stock)."""
    lines = [
        "| arm | serves | samples | pooled tok/s (min-max) | median of serve medians "
        "| vs stock (pooled / serves / paired) | paired per serve | >= 0.97 (paired) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm, row in summary["arms"].items():
        p, s = row["pooled"] or {}, row["serve_medians"] or {}
        vs = row.get("vs_stock")
        if vs is None:
            ratios, per, met = "--", "--", "--"
        else:
            ratios = " / ".join(_f(vs[k], 3) for k in ("pooled", "serve_medians", "paired"))
            per = ", ".join(_f(v, 3) for v in row.get("paired_per_serve", {}).values()) or "--"
            met = "n/a" if vs["met_paired"] is None else ("yes" if vs["met_paired"] else "**no**")
        if "not_measured" in row:
            ratios, met = f"not measured: {row['not_measured'][:160]}", "not measured"
        lines.append(
            f"| {arm} | {row['serves']} | {p.get('n', 0)} | {_f(p.get('median'))} "
            f"({_f(p.get('min'))}-{_f(p.get('max'))}) | {_f(s.get('median'))} | {ratios} | {per} | {met} |"
        )
    return "\n".join(lines)


def _f(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"
