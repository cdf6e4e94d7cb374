"""The simulator measurement of research.md (issue 17): every policy at 12.5 / 25 / 50 % of expert
bytes on the mini MoE's held-out trace, each budget with the plan built for it, plus the same
requests in a shuffled order (a second trace); the default-policy rule; tables and the plot.

    PYTHONPATH=$PWD .venv/bin/python research/sim/sim_mini_report.py     # ~1 min; after record_mini_trace.py

Writes research-notes/cache-sim/{matched.json,matched.md,policies.png}.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import orjson

from reap_swap.cache import report as rep
from reap_swap.cache.replay import simulate
from reap_swap.cache.trace import Trace, from_requests, load_trace
from reap_swap.plan.document import load_plan

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "research-notes/cache-sim"
TRACE = ROOT / "data/traces/mini-moe-heldout.npz"
TUNE_TRACE = ROOT / "data/traces/mini-moe-calibration.npz"  # LFU's decay is chosen here, not on held-out
DECAYS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
PLANS = {
    "0.125": OUT / "plan-0.125.json",
    "0.25": OUT / "plan-0.25.json",
    "0.5": ROOT / "plans/reap-mini-moe.plan.json",
}


def shuffled(trace: Trace, seed: int = 0) -> Trace:
    """The same requests in a random order (domains interleaved instead of one after another)."""
    order = np.random.default_rng(seed).permutation(trace.num_requests)
    requests = []
    for r in order:
        steps = range(trace.request_offsets[r], trace.request_offsets[r + 1])
        requests.append([trace.topk_ids[trace.step_offsets[s] : trace.step_offsets[s + 1]] for s in steps])
    return from_requests(
        requests,
        layers=trace.layers,
        model=trace.model,
        num_experts=trace.num_experts,
        top_k=trace.top_k,
        per_expert_bytes=trace.per_expert_bytes,
        request_tags=[trace.request_tags[r] for r in order],
        source={**trace.source, "shuffled_seed": seed},
    )


def matched(trace: Trace, lfu_decay: float, policies=None) -> dict:
    """Each budget simulated with the plan built for that budget; one report."""
    rows, plans = [], {}
    for budget, path in PLANS.items():
        plan = load_plan(path)
        plans[budget] = {"file": str(path.relative_to(ROOT)), "identity": plan.identity}
        kw = {"lfu_decay": lfu_decay} | ({"policies": policies} if policies else {})
        rows += simulate(trace, plan, [budget], **kw)["rows"]
    return {"rows": rows, "plans": plans, "lfu_decay": lfu_decay}


def tune_decay(trace: Trace) -> tuple[float, dict]:
    """LFU's decay with the best mean expert hit rate of lfu-seeded over the budgets."""
    scores = {}
    for d in DECAYS:
        rows = matched(trace, d, ["lfu-seeded"])["rows"]
        scores[d] = sum(r["totals"]["expert_hit_rate"] for r in rows) / len(rows)
    return max(scores, key=lambda d: (scores[d], d)), scores


def main() -> int:
    decay, scores = tune_decay(load_trace(TUNE_TRACE))
    print(f"LFU decay on the calibration trace: {decay} (mean lfu-seeded expert hit rate {scores})")
    traces = {"held-out, file order": load_trace(TRACE)}
    traces["held-out, shuffled"] = shuffled(traces["held-out, file order"])
    reports = {name: matched(t, decay) for name, t in traces.items()}
    budgets = list(PLANS)
    rules = {
        metric: rep.default_policy(list(reports.values()), ["0.25", "0.5"], budgets, metric=metric)
        for metric in ("expert_hit_rate", "decode_expert_hit_rate", "selection_hit_rate")
    }
    relaxed = rep.default_policy(list(reports.values()), [], budgets, points=100.0)
    lines = []
    for name, r in reports.items():
        lines += [f"### {name}", "", rep.markdown_table(r), "", rep.layer_table(r), ""]
    (OUT / "matched.md").write_text("\n".join(lines))
    (OUT / "matched.json").write_bytes(
        orjson.dumps(
            {"reports": reports, "rule": rules, "not_below_others_only": relaxed}, option=orjson.OPT_INDENT_2
        )
    )
    t = traces["held-out, file order"]
    rep.plot(
        reports["held-out, file order"],
        OUT / "policies.png",
        title=f"mini MoE held-out trace: {t.num_requests} requests, {t.num_steps:,} steps; each budget with its own plan",
    )
    print("\n".join(lines))
    for metric, rule in rules.items():
        print(metric, "passing:", rule["passing"])
        for cand, fails in rule["failures"].items():
            print(f"  {cand}: {'; '.join(fails[:4])}")
    print("not below any other policy (no Belady condition):", relaxed["passing"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
