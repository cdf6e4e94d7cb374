#!/usr/bin/env python3
"""Issue 17's target table from the skew bench's per-arm reports (pure: json in, json + markdown out).

  python research/gpu/skew_bench_summary.py DIR     # reads DIR/b-*/bench.json (+ DIR/trace/trace.json)
                                               # writes DIR/skew_bench.json and DIR/skew_bench.md

One bench.json per arm (research/gpu/gpu_skew_bench.py runs one `reap-swap bench` per server). Per arm:
the budget as a share of the expert bytes, h (plan-cache: the server's device-cache hit rate over
the whole arm, `cache_hit_rate`; the other reap arms: router hits against the resident set from
/router_misses; stock arms: derived), decode tok/s at 1 stream and at the batch (medians), greedy
text vs the `resident` arm (stock vLLM, every expert in HBM: one request at a time, prefix
caching off), and the bound t_token = t_resident + (1 - h) * t_all_missed (research.md runs 3-8)
with t_resident from `resident` and t_all_missed fitted on this run's plan-static arm
((t_static - t_resident) / (1 - h_static)), else on stock UVA, else run 3's measured constants.
Targets (issue 17): plan-cache >= 1.25x plan-swap at 1 stream (50 % and 25 %), >= plan-swap at
the batch, >= 0.9 of the bound, text identical to stock; reach: plan-cache >= 0.75 of resident at 50 %.

Stock's own spread (guardfix, run 12: stock UVA at 50 % differed from `resident` in the prefill's
first logprob on all 8 prompts, as plan-cache at 25 % did): the driver's `resident2` job serves a
second stock resident process (folder b-N-resident2, arm `resident-2` here). Every arm's greedy text
is then classified per prompt: equal to resident / equal to resident-2 / differs from both, with the
bitwise-logprob count and the largest |first-logprob difference| (the prefill) against each.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

# run 3 (research.md "Mechanism cost"): t(100 %) and t(0 %) - t(100 %) of one reap server, ms per token
RUN3_T_MISS_MS = {"decode_tok_s_1": 16.999, "decode_tok_s_batch": 1000 / 74.1 - 1000 / 2469}
METRICS = ("decode_tok_s_1", "decode_tok_s_batch")


def _median(stats: Mapping, key: str) -> float | None:
    s = (stats or {}).get(key) or {}
    return s.get("median")


def _hit(run: Mapping) -> tuple[float | None, str]:
    hr = run.get("hit_rate") or {}
    if hr.get("cache_hit_rate") is not None:
        return hr["cache_hit_rate"], "device cache (hits / (hits + misses), whole arm)"
    if run.get("reap"):
        return hr.get("hit_rate"), "router hits vs the resident set (/router_misses)"
    return hr.get("hit_rate"), "derived (resident share of expert bytes)"


def rows_of(reports: Sequence[Mapping]) -> list[dict]:
    """One row per arm that ran (status ok or failed), in report order."""
    rows = []
    for rep in reports:
        total = (rep.get("model") or {}).get("total_expert_bytes") or 0
        plan_budget = (rep.get("plan") or {}).get("budget_bytes")
        for run in rep.get("runs") or []:
            arm = _arm_name(rep, run)
            budget = run.get("budget_bytes") or (plan_budget if run.get("arm") == "plan-static" else None)
            pct = round(100 * budget / total, 1) if budget and total else None
            h, h_src = _hit(run)
            stats = run.get("stats") or {}
            cache = ((run.get("reap_status") or {}).get("cache")) or {}
            rows.append(
                {
                    "arm": arm,
                    "pct": pct if arm not in STOCK_RESIDENT else 100.0,
                    "status": run.get("status"),
                    "error": run.get("error") or run.get("reason"),
                    "plan": (rep.get("plan") or {}).get("identity"),
                    "h": h,
                    "h_source": h_src,
                    "decode_tok_s_1": _median(stats, "decode_tok_s_1"),
                    "decode_tok_s_batch": _median(stats, "decode_tok_s_batch"),
                    "decode_1_range": [(stats.get("decode_tok_s_1") or {}).get(k) for k in ("min", "max")],
                    "batch": (rep.get("config") or {}).get("batch"),
                    "swap_count": stats.get("swap_count"),
                    "bytes_copied_total": stats.get("bytes_copied_total"),
                    "cache_engaged": cache.get("engaged"),
                    "cache_totals": (run.get("hit_rate") or {}).get("cache_totals"),
                    "greedy": run.get("greedy"),
                }
            )
    return rows


STOCK_RESIDENT = ("resident", "resident-2")


def _arm_name(rep: Mapping, run: Mapping) -> str | None:
    """The bench's arm, except the driver's second stock resident (folder b-N-resident2)."""
    arm = run.get("arm")
    return "resident-2" if arm == "resident" and str(rep.get("_job", "")).endswith("resident2") else arm


def _find(rows: Sequence[Mapping], arm: str, pct: float | None = None) -> Mapping | None:
    for r in rows:
        if r["arm"] == arm and r["status"] == "ok" and (pct is None or r["pct"] == pct):
            return r
    return None


def compare_text(ref: Sequence[Mapping] | None, got: Sequence[Mapping] | None) -> dict | None:
    """Greedy token ids per prompt (the bench's records): identical count and first divergences."""
    if not ref or not got:
        return None
    same, first, bitwise, d0 = [], [], 0, []
    for a, b in zip(ref, got):
        ta, tb = a.get("tokens") or list(a.get("text") or ""), b.get("tokens") or list(b.get("text") or "")
        d = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        if d is None and len(ta) != len(tb):
            d = min(len(ta), len(tb))
        same.append(d is None)
        first.append(d)
        la, lb = a.get("logprobs"), b.get("logprobs")
        if la and lb:
            bitwise += la == lb
            d0.append(abs(float(la[0]) - float(lb[0])))
    out = {"identical": sum(same), "of": len(same), "first_divergence": first, "same": same}
    if d0:  # the records carry logprobs (bench's greedy pass): bitwise and the prefill's first
        out.update(logprobs_bitwise=bitwise, first_logprob_max_abs_diff=max(d0))
    return out


def text_classes(res: Sequence[Mapping] | None, res2: Sequence[Mapping] | None, got) -> dict | None:
    """Per prompt: equal (tokens) to resident, to resident-2, or differs from both."""
    a, b = compare_text(res, got), compare_text(res2, got)
    if a is None and b is None:
        return None
    n = (a or b)["of"]
    sa, sb = (a or {}).get("same") or [False] * n, (b or {}).get("same") or [False] * n
    return {
        "vs_resident": a,
        "vs_resident_2": b,
        "equal_resident": sum(sa) if a else None,
        "equal_resident_2": sum(sb) if b else None,
        "differs_from_both": sum(not (x or y) for x, y in zip(sa, sb)),
        "of": n,
    }


def fit_t_miss(rows: Sequence[Mapping], metric: str, t_res: float | None) -> tuple[float | None, str]:
    """t_all_missed (ms per token) for one metric: plan-static, else stock-uva, else run 3."""
    if t_res is not None:
        for arm in ("plan-static", "stock-uva"):
            for r in rows:
                if r["arm"] == arm and r["status"] == "ok" and r.get(metric) and r["h"] is not None:
                    if r["h"] < 1.0:
                        t = 1000.0 / r[metric]
                        return (t - t_res) / (1.0 - r["h"]), f"fit on {arm}@{r['pct']}% (h {r['h']:.3f})"
    return RUN3_T_MISS_MS[metric], "run 3 constant (research.md, mechanism cost; another lease)"


def bounds(rows: list[dict]) -> dict:
    """Fill each ok row's bound and share of it per metric; returns the bound's inputs."""
    res = _find(rows, "resident")
    info = {}
    for metric in METRICS:
        t_res = 1000.0 / res[metric] if res and res.get(metric) else None
        t_miss, src = fit_t_miss(rows, metric, t_res)
        info[metric] = {"t_resident_ms": t_res, "t_all_missed_ms": t_miss, "t_all_missed_from": src}
        for r in rows:
            if r["status"] != "ok" or t_res is None or r["h"] is None:
                continue
            b = 1000.0 / (t_res + (1.0 - r["h"]) * t_miss)
            r[f"bound_{metric}"] = b
            r[f"of_bound_{metric}"] = r[metric] / b if r.get(metric) else None
    return info


def _ratio(a: Mapping | None, b: Mapping | None, metric: str) -> float | None:
    if not a or not b or not a.get(metric) or not b.get(metric):
        return None
    return a[metric] / b[metric]


def targets(rows: Sequence[Mapping]) -> list[dict]:
    """Issue 17's serving targets, one row each: value, goal, met (None: not measured)."""
    out = []
    res = _find(rows, "resident")

    def add(name, value, goal, ok):
        out.append({"target": name, "value": value, "goal": goal, "met": None if value is None else ok})

    # the two budgets always appear (a missing arm reads "not measured"), plus any other
    pcts = {50.0, 25.0} | {r["pct"] for r in rows if r["arm"] == "plan-cache" and r["pct"]}
    for pct in sorted(pcts, reverse=True):
        cache, swap = _find(rows, "plan-cache", pct), _find(rows, "plan-swap", pct)
        v = _ratio(cache, swap, "decode_tok_s_1")
        add(f"plan-cache / plan-swap, 1 stream, {pct:g} %", v, ">= 1.25", v is not None and v >= 1.25)
        v = _ratio(cache, swap, "decode_tok_s_batch")
        add(f"plan-cache / plan-swap, batch, {pct:g} %", v, ">= 1.0", v is not None and v >= 1.0)
        v = (cache or {}).get("of_bound_decode_tok_s_1")
        add(f"plan-cache decode / bound, 1 stream, {pct:g} %", v, ">= 0.9", v is not None and v >= 0.9)
        t = compare_text(res and res["greedy"], cache and cache["greedy"])
        add(
            f"plan-cache greedy text = stock (resident), {pct:g} %",
            None if t is None else f"{t['identical']}/{t['of']}",
            "all identical",
            t is not None and t["identical"] == t["of"],
        )
        res2 = _find(rows, "resident-2")
        if res2 is not None:
            c = text_classes(res and res["greedy"], res2["greedy"], cache and cache["greedy"])
            add(
                f"plan-cache greedy text = resident or resident-2 (per prompt), {pct:g} %",
                None if c is None else f"{c['of'] - c['differs_from_both']}/{c['of']}",
                "none differs from both",
                c is not None and c["differs_from_both"] == 0,
            )
        if pct == 50.0:
            v = _ratio(cache, res, "decode_tok_s_1")
            add("reach: plan-cache / resident, 1 stream, 50 %", v, ">= 0.75", v is not None and v >= 0.75)
    res2 = _find(rows, "resident-2")
    if res is not None and res2 is not None:  # stock vs stock: the spread ours is judged against
        t = compare_text(res["greedy"], res2["greedy"])
        add(
            "stock's own spread: resident-2 greedy text = resident",
            None if t is None else f"{t['identical']}/{t['of']}",
            "(reference, no goal)",
            t is not None and t["identical"] == t["of"],
        )
    return out


def summarize(reports: Sequence[Mapping], trace_doc: Mapping | None = None) -> dict:
    rows = rows_of(reports)
    info = bounds(rows)
    res, res2 = _find(rows, "resident"), _find(rows, "resident-2")
    for r in rows:
        r["text_vs_stock"] = compare_text(res and res["greedy"], r.get("greedy")) if r is not res else None
        r["text"] = text_classes(
            res and r is not res and res["greedy"], res2 and r is not res2 and res2["greedy"], r.get("greedy")
        )
    doc = {
        "bound": info,
        "targets": targets(rows),
        "rows": [{k: v for k, v in r.items() if k != "greedy"} for r in rows],
    }
    if trace_doc:
        held = ((trace_doc.get("splits") or {}).get("heldout") or {}).get("per_request") or []
        doc["trace"] = {
            "splits": {
                k: {x: v.get(x) for x in ("trace", "requests", "steps", "tokens")}
                for k, v in (trace_doc.get("splits") or {}).items()
            },
            "error": trace_doc.get("error"),
            "trace_server_text_vs_resident": compare_text(res and res["greedy"], [p["greedy"] for p in held]),
        }
    return doc


def _f(x, d=1):
    return "n/a" if x is None else (f"{x:.{d}f}" if isinstance(x, float) else str(x))


def _text_cell(arm: str, t: Mapping | None) -> str:
    if arm == "resident":
        return "reference"
    return f"{t['identical']}/{t['of']}" if t else "n/a"


def _vs(c: Mapping | None) -> str:
    """`tokens equal/of (logprobs bitwise, max |d first logprob|)` of one comparison."""
    if not c:
        return "n/a"
    cell = f"{c['identical']}/{c['of']}"
    if "logprobs_bitwise" in c:
        cell += f" (bitwise {c['logprobs_bitwise']}, d0 {c['first_logprob_max_abs_diff']:.1e})"
    return cell


def text_table(rows: Sequence[Mapping]) -> list[str]:
    """Greedy text per arm against both stock resident processes (only when resident-2 ran)."""
    if not any(r["arm"] == "resident-2" for r in rows):
        return []
    out = [
        "",
        "Greedy text per prompt, tokens (logprobs bitwise, largest |first-logprob difference| = the prefill):",
        "",
        "| arm | % | = resident | = resident-2 | differs from both |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        c = r.get("text") or {}
        both = "--" if not c else f"{c['differs_from_both']}/{c['of']}"
        ref1 = "reference" if r["arm"] == "resident" else _vs(c.get("vs_resident"))
        ref2 = "reference" if r["arm"] == "resident-2" else _vs(c.get("vs_resident_2"))
        out.append(f"| {r['arm']} | {_f(r['pct'])} | {ref1} | {ref2} | {both} |")
    return out


def markdown(doc: Mapping) -> str:
    lines = ["| target | value | goal | met |", "|---|---|---|---|"]
    for t in doc["targets"]:
        met = "not measured" if t["met"] is None else ("yes" if t["met"] else "**no**")
        lines.append(f"| {t['target']} | {_f(t['value'], 3)} | {t['goal']} | {met} |")
    lines += [
        "",
        "| arm | % of expert bytes | h | 1 stream tok/s | bound | of bound | batch tok/s | bound "
        "| of bound | text = stock | swaps | cache |",
        "|---" * 12 + "|",
    ]
    for r in doc["rows"]:
        t = r.get("text_vs_stock")
        cache = r.get("cache_totals") or {}
        lines.append(
            f"| {r['arm']} | {_f(r['pct'])} | {_f(r['h'], 3)} | {_f(r['decode_tok_s_1'])} | "
            f"{_f(r.get('bound_decode_tok_s_1'))} | {_f(r.get('of_bound_decode_tok_s_1'), 2)} | "
            f"{_f(r['decode_tok_s_batch'])} | {_f(r.get('bound_decode_tok_s_batch'))} | "
            f"{_f(r.get('of_bound_decode_tok_s_batch'), 2)} | "
            f"{_text_cell(r['arm'], t)} | "
            f"{_f(r['swap_count'])} | {', '.join(f'{k} {v}' for k, v in cache.items()) or '-'}"
            + (f" | {r['status']}: {str(r['error'])[:80]}" if r["status"] != "ok" else " |")
        )
    lines += text_table(doc["rows"])
    b = doc["bound"]
    lines += [
        "",
        "Bound: "
        + "; ".join(
            f"{m}: t_resident {_f(v['t_resident_ms'], 3)} ms, t_all_missed {_f(v['t_all_missed_ms'], 3)} ms "
            f"({v['t_all_missed_from']})"
            for m, v in b.items()
        ),
    ]
    if doc.get("trace"):
        lines += ["", "Trace: " + json.dumps(doc["trace"])]
    for path, why in (doc.get("unreadable") or {}).items():
        lines += ["", f"Unreadable (left out): {path}: {why}"]
    return "\n".join(lines)


def _read(path: Path, unreadable: dict) -> dict | None:
    """One JSON file, or None with the reason in `unreadable` (a file cut by the phase's cap)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        unreadable[str(path)] = f"{type(exc).__name__}: {str(exc)[:200]}"
        return None


def _job_order(path: Path) -> tuple[int, str]:
    """b-<n>-<name>/bench.json in the driver's measuring order (b-10 after b-9)."""
    part = path.parent.name.split("-")
    return (int(part[1]) if len(part) > 1 and part[1].isdigit() else 1 << 30, path.parent.name)


def main(argv=None) -> int:
    d = Path((argv or sys.argv[1:])[0])
    unreadable: dict[str, str] = {}
    reports = []
    for p in sorted(d.glob("b-*/bench.json"), key=_job_order):
        r = _read(p, unreadable)
        if r is not None:
            reports.append({**r, "_job": p.parent.name})  # b-N-resident2 -> arm resident-2
    trace = d / "trace" / "trace.json"
    doc = summarize(reports, _read(trace, unreadable) if trace.is_file() else None)
    if unreadable:
        doc["unreadable"] = unreadable
    (d / "skew_bench.json").write_text(json.dumps(doc, indent=1))
    (d / "skew_bench.md").write_text(markdown(doc) + "\n")
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
