"""What a plain OpenAI client would lose if the device cache's default slot split kept room for
per-request swaps (research.md, Open items after run 29: "Should the device cache become the
default on CUDA?"). On every committed trace and budget (each with its plan), the plain client's
expert and selection hit rates under the three layouts the server can serve without a swap call:

- ``auto``: ``--reap-cache-slots auto``, the plan core pinned and the rest of the pool as the cache
  tail (``core+dlfu`` at the budget's core+tail slots; what plan-cache serves today);
- ``swaps``: ``--reap-cache-slots swaps``, the core pinned and a tail of n = min(2 x top_k,
  (pool - core) // layers // 2) per layer, the rest of the pool kept for swaps a plain client never
  makes (``core+dlfu`` at core + n slots; cache_tail.swap_cache_split via probe.servable_split);
- ``seeded``: ``--reap-cache-seed seeded``, the whole share as evictable slots seeded with the core
  (``dlfu-seeded`` at core+tail slots); a swap pins inside the slots, so no room is set aside,
  but a set wider than one layer's share is refused: the last column counts the requests whose
  reap-swap client set (``probe`` within the pool, no per-layer cut) would be.

    PYTHONPATH=$PWD .venv/bin/python research/sim/sim_default_split.py   # CPU, about 10 s

Writes research-notes/cache-sim/default-split.{md,json}. Counts only (misses are deterministic).
"""

from __future__ import annotations

import sys
from pathlib import Path

import orjson

from reap_swap.cache.mechanism import LayerSteps
from reap_swap.cache.online import LFU_DECAY
from reap_swap.cache.probe import _probe_sets, servable_split
from reap_swap.cache.replay import _run_policy, simulate
from reap_swap.plan.document import load_plan
from reap_swap.sizing.cache_tail import seeded_split

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_probecache import OUT, traces  # noqa: E402

LAYOUTS = ("static", "auto", "swaps", "seeded")
METRICS = {"expert hit %": "expert_hit_rate", "selection hit %": "selection_hit_rate"}


def plain_rows(trace, plan, budget: str) -> dict[str, dict]:
    """Layout -> the simulator row (``status`` refused with its reason where it cannot be served)."""
    got = {
        r["policy"]: r
        for r in simulate(trace, plan, [budget], ["static", "core+dlfu", "dlfu-seeded"])["rows"]
    }
    rows = {"static": got["static"], "auto": got["core+dlfu"], "seeded": got["dlfu-seeded"]}
    layout, why = servable_split(plan, trace, got["core+dlfu"]["budget_bytes"])
    if layout is None:
        rows["swaps"] = {"status": "refused", "reason": why}
        return rows
    starts = trace.request_first_steps()
    steps = {l: LayerSteps.from_counts(l, trace.step_counts(l), starts) for l in trace.layers}
    run = _run_policy("core+dlfu", trace, plan, steps, layout.slots, None, LFU_DECAY, None)
    rows["swaps"] = {"status": "ok", "split": layout.to_dict(), **run}
    return rows


def seeded_refusals(trace, plan, budget_bytes: int) -> dict:
    """How many of the trace's requests a reap-swap client (``probe`` within the whole pool, no
    per-layer cut: the client has none) would send a set the seeded form refuses: wider than some
    layer's share C_l (cache_tail.seeded_split, what the CUDA device lends)."""
    pool = budget_bytes // trace.per_expert_bytes
    core = {l: plan.layers[l].core for l in trace.layers}
    shares, why = seeded_split(pool, core, "auto")
    if why:
        return {"requests": trace.num_requests, "refused": None, "why": why}
    counts = {l: trace.step_counts(l) for l in trace.layers}
    sets = _probe_sets(plan, trace, counts, budget_bytes, dict.fromkeys(trace.layers, trace.num_experts))
    firsts = sorted(next(iter(sets.values())))
    wide = [t for t in firsts if any(len(sets[l][t]) > shares[l] for l in trace.layers)]
    return {"requests": len(firsts), "refused": len(wide), "shares": {str(l): c for l, c in shares.items()}}


def run() -> dict:
    reports = {}
    for name, (trace, _prior, plans) in traces().items():
        reports[name] = {}
        for b, p in plans.items():
            plan = load_plan(p)
            rows = plain_rows(trace, plan, b)
            rows["seeded_swaps"] = seeded_refusals(trace, plan, rows["auto"]["budget_bytes"])
            reports[name][b] = rows
        print(f"{name}: done", file=sys.stderr)
    return reports


def table(reports: dict) -> str:
    lines = [
        "| trace | budget | swaps split: tail n / layer, K | "
        + " | ".join(f"{x} ({m})" for m in ("expert", "selection") for x in LAYOUTS)
        + " | swaps − auto, expert pts | seeded: client swap sets refused |",
        "|---|---|---|" + "---|" * (2 * len(LAYOUTS) + 2),
    ]
    for name, budgets in reports.items():
        for b, rows in budgets.items():
            split = rows["swaps"].get("split")
            how = f"{split['tail_per_layer']}, {split['swap_slots']}" if split else "— (no split)"
            cells = []
            for metric in METRICS.values():
                for x in LAYOUTS:
                    r = rows[x]
                    cells.append(f"{100 * r['totals'][metric]:.1f}" if r["status"] == "ok" else "—")
            d = "—"
            if rows["swaps"]["status"] == "ok" and rows["auto"]["status"] == "ok":
                a, s = (rows[x]["totals"]["expert_hit_rate"] for x in ("auto", "swaps"))
                d = f"{100 * (s - a):+.1f}"
            sw = rows["seeded_swaps"]
            ref = "—" if sw["refused"] is None else f"{sw['refused']} / {sw['requests']}"
            lines.append(
                f"| {name} | {100 * float(b):g} % | {how} | " + " | ".join(cells) + f" | {d} | {ref} |"
            )
    return "\n".join(lines)


def main() -> int:
    reports = run()
    text = "\n".join(
        [
            "## A plain client's hit rates under the slot layouts the server can serve (%)",
            "",
            table(reports),
            "",
        ]
    )
    (OUT / "default-split.md").write_text(text)
    (OUT / "default-split.json").write_bytes(orjson.dumps(reports, option=orjson.OPT_INDENT_2))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
