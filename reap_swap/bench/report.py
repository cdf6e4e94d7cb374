"""Turn a bench run's raw numbers into medians, ratios, a markdown table and a PNG plot.

Why separate from bench.py: this part is pure (no servers, no HTTP), so the statistics, the
ratios and the rendering (bench/markdown.py, bench/plot.py) are unit-tested from synthetic numbers; bench.py only measures.

Conventions: every timed quantity is a list of raw samples (one per repeat) summarised as
median with min-max; a ratio between two runs is the ratio of their medians from the same
bench invocation (never across invocations). A missing measurement is None and renders as
"n/a" with the reason the run recorded.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

GIB = 2**30

# (key in a row's "stats", column title, scale, digits); scale turns seconds into ms
TIMED_COLUMNS = (
    ("ttft_s", "TTFT ms", 1000.0, 1),
    ("prefill_tok_s", "prefill tok/s", 1.0, 0),
    ("decode_tok_s_1", "decode tok/s (1 stream)", 1.0, 1),
    ("decode_tok_s_batch", "decode tok/s (batch {batch})", 1.0, 1),
)
RATIO_METRICS = ("decode_tok_s_1", "decode_tok_s_batch", "ttft_s", "prefill_tok_s")


def summarize(values: Iterable[float | None]) -> dict | None:
    """Median, min, max and count of the non-None samples; None when there are none."""
    xs = sorted(float(v) for v in values if v is not None)
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "n": len(xs)}


def ratio(numerator: Mapping | None, denominator: Mapping | None) -> float | None:
    """Ratio of two summaries' medians (same run); None if either is missing or the divisor is 0."""
    if not numerator or not denominator or not denominator.get("median"):
        return None
    return numerator["median"] / denominator["median"]


def cache_hit_ratio(totals: Mapping) -> float | None:
    """hits / (hits + misses) of /reap/status's cache totals (None before any selection reached it)."""
    seen = totals.get("hits", 0) + totals.get("misses", 0)
    return totals.get("hits", 0) / seen if seen else None


def pooled_hit_rate(requests: Sequence[Mapping]) -> dict | None:
    """Hit rate over all requests' routed selections (1 - missed / observed), plus per-request spread.

    Each request carries the server's totals: observed_selections, missed_selections,
    observed_mass, inactive_mass.
    """
    rows = [r for r in requests if r.get("observed_selections")]
    if not rows:
        return None
    observed = sum(r["observed_selections"] for r in rows)
    missed = sum(r["missed_selections"] for r in rows)
    mass = sum(r.get("observed_mass") or 0.0 for r in rows)
    inactive = sum(r.get("inactive_mass") or 0.0 for r in rows)
    per_request = [1.0 - r["missed_selections"] / r["observed_selections"] for r in rows]
    return {
        "hit_rate": 1.0 - missed / observed,
        "mass_hit_rate": 1.0 - inactive / mass if mass else None,
        "observed_selections": observed,
        "missed_selections": missed,
        "requests": len(rows),
        "per_request": summarize(per_request),
    }


def uva_offloaded_bytes(layer_expert_bytes: Sequence[int], max_bytes: int) -> int:
    """Bytes stock vLLM's UVA offloader moves to host memory with --cpu-offload-params w13_weight w2_weight.

    It walks the decoder layers in order and offloads whole parameters while its running total is
    below the limit (vllm/model_executor/offloader/uva.py): per MoE layer w13 (gate+up, 2/3 of the
    layer's expert bytes) then w2 (down, 1/3). So it is layer- (parameter-) granular and may
    overshoot the limit by up to one parameter.
    """
    offloaded = 0
    for layer_bytes in layer_expert_bytes:
        for part in (layer_bytes * 2 // 3, layer_bytes - layer_bytes * 2 // 3):
            if offloaded >= max_bytes:
                return offloaded
            offloaded += part
    return offloaded


# ----------------------------------------------------------------------------- summary


def run_stats(run: Mapping) -> dict:
    """Per run: summaries of every timed quantity, the hit rate, swaps and memory."""
    timing = run.get("timing") or {}
    single = timing.get("single") or []
    batch = timing.get("batch") or []
    stats: dict[str, Any] = {
        "ttft_s": summarize(s.get("ttft_s") for s in single),
        "prefill_tok_s": summarize(s.get("prefill_tok_s") for s in single),
        "decode_tok_s_1": summarize(s.get("decode_tok_s") for s in single),
        "decode_tok_s_batch": summarize(b.get("decode_tok_s") for b in batch),
        "batch_ttft_s": summarize(b.get("ttft_median_s") for b in batch),
        "open_s": summarize(s.get("open_s") for s in single),
    }
    swaps = run.get("swaps") or []
    real = [s for s in swaps if not s.get("noop") and s.get("kind") != "warm"]
    stats["swap_count"] = len(real)
    stats["open_count"] = len(swaps)
    stats["swap_latency_s"] = summarize(s.get("server_seconds") for s in real)
    stats["open_latency_s"] = summarize(s.get("server_seconds") for s in swaps)
    stats["bytes_copied_total"] = sum(int(s.get("bytes_copied") or 0) for s in swaps) if swaps else None
    stats["bytes_copied_per_swap"] = summarize(s.get("bytes_copied") for s in real)
    return stats


def greedy_matrix(runs: Sequence[Mapping], reference: str | None) -> dict:
    """Per run: which prompts' greedy outputs equal the reference run's (from run["greedy_vs_ref"])."""
    out = {}
    for run in runs:
        cmp = run.get("greedy_vs_ref")
        if cmp is not None:
            out[run["label"]] = cmp
    return {"reference": reference, "runs": out}


def ratio_matrix(runs: Sequence[Mapping], metric: str) -> dict[str, dict[str, float | None]]:
    """ratios[a][b] = median(a) / median(b) for one metric, over the runs that measured it."""
    have = [(r["label"], (r.get("stats") or {}).get(metric)) for r in runs]
    have = [(label, s) for label, s in have if s]
    return {a: {b: ratio(sa, sb) for b, sb in have if b != a} for a, sa in have}


def summarize_runs(runs: list[dict], reference: str | None) -> dict:
    """Fill each run's "stats" and return the cross-run part of the report."""
    for run in runs:
        run["stats"] = run_stats(run) if run.get("status") == "ok" else {}
    ok = [r for r in runs if r.get("status") == "ok"]
    ratios = {m: ratio_matrix(ok, m) for m in RATIO_METRICS}
    return {"reference": reference, "ratios": ratios, "greedy": greedy_matrix(ok, reference)}
