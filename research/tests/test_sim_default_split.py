"""research/sim/sim_default_split.py: a plain client's hits under the slot layouts the server can serve
(auto, swaps, seeded), on the committed mini MoE trace with its plans."""

from pathlib import Path

from harness_modules import load_script

from reap_swap.cache.trace import load_trace
from reap_swap.plan.document import load_plan

ROOT = Path(__file__).resolve().parents[2]


def test_the_swaps_split_costs_a_plain_client_hits_and_the_seeded_form_does_not():
    m = load_script("sim_default_split")
    trace = load_trace(ROOT / "data/traces/mini-moe-heldout.npz")
    plan = load_plan(ROOT / "plans/reap-mini-moe.plan.json")
    rows = m.plain_rows(trace, plan, "0.5")
    assert rows["swaps"]["split"]["tail_per_layer"] == 1 and rows["swaps"]["split"]["swap_slots"] == 28
    hits = {k: rows[k]["totals"]["expert_hit_rate"] for k in m.LAYOUTS}
    assert hits["static"] < hits["swaps"] < hits["auto"] < hits["seeded"], hits
    steps = rows["auto"]["totals"]["steps"]
    assert all(rows[k]["totals"]["steps"] == steps for k in m.LAYOUTS)  # the same replay for each
    sw = m.seeded_refusals(trace, plan, rows["auto"]["budget_bytes"])  # the client has no per-layer cut
    assert sw["requests"] == trace.num_requests and 0 < sw["refused"] <= sw["requests"]
    assert sum(sw["shares"].values()) == rows["auto"]["budget_bytes"] // trace.per_expert_bytes
    rows["seeded_swaps"] = sw
    small = m.plain_rows(trace, load_plan(ROOT / "research-notes/cache-sim/plan-0.25.json"), "0.25")
    assert small["swaps"]["status"] == "refused" and "skips" in small["swaps"]["reason"]
    assert "| mini | 50 % | 1, 28 |" in m.table({"mini": {"0.5": rows}})
    assert m.table({"mini": {"0.5": rows}}).rstrip().endswith(f"| {sw['refused']} / {sw['requests']} |")
