"""All three in simulation (README's ``plan-swap+cache``, research.md "probecache"): ``probe+dlfu``
and ``probe+lfu`` next to probe, the plain-client caches, dlearn-seeded and Belady, at 12.5 / 25 /
50 % (each budget with its plan), on every committed trace: the mini MoE's held-out, held-out
shuffled and calibration traces, and the skewed kit model's 3-layer held-out, shuffled and
calibration traces. dlearn-seeded's weights always come from the other split's trace.
References (not registered): ``probe(0.25)+dlfu`` / ``probe(0.5)+dlfu``, the client's probe budget
cut to the core plus a quarter / half of the tail (``smaller_probe``). ``probe+core+dlfu`` (the
device's pinned form with the probe's swaps, research.md "accdev") pins each set beside the layer's
N = slots - core tail, so it holds |set| + N slots per layer, more than the budget (``NOTE``).
``probe+core+dlfu-split`` is its servable form, the bench's ``plan-swap+cache`` arm (research.md
"probesplit"): the tail cache_tail.swap_cache_split gives per layer (``--reap-cache-slots L x n``),
the client's sets selected within the swap table K = pool - L x n; the first table is its prediction.

    PYTHONPATH=$PWD .venv/bin/python research/sim/sim_probecache.py     # CPU, a few minutes

Writes research-notes/cache-sim/probecache.{md,json} (every count per policy, budget and layer).
"""

from __future__ import annotations

import sys
from pathlib import Path

import orjson

from reap_swap.cache.hybrid import SPLIT, SwapPinned, swap_points
from reap_swap.cache.mechanism import LayerCounts, LayerSteps, replay_layer
from reap_swap.cache.probe import _probe_sets, servable_split, split_probe_sets
from reap_swap.cache.replay import _policy, simulate
from reap_swap.cache.trace import load_trace
from reap_swap.plan.document import load_plan

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_mini_report import PLANS, ROOT, shuffled  # noqa: E402

OUT = ROOT / "research-notes/cache-sim"
SKEW = OUT / "skew"
SKEW_PLANS = {b: SKEW / f"plan-{b}.json" for b in ("0.125", "0.25", "0.5")}
POLICIES = [
    "static",
    "probe",
    "lfu-seeded",
    "dlfu-seeded",
    "core+dlfu",
    "dlearn-seeded",
    "probe+lfu",
    "probe+dlfu",
    "probe+core+dlfu",
    SPLIT,
    "belady",
]
SHARES = (0.25, 0.5)  # references: the probe's share of the tail (smaller_probe)
REFERENCES = [f"probe({x:g})+dlfu" for x in SHARES]
NOTE = (
    "probe+core+dlfu is not a servable configuration at these budgets: the device's pinned form keeps "
    "its N = slots - core tail per layer and pins each swap's set beside it (|set| + N slots), so it "
    "holds more than the budget's slots (next table); the CUDA device's swap table at that N is "
    "the core alone (K = pool - layers x N), and it refuses every swap that adds an expert "
    '(research.md "acctail"). probe+core+dlfu-split is the servable form the bench\'s plan-swap+cache '
    "arm runs: n = min(2 x top_k, (pool - core) // layers // 2) tail slots per layer, the client "
    "selecting within K = pool - layers x n; where n < 1 the bench skips the arm (— here)."
)
PREDICTION = ["core+dlfu", "probe", "probe+core+dlfu", SPLIT]  # plan-cache, plan-swap, unservable, servable
METRICS = {
    "expert hit %": "expert_hit_rate",
    "selection hit %": "selection_hit_rate",
    "decode expert hit %": "decode_expert_hit_rate",
}


def traces() -> dict[str, tuple]:
    cal, held = (
        load_trace(ROOT / "data/traces/mini-moe-calibration.npz"),
        load_trace(ROOT / "data/traces/mini-moe-heldout.npz"),
    )
    scal, sheld = load_trace(SKEW / "skew-calibration.npz"), load_trace(SKEW / "skew-heldout.npz")
    return {
        "mini held-out": (held, cal, PLANS),
        "mini held-out shuffled": (shuffled(held), cal, PLANS),
        "mini calibration*": (cal, held, PLANS),
        "skew held-out": (sheld, scal, SKEW_PLANS),
        "skew held-out shuffled": (shuffled(sheld), scal, SKEW_PLANS),
        "skew calibration*": (scal, sheld, SKEW_PLANS),
    }


def smaller_probe(trace, plan, row: dict, share: float) -> dict:
    """Reference (not registered): ``probe+dlfu`` with the client's probe budget cut to the core
    plus ``share`` of the tail, so the cache keeps the rest of the slots (share 0: no swap ever
    changes the set, i.e. ``dlfu-seeded``; share 1: ``probe+dlfu``)."""
    slots = {int(k): v for k, v in row["slots"].items()}
    core = {l: plan.layers[l].core for l in trace.layers}
    n_core = sum(len(c) for c in core.values())
    budget = (n_core + int(share * (sum(slots.values()) - n_core))) * trace.per_expert_bytes
    counts = {l: trace.step_counts(l) for l in trace.layers}
    sets = _probe_sets(plan, trace, counts, budget, slots)
    points = swap_points(sets, core)
    starts = trace.request_first_steps()
    per_layer, total = {}, LayerCounts()
    for l in trace.layers:
        tail = _policy("dlfu-seeded", l, plan, None, 0.8)
        policy = SwapPinned("probe+dlfu", tail, {t: sets[l][t] for t in points})
        c = replay_layer(policy, LayerSteps.from_counts(l, counts[l], starts), slots[l])
        per_layer[str(l)] = c.to_dict(trace.per_expert_bytes)
        total.add(c)
    name = f"probe({share:g})+dlfu"
    return {**row, "policy": name, "totals": total.to_dict(trace.per_expert_bytes), "layers": per_layer}


def held_slots(trace, plan, row: dict) -> dict:
    """``probe+core+dlfu``'s (or the split's) slots per request (every layer's min(E, |set| + N),
    N = slots - core) against the budget's slots, and the requests whose swap adds experts to the
    core (for probe+core+dlfu all refused by the CUDA device at that N: its swap table keeps the
    core alone; for the split within its K)."""
    slots = {int(k): v for k, v in row["slots"].items()}
    core = {l: plan.layers[l].core for l in trace.layers}
    counts = {l: trace.step_counts(l) for l in trace.layers}
    if row["policy"] == SPLIT:
        layout = servable_split(plan, trace, row["budget_bytes"])[0]
        sets, budget_slots = split_probe_sets(plan, trace, counts, layout), layout.pool
    else:
        sets = _probe_sets(plan, trace, counts, row["budget_bytes"], slots)
        budget_slots = sum(slots.values())
    e, n_core = trace.num_experts, sum(len(c) for c in core.values())
    held, beyond = [], 0
    for t in sorted(next(iter(sets.values()))):
        held.append(sum(min(e, len(sets[l][t]) + slots[l] - len(core[l])) for l in trace.layers))
        beyond += sum(len(sets[l][t]) for l in trace.layers) > n_core
    return {
        "policy": row["policy"],
        "budget_slots": budget_slots,
        "core": n_core,
        "mean_held": sum(held) / len(held),
        "max_held": max(held),
        "requests": len(held),
        "swaps_beyond_core": beyond,
    }


def run() -> dict:
    reports = {}
    for name, (trace, prior, plans) in traces().items():
        rows = []
        for budget, path in plans.items():
            plan = load_plan(path)
            got = simulate(trace, plan, [budget], POLICIES, prior_trace=prior)["rows"]
            ref = next(r for r in got if r["policy"] == "probe+dlfu")
            rows += got + [smaller_probe(trace, plan, ref, share) for share in SHARES]
            for device in ("probe+core+dlfu", SPLIT):
                dev = next(r for r in got if r["policy"] == device)
                if dev["status"] == "ok":
                    dev["held_slots"] = held_slots(trace, plan, dev)
        reports[name] = {
            "rows": rows,
            "plans": {b: str(p.relative_to(ROOT)) for b, p in plans.items()},
            "requests": trace.num_requests,
            "steps": trace.num_steps,
            "per_expert_bytes": trace.per_expert_bytes,
        }
        print(f"{name}: done", file=sys.stderr)
    return reports


def table(reports: dict, metric: str) -> str:
    heads = [f"{n} {100 * float(b):g} %" for n, r in reports.items() for b in r["plans"]]
    lines = ["| policy | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    for p in POLICIES + REFERENCES:
        cells = []
        for r in reports.values():
            for b in r["plans"]:
                row = next(x for x in r["rows"] if x["policy"] == p and x["budget"] == b)
                v = row["totals"][metric] if row["status"] == "ok" else None
                cells.append("—" if v is None else f"{100 * v:.1f}")
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _hits(row: dict) -> str:
    """A table cell: expert hit % / selection hit %, or a dash for a refused row."""
    if row["status"] != "ok":
        return "—"
    t = row["totals"]
    return f"{100 * t['expert_hit_rate']:.1f} / {100 * t['selection_hit_rate']:.1f}"


def summary(reports: dict) -> str:
    """One row per trace and budget, one column per policy: expert hit % / selection hit %."""
    shown = POLICIES + REFERENCES
    lines = [
        "| trace | budget | slots/layer | " + " | ".join(shown) + " |",
        "|---|---|---|" + "---|" * len(shown),
    ]
    for n, r in reports.items():
        for b in r["plans"]:
            rows = {x["policy"]: x for x in r["rows"] if x["budget"] == b}
            slots = "/".join(str(v) for v in rows["belady"]["slots"].values())
            cells = [_hits(rows[p]) for p in shown]
            lines.append(f"| {n} | {100 * float(b):g} % | {slots} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def prediction(reports: dict) -> str:
    """The bench's plan-swap+cache (the split) beside plan-cache, plan-swap and the unservable
    probe+core+dlfu: expert hit % / selection hit %, and the split's tail n and swap table K."""
    lines = [
        "| trace | budget | pool | split n / layer | K | " + " | ".join(PREDICTION) + " |",
        "|---|---|---|---|---|" + "---|" * len(PREDICTION),
    ]
    for n, r in reports.items():
        for b in r["plans"]:
            rows = {x["policy"]: x for x in r["rows"] if x["budget"] == b}
            split = rows[SPLIT].get("split")
            pool = rows[SPLIT]["budget_bytes"] // r["per_expert_bytes"]
            head = f"{split['tail_per_layer']} | {split['swap_slots']}" if split else "— (skipped) | —"
            cells = [_hits(rows[p]) for p in PREDICTION]
            lines.append(f"| {n} | {100 * float(b):g} % | {pool} | {head} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def held(reports: dict) -> str:
    lines = [
        "| trace | budget | policy | budget slots | core | holds (mean / max) | × budget | swaps adding experts (CUDA: refused / the split: within K) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, r in reports.items():
        for row in r["rows"]:
            h = row.get("held_slots")
            if h:
                lines.append(
                    f"| {n} | {row['budget']} | {h['policy']} | {h['budget_slots']} | {h['core']} | "
                    f"{h['mean_held']:.1f} / "
                    f"{h['max_held']} | {h['mean_held'] / h['budget_slots']:.2f} | "
                    f"{h['swaps_beyond_core']} / {h['requests']} |"
                )
    return "\n".join(lines)


def moved(reports: dict) -> str:
    lines = [
        "| trace | budget | policy | MiB moved | prefetched | admitted | bypassed |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, r in reports.items():
        for row in r["rows"]:
            if row["status"] == "ok" and row["policy"] in (
                "probe",
                "dlfu-seeded",
                "probe+dlfu",
                "probe+core+dlfu",
                SPLIT,
                *REFERENCES,
            ):
                t = row["totals"]
                lines.append(
                    f"| {n} | {row['budget']} | {row['policy']} | {t['bytes_moved'] / 2**20:.1f} | "
                    f"{t['prefetched']:,} | {t['admitted']:,} | {t['bypassed']:,} |"
                )
    return "\n".join(lines)


def main() -> int:
    reports = run()
    lines = [
        "## plan-swap+cache (the servable split) beside plan-cache, plan-swap and probe+core+dlfu:"
        " expert hit % / selection hit %",
        "",
        prediction(reports),
        "",
        "## expert hit % / selection hit %",
        "",
        summary(reports),
        "",
        NOTE,
        "",
    ]
    lines += ["## probe+core+dlfu and the split: slots held against the budget", "", held(reports), ""]
    for title, metric in METRICS.items():
        lines += [
            f"## {title} (* calibration: dlearn's weights from held-out)",
            "",
            table(reports, metric),
            "",
        ]
    lines += ["## bytes moved (prefetched: swaps; admitted: cache promotions)", "", moved(reports), ""]
    (OUT / "probecache.md").write_text("\n".join(lines))
    (OUT / "probecache.json").write_bytes(
        orjson.dumps(
            {"policies": POLICIES, "references": REFERENCES, "reports": reports}, option=orjson.OPT_INDENT_2
        )
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
