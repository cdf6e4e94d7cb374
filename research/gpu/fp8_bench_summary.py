#!/usr/bin/env python3
"""research.md's FP8 bench table and plot from a merged `reap-swap bench` report (gpu_fp8_bench.sh).

What it adds to the bench's own bench.md: the budget as a share of the FP8 expert bytes, the HBM
each arm really gave the experts (stock UVA: the expert parameters it kept on the GPU; reap-swap:
its pool, slots x mapping unit, from /reap/status, plus the scales kept whole: an FP8 expert of
4.5 MiB takes a 6 MiB unit, so a reap-swap pool holds fewer experts than its nominal budget's bytes
would at the same HBM), and plan-swap / stock-uva decode ratios at the same budget.

usage: python research/gpu/fp8_bench_summary.py DIR/merged/bench.json [--out DIR]   -> fp8_bench.{md,png}
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path

GIB = 2**30


def _find(obj, key):
    """The first value of `key` anywhere in a nested dict/list (the status layout varies by version)."""
    if isinstance(obj, Mapping):
        if key in obj:
            return obj[key]
        obj = list(obj.values())
    if isinstance(obj, list):
        for v in obj:
            if (found := _find(v, key)) is not None:
                return found
    return None


def expert_hbm(run: Mapping, total: int) -> int | None:
    """Bytes of HBM the arm gave the experts (see module doc); None when unknown."""
    if run["arm"] == "resident":
        return total
    if run["arm"] == "stock-uva":
        off = (run.get("hit_rate") or {}).get("offloaded_bytes")
        return None if off is None else total - int(off)
    pool = _find(run.get("reap_status"), "pool_hbm_bytes")
    kept = _find(run.get("reap_status"), "kept_whole_hbm_bytes") or 0
    return None if pool is None else int(pool) + int(kept)


def _med(stats: Mapping, key: str) -> str:
    s = stats.get(key)
    if not s:
        return "n/a"
    if s.get("n", 1) > 1 and s["min"] != s["max"]:
        return f"{s['median']:.1f} ({s['min']:.1f}–{s['max']:.1f})"
    return f"{s['median']:.1f}"


def rows(report: Mapping) -> list[dict]:
    """One row per successful run, ordered resident, then by budget, stock before reap."""
    total = int(report["model"]["total_expert_bytes"])
    ref = (report.get("summary") or {}).get("reference")
    out = []
    for run in report["runs"]:
        if run.get("status") != "ok":
            out.append({"label": run["label"], "failed": run.get("reason", "")[:200]})
            continue
        st, b = run.get("stats") or {}, run.get("budget_bytes")
        hbm = expert_hbm(run, total)
        hit = (run.get("hit_rate") or {}).get("hit_rate")
        cmp = run.get("greedy_vs_ref") or {}
        out.append(
            {
                "label": run["label"],
                "arm": run["arm"],
                "budget_bytes": b,
                "budget": "all" if b is None else f"{b / GIB:.4g} GiB ({100 * b / total:.1f} %)",
                "hbm_bytes": hbm,
                "hbm": "n/a" if hbm is None else f"{hbm / GIB:.3f} GiB ({100 * hbm / total:.1f} %)",
                "hit": "n/a"
                if hit is None
                else f"{hit:.3f}" + (" (derived)" if run["arm"] != "plan-swap" else ""),
                "d1": _med(st, "decode_tok_s_1"),
                "d1_median": (st.get("decode_tok_s_1") or {}).get("median"),
                "db": _med(st, "decode_tok_s_batch"),
                "db_median": (st.get("decode_tok_s_batch") or {}).get("median"),
                "ttft": "n/a" if not st.get("ttft_s") else f"{1000 * st['ttft_s']['median']:.0f}",
                "greedy": "reference" if run["label"] == ref else f"{cmp.get('identical')}/{cmp.get('of')}",
                "swaps": f"{st.get('swap_count', 0)} / {(st.get('bytes_copied_total') or 0) / GIB:.2f} GiB",
                "wait": (run.get("server") or {}).get("measure_lock_wait_s"),
            }
        )
    order = {"resident": 0, "stock-uva": 1, "plan-swap": 2}
    return sorted(out, key=lambda r: (r.get("budget_bytes") or 0, order.get(r.get("arm"), 3)))


def markdown(report: Mapping, table: list[dict]) -> str:
    batch = (report.get("config") or {}).get("batch", "N")
    total = int(report["model"]["total_expert_bytes"])
    head = (
        f"Experts in all (stored bytes): {total / GIB:.3f} GiB. Greedy compared with "
        f"`{(report.get('summary') or {}).get('reference')}`.\n\n"
        f"| arm | budget (of expert bytes) | expert HBM | hit rate | 1 stream tok/s | "
        f"{batch} streams tok/s | TTFT ms | greedy = ref | swaps / copied |\n|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in table:
        if "failed" in r:
            lines.append(f"| {r['label']} | FAILED: {r['failed']} |||||||| ")
            continue
        cells = [r[k] for k in ("label", "budget", "hbm", "hit", "d1", "db", "ttft", "greedy", "swaps")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines.append("")
    ok = [r for r in table if "failed" not in r]
    for b in sorted({r["budget_bytes"] for r in ok if r.get("budget_bytes")}):
        uva = next((r for r in ok if r["arm"] == "stock-uva" and r["budget_bytes"] == b), None)
        swap = next((r for r in ok if r["arm"] == "plan-swap" and r["budget_bytes"] == b), None)
        if uva and swap and uva["d1_median"] and uva["db_median"] and swap["d1_median"] and swap["db_median"]:
            lines.append(
                f"- {b / GIB:.4g} GiB: plan-swap / stock-uva decode = {swap['d1_median'] / uva['d1_median']:.2f}x "
                f"(1 stream), {swap['db_median'] / uva['db_median']:.2f}x ({batch} streams); expert HBM "
                f"{swap['hbm']} vs {uva['hbm']}"
            )
    waits = [r["wait"] for r in ok if r.get("wait") is not None]
    if waits:
        lines.append(
            "- servers started side by side, measured one at a time (--measure-lock; waits "
            f"{min(waits):.0f}–{max(waits):.0f} s): start-ups overlapped other arms' measurements (CPU load)"
        )
    return "\n".join(lines) + "\n"


def plot(table: list[dict], total: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "d1_median", "1 stream"), (axes[1], "db_median", "batch")):
        for arm, marker in (("stock-uva", "o-"), ("plan-swap", "s-")):
            pts = sorted(
                (r["budget_bytes"] / total, r[key])
                for r in table
                if r.get("arm") == arm and r.get(key) and r.get("budget_bytes")
            )
            if pts:
                ax.plot([100 * x for x, _ in pts], [y for _, y in pts], marker, label=arm)
        res = next((r for r in table if r.get("arm") == "resident" and r.get(key)), None)
        if res:
            ax.axhline(res[key], color="gray", ls="--", label="resident (all in HBM)")
        ax.set_xlabel("budget, % of expert bytes")
        ax.set_ylabel("decode tok/s")
        ax.set_title(f"FP8 skewed model, decode ({title})")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bench_json", type=Path)
    ap.add_argument("--out", type=Path, help="default: the report's folder")
    a = ap.parse_args(argv)
    report = json.loads(a.bench_json.read_text())
    out = a.out or a.bench_json.parent
    out.mkdir(parents=True, exist_ok=True)
    table = rows(report)
    (out / "fp8_bench.md").write_text(markdown(report, table))
    plot(table, int(report["model"]["total_expert_bytes"]), out / "fp8_bench.png")
    print((out / "fp8_bench.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
