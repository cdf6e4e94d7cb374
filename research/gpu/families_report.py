"""Pure parts of the full-size families lane (issue 15): which residency points a plan allows, and
the per-family summary (family.json) and its markdown rows, from the arms' JSON files.

No torch, no vLLM, no server: research/gpu/gpu_families.py (on the device) and research/gpu/gpu_summarize.py
(here) both use it, and research/tests/test_gpu_families_report.py runs it on fake inputs.

The decode bound is t_token = t_resident + (1 - h) * t_all_missed (research.md, runs 3-8), h the
hit rate of the phase's routed selections. t_resident comes from the reap-swap 100 % phase if it
ran, else from stock vLLM (every expert in HBM); t_all_missed from the 0 % phase if it ran, else
it is fitted on the phase with the lowest h (that phase's ratio is then 1 by construction and is
marked "fit").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from reap_swap.bench.report import cache_hit_ratio
from reap_swap.engine.probe_compare import compare_probes

GIB = 2**30


def resident_count(plan: Mapping, active: Mapping[str, Sequence]) -> int:
    """Experts resident after a swap to `active` (slice ids or expert ids, per layer key): every
    plan layer's core plus what the active set names there."""
    total = 0
    for key, layer in plan["perLayer"].items():
        slices = {s["sliceId"]: s["experts"] for s in layer.get("sliceCatalog") or []}
        ids = set(layer.get("coreExperts") or [])
        for item in active.get(key, []):
            ids.update(slices[item] if isinstance(item, str) else [item])
        total += len(ids)
    return total


def offered(plan: Mapping, active: Mapping[str, Sequence]) -> bool:
    """Does the plan offer every expert id of `active` (core or a slice of its layer)? The server
    refuses an id outside core and slices (active_set.py)."""
    for key, items in active.items():
        layer = plan["perLayer"][key]
        ids = set(layer.get("coreExperts") or [])
        for s in layer.get("sliceCatalog") or []:
            ids.update(s["experts"])
        if any(not isinstance(i, str) and i not in ids for i in items):
            return False
    return True


def budget_fill(plan: Mapping) -> dict[str, list[str]]:
    """The largest round-robin prefix of each layer's slice catalog (slice 0 of every layer, then
    slice 1, ...) whose resident experts fit the plan's swappable budget."""
    per_expert = plan["budget"]["per_expert_bytes"]
    limit = plan["budget"]["swappable_expert_budget_bytes"] // per_expert
    active: dict[str, list[str]] = {}
    depth = max(len(layer.get("sliceCatalog") or []) for layer in plan["perLayer"].values())
    for r in range(depth):
        added = False
        for key, layer in plan["perLayer"].items():
            catalog = layer.get("sliceCatalog") or []
            if r >= len(catalog):
                continue
            trial = {**active, key: [*active.get(key, []), catalog[r]["sliceId"]]}
            if resident_count(plan, trial) <= limit:
                active, added = trial, True
        if not added:
            break
    return active


def first_experts(layer_keys: Sequence[str], count: int) -> dict[str, list[int]]:
    return {key: list(range(count)) for key in layer_keys}


def phases(plan: Mapping, experts: int) -> list[tuple[str, dict]]:
    """The residency points after the startup one, in order, each only where the plan's budget
    holds it: `slices` (first slice of every layer; plans with a core, as the field plan), 25 / 50 /
    100 % (the first ids of every layer), `budget` (the budget filled with slices, when 100 % does
    not fit), then `again` (back to the startup set: swaps in both directions)."""
    per_expert = plan["budget"]["per_expert_bytes"]
    limit = plan["budget"]["swappable_expert_budget_bytes"] // per_expert
    keys = list(plan["perLayer"])
    core = resident_count(plan, {})
    out: list[tuple[str, dict]] = []
    if core:
        first = {
            k: [layer["sliceCatalog"][0]["sliceId"]]
            for k, layer in plan["perLayer"].items()
            if layer.get("sliceCatalog")
        }
        if first and resident_count(plan, first) <= limit:
            out.append(("slices", first))
    for pct in (25, 50, 100):
        active = first_experts(keys, experts * pct // 100)
        n = resident_count(plan, active)
        if core < n <= limit and offered(plan, active):
            out.append((str(pct), active))
    if not any(label == "100" for label, _ in out):
        fill = budget_fill(plan)
        if fill and resident_count(plan, fill) > core:
            out.append(("budget", fill))
    out.append(("again", {}))
    return out


def startup_label(plan: Mapping) -> str:
    return "core" if resident_count(plan, {}) else "0"


def _med(d: Mapping | None) -> float | None:
    return (d or {}).get("median")


def hit_rate(phase: Mapping) -> float | None:
    miss = (((phase.get("router_misses") or {}).get("totals")) or {}).get("miss_ratio")
    return None if miss is None else 1 - miss


def bound_rows(reap_phases: Mapping[str, Mapping], stock: Mapping | None) -> dict:
    """Decode tok/s of every phase against t_resident + (1 - h) * t_all_missed (1 stream).

    A phase whose swap failed (status other than 200) is left out: its experts are the previous phase's,
    so its time is not the phase's. Run 17's pool bug failed every swap and, before this, the 0 % time
    was taken as t_resident "from reap 100 %" and every ratio read 1.000."""
    failed = {k for k, p in reap_phases.items() if (p.get("swap") or {}).get("status", 200) != 200}
    rates = {k: None if k in failed else _med(p.get("decode_1")) for k, p in reap_phases.items()}
    hs = {k: hit_rate(p) for k, p in reap_phases.items()}
    t_res_src = "reap 100 %" if rates.get("100") else "stock"
    r100 = rates.get("100") or _med((stock or {}).get("decode_1"))
    t_res = 1000 / r100 if r100 else None
    fit, t_miss = None, None
    if rates.get("0") and t_res is not None:
        t_miss = 1000 / rates["0"] - t_res
    elif t_res is not None:
        candidates = [k for k in rates if rates[k] and hs.get(k) is not None and hs[k] < 1]
        if candidates:
            fit = min(candidates, key=lambda k: hs[k])
            t_miss = (1000 / rates[fit] - t_res) / (1 - hs[fit])
    rows = {}
    for k, rate in rates.items():
        h = hs.get(k)
        bound = 1000 / (t_res + (1 - h) * t_miss) if None not in (h, t_res, t_miss) else None
        rows[k] = {
            "h": h, "tok_s": rate, "bound": bound,
            "ratio": rate / bound if rate and bound else None, "fit": k == fit,
        }  # fmt: skip
        if k in failed:
            rows[k]["swap_failed"] = True
    return {"t_resident_ms": t_res, "t_resident_from": t_res_src, "t_all_missed_ms": t_miss, "rows": rows}


def _probe_cmp(a: Mapping | None, b: Mapping | None) -> dict | None:
    """Rank 0 of two gpu_e2e.moe_probe() answers, or None where either has no digests."""
    try:
        ra, rb = a["ranks"][0], b["ranks"][0]
        if ra.get("error") or rb.get("error"):
            return None
        return compare_probes(ra, rb)
    except (TypeError, KeyError, IndexError):
        return None


def summarize(name: str, meta: Mapping, reap: Mapping | None, stock: Mapping | None, compare) -> dict:
    """family.json: everything the table needs, derived only. `compare` is serving.compare."""
    reap, stock = reap or {}, stock or {}
    ph = reap.get("phases") or {}
    first = next(iter(ph.values()), {})
    out_phases = {}
    for label, p in ph.items():
        entry = {
            "resident": p.get("resident"),
            "swap_bytes": (p.get("swap") or {}).get("bytes_copied"),
            "swap_gbps": (p.get("swap") or {}).get("gbps_workers"),
            "swap_status": (p.get("swap") or {}).get("status"),
            "h": hit_rate(p),
            "decode_1": _med(p.get("decode_1")),
            "greedy_vs_stock": compare(stock["greedy"], p["greedy"])
            if stock.get("greedy") and p.get("greedy")
            else None,
            "probe_vs_stock": _probe_cmp(stock.get("moe_probe"), p.get("moe_probe")),
            "probe_vs_startup": _probe_cmp(first.get("moe_probe"), p.get("moe_probe")),
        }
        out_phases[label] = entry
    status = reap.get("status_start") or {}
    cache = device_cache(reap.get("status_end") or status)
    return {
        "family": name,
        "shape": meta.get("shape"),
        "engine": meta.get("engine"),
        "errors": {arm: d.get("error") for arm, d in (("reap", reap), ("stock", stock)) if d.get("error")},
        "startup_s": {"reap": reap.get("startup_s"), "stock": stock.get("startup_s")},
        "host": {"reap": reap.get("host"), "stock": stock.get("host")},
        "counters": reap.get("counters"),
        "readme_curl": reap.get("readme_curl"),
        "uncounted_layers": _uncounted(status),
        "refused_layers": _refused(reap.get("worker_status")),
        "phases": out_phases,
        "stock_decode_1": _med(stock.get("decode_1")),
        "cache": cache,
        "bound": None
        if not ph
        else {"skipped": CACHE_BOUND_SKIPPED, "rows": {}}
        if cache and cache["engaged"]
        else bound_rows(ph, stock),
    }


# /router_misses counts selections outside the pinned set; with the device cache engaged many of those hit its
# tail, so h understates the hit rate and t_all_missed fitted on it means nothing (run 27, Qwen3.5 + cache).
CACHE_BOUND_SKIPPED = "device cache engaged: h counts the pinned set only, not the cache's hits"


def device_cache(status: Mapping) -> dict | None:
    """The device cache's totals from /reap/status (None without a cache): its hit ratio per routed selection."""
    c = status.get("cache")
    if not c:
        return None
    t = c.get("totals") or {}
    return {
        "engaged": bool(c.get("engaged")), "reason": c.get("reason"), "policy": c.get("policy"),
        "layers": len(c.get("layers") or {}), "totals": t, "hit_ratio": cache_hit_ratio(t),
    }  # fmt: skip


def _uncounted(status: Mapping) -> dict:
    """/reap/status workers[].uncounted_layers (plan layer -> why no counters), all ranks."""
    out: dict = {}
    for w in status.get("workers") or []:
        out.update(w.get("uncounted_layers") or {})
    return out


def _refused(worker_status: Mapping | None) -> dict:
    """The CUDA engine's per-layer refusals (layer -> why), from the reap_status worker RPC
    (StatusReply.backend.refused_layers; /reap/status does not carry the backend block)."""
    out: dict = {}
    for w in (((worker_status or {}).get("result") or {}).get("results")) or []:
        out.update(((w or {}).get("backend") or {}).get("refused_layers") or {})
    return out


def _fmt(x, d=1) -> str:
    return "n/a" if x is None else f"{x:.{d}f}"


def _cmp_cell(c: Mapping | None) -> str:
    if not c:
        return "–"
    if "identical" in c:
        return f"{c['identical']}/{c['of']}"
    return f"{c['equal']}/{c['of']}" if c.get("comparable") else "not comparable"


def markdown(families: Sequence[Mapping]) -> list[str]:
    """One table of every family's phases, then one line per family (startup, host, counters)."""
    lines = [
        "| family | phase | resident | swap GiB | GB/s | h | 1-stream tok/s | bound | ratio | greedy vs stock "
        "| probe vs stock | probe vs startup |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for f in families:
        rows = ((f.get("bound") or {}).get("rows")) or {}
        for label, p in (f.get("phases") or {}).items():
            b = rows.get(label, {})
            swap = p.get("swap_bytes")
            lines.append(
                f"| {f['family']} | {label} | {'–' if p.get('resident') is None else p['resident']} | "
                f"{_fmt(swap / GIB, 2) if swap else '–'} | {_fmt(p.get('swap_gbps'))} | {_fmt(p.get('h'), 3)} | "
                f"{_fmt(p.get('decode_1'))} | {_fmt(b.get('bound'))} | "
                f"{_fmt(b.get('ratio'), 3)}{' (fit)' if b.get('fit') else ''} | {_cmp_cell(p.get('greedy_vs_stock'))} | "
                f"{_cmp_cell(p.get('probe_vs_stock'))} | {_cmp_cell(p.get('probe_vs_startup'))} |"
            )
        notes.append(family_note(f))
    return lines + [""] + notes


def family_note(f: Mapping) -> str:
    s, h, c = f.get("startup_s") or {}, f.get("host") or {}, f.get("counters") or {}
    rh, sh = h.get("reap") or {}, h.get("stock") or {}
    curl = f.get("readme_curl") or {}
    b = f.get("bound") or {}
    parts = [
        f"- **{f['family']}**: startup reap {_fmt(s.get('reap'), 0)} s / stock {_fmt(s.get('stock'), 0)} s",
        f"RSS peak reap {_fmt(rh.get('rss_peak_gib'))} / stock {_fmt(sh.get('rss_peak_gib'))} GiB",
        f"HBM reap {_fmt(rh.get('hbm_peak_gib'))} / stock {_fmt(sh.get('hbm_peak_gib'))} GiB",
        f"counters {c.get('observed')} of {c.get('expected')} ({'equal' if c.get('equal') else 'NOT equal'})"
        if c
        else "counters n/a",
        f"README curl swap {curl.get('bytes_copied')} B, misses counted {curl.get('observed_selections')}"
        if curl
        else "README curl n/a",
        f"stock tok/s {_fmt(f.get('stock_decode_1'))}; t_resident {_fmt(b.get('t_resident_ms'), 3)} ms "
        f"({b.get('t_resident_from')}), t_all_missed {_fmt(b.get('t_all_missed_ms'), 3)} ms",
    ]
    if dc := f.get("cache"):
        parts.append(
            f"device cache {'engaged' if dc['engaged'] else 'NOT engaged (' + str(dc['reason']) + ')'} on "
            f"{dc['layers']} layers, {dc['policy']}: {_fmt(dc['hit_ratio'], 3)} of selections hit (pinned + tail); "
            f"{(f.get('bound') or {}).get('skipped') or 'bound as usual'}"
        )
    if f.get("uncounted_layers"):
        parts.append(f"uncounted: {str(f['uncounted_layers'])[:200]}")
    if f.get("refused_layers"):
        why = next(iter(f["refused_layers"].values()))
        parts.append(f"refused layers: {len(f['refused_layers'])} ({str(why)[:160]})")
    if f.get("errors"):
        parts.append(f"errors: {str(f['errors'])[:300]}")
    return "; ".join(parts)
