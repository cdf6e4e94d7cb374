"""The H200 trace of run 12 against what the run-12 servers counted (research.md "h200sim").

    PYTHONPATH=$PWD .venv/bin/python research/sim/sim_h200_served.py      # CPU, ~1 min, no server

Three checks, all CPU, from committed files only:

1. **Router counters = trace** (exact). The bench's greedy pass (8 held-out prompts, one request at
   a time, 32 greedy tokens, prefix caching off) reports per request the selections and the ones
   outside the resident set (``GET /router_misses``). Without swaps the resident set is the plan's
   core (``reap_status.layers``), so the same counts follow from the trace's requests 0-7 and the
   plan's core alone; any difference is a routing difference between the trace's server (stock
   vLLM, all experts in HBM) and the arm's server.
2. **What the cache counters counted.** The arm's device-cache totals are whole-arm: warm-up
   (prompt 0, 16 tokens), the greedy pass (32 tokens), then ``repeats`` x (one prompt, 128 tokens;
   8 prompts batched, 128 tokens each). Tokens = (hits + misses) / (layers x top_k); the
   difference to the bench's own requests is printed (tokens the bench did not send).
3. **The served configuration simulated**: the arm's plan (its core pinned) and its tail slots
   per layer (the server log's "N slots"), every registered policy, on (a) the whole held-out
   trace and (b) the part of the arm's request stream that the trace holds (warm-up + greedy
   pass, in the bench's order). The timing passes (128 tokens, batches of 8) are not in the trace.

Writes research-notes/cache-sim/skew12h200/served.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import orjson

from reap_swap.cache.replay import POLICIES, simulate
from reap_swap.cache.trace import Trace, from_requests, load_trace
from reap_swap.plan.document import load_plan

ROOT = Path(__file__).resolve().parents[2]
DIR = ROOT / "research-notes/cache-sim/skew12h200"
RUN = ROOT / "research-notes/h200-2026-12-01/run12/b/skewbench"
# arm folder -> (plan file in DIR, tail slots per layer from the arm's server log)
ARMS = {"b-1-cache50": ("skew50.plan.json", 33), "b-7-cache25": ("skew25.plan.json", 16)}
ROUTER_ARMS = {"b-1-cache50": "skew50.plan.json", "b-5-static50": "skew50.plan.json",
               "b-7-cache25": "skew25.plan.json"}  # fmt: skip
WARM_TOKENS = 16  # bench_measure.warm_up: min(16, decode_tokens), greedy (temperature 0)
COMPARE = ("hits", "misses", "expert_hits", "expert_misses", "promotions", "evictions", "read_through_steps")


def request_ids(trace: Trace, r: int, steps: int | None = None):
    s0, s1 = int(trace.request_offsets[r]), int(trace.request_offsets[r + 1])
    s1 = s1 if steps is None else min(s1, s0 + steps)
    return [trace.topk_ids[trace.step_offsets[s] : trace.step_offsets[s + 1]] for s in range(s0, s1)]


def sub_trace(trace: Trace, parts: list[tuple[int, int | None]], label: str) -> Trace:
    """Requests (index, first n steps or all) of ``trace``, in this order, as one trace."""
    return from_requests(
        [request_ids(trace, r, n) for r, n in parts],
        layers=trace.layers,
        model=trace.model,
        num_experts=trace.num_experts,
        top_k=trace.top_k,
        per_expert_bytes=trace.per_expert_bytes,
        request_tags=[trace.request_tags[r] for r, _ in parts],
        source={**trace.source, "sub_trace": label},
    )


def router_check(trace: Trace, arm: str, plan_file: str) -> list[dict]:
    plan = load_plan(DIR / plan_file)
    bench = orjson.loads((RUN / arm / "bench.json").read_bytes())
    rows = []
    for req in bench["runs"][0]["requests"]:
        r = int(req["request_id"].rsplit("-g", 1)[1])
        ids = np.concatenate(request_ids(trace, r))
        missed = sum(
            int((~np.isin(ids[:, j], sorted(plan.layers[layer].core))).sum())
            for j, layer in enumerate(trace.layers)
        )
        observed = int(ids.size)
        rows.append({
            "arm": arm, "request": r, "server_observed": req["observed_selections"],
            "server_missed": req["missed_selections"], "trace_observed": observed, "trace_missed": missed,
            "equal": (observed, missed) == (req["observed_selections"], req["missed_selections"]),
        })  # fmt: skip
    return rows


def arm_tokens(arm: str, layers: int, top_k: int) -> dict:
    bench = orjson.loads((RUN / arm / "bench.json").read_bytes())
    cfg, run = bench["config"], bench["runs"][0]
    prompts = [r["prompt_tokens"] for r in run["requests"]]
    n, dec, reps = len(prompts), cfg["decode_tokens"], cfg["repeats"]
    sent = {
        "warm_up": prompts[0] + WARM_TOKENS - 1,
        "greedy": sum(p + cfg["max_tokens"] - 1 for p in prompts),
        "single": sum(prompts[r % n] + dec - 1 for r in range(reps)),
        "batch": sum(prompts[(r + j) % n] + dec - 1 for r in range(reps) for j in range(cfg["batch"])),
    }
    totals = run["reap_status"]["cache"]["totals"]
    counted = (totals["hits"] + totals["misses"]) / (layers * top_k)
    return {"sent": sent, "sent_total": sum(sent.values()), "counted": counted,
            "not_sent_by_bench": counted - sum(sent.values()), "server": totals,
            "policy": run["reap_status"]["cache"]["policy"]}  # fmt: skip


def served_rows(trace: Trace, plan_file: str, tail: int, prior: Trace) -> list[dict]:
    plan = load_plan(DIR / plan_file)
    core = sum(len(plan.layers[l].core) for l in trace.layers)
    budget = f"{(core + tail * len(trace.layers)) * trace.per_expert_bytes}B"
    rows = simulate(trace, plan, [budget], POLICIES, prior_trace=prior)["rows"]
    for r in rows:
        r.pop("layers", None)
    return rows


def md_rows(label: str, rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        if r["status"] != "ok":
            out.append(f"| {label} | {r['policy']} | refused: {r['reason']} | | | | | |")
            continue
        t = r["totals"]
        out.append(
            f"| {label} | {r['policy']} | {100 * t['selection_hit_rate']:.2f} | {100 * t['expert_hit_rate']:.2f} | "
            f"{t['selection_misses']:,} | {t['expert_misses']:,} | {t['admitted']:,} | {t['bytes_moved'] / 2**20:,.0f} |"
        )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DIR)
    args = ap.parse_args(argv)
    held, cal = load_trace(DIR / "skew-heldout.npz"), load_trace(DIR / "skew-calibration.npz")
    L, K = len(held.layers), held.top_k
    router = [row for arm, pf in ROUTER_ARMS.items() for row in router_check(held, arm, pf)]
    doc = {"router_check": router, "arms": {}}
    lines = ["## 1. router counters (greedy pass) vs the trace + the plan's core", "",
             "| arm | request | server selections | server missed | trace selections | trace missed | equal |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['arm']} | {r['request']} | {r['server_observed']:,} | {r['server_missed']:,} | "
              f"{r['trace_observed']:,} | {r['trace_missed']:,} | {'yes' if r['equal'] else '**no**'} |"
              for r in router]  # fmt: skip
    for arm, (pf, tail) in ARMS.items():
        tok = arm_tokens(arm, L, K)
        prefix = sub_trace(
            held, [(0, WARM_TOKENS)] + [(r, None) for r in range(8)], f"{arm} warm-up + greedy"
        )
        doc["arms"][arm] = {"plan": pf, "tail_slots": tail, "tokens": tok,
                            "full_heldout": served_rows(held, pf, tail, cal),
                            "bench_prefix": served_rows(prefix, pf, tail, cal)}  # fmt: skip
        s = tok["server"]
        lines += ["", f"## {arm}: plan {pf}, core pinned + {tail} tail slots per layer (device policy "
                  f"{tok['policy']})", "",
                  f"- tokens the bench sent: {tok['sent']} = {tok['sent_total']:,}; counted by the device cache: "
                  f"{tok['counted']:,.0f} (not sent by the bench: {tok['not_sent_by_bench']:,.0f})",
                  f"- server whole-arm: selection hit {100 * s['hits'] / (s['hits'] + s['misses']):.2f} %, "
                  + ", ".join(f"{k} {s[k]:,}" for k in COMPARE), "",
                  "| stream | policy | selection hit % | expert hit % | selection misses | expert misses | "
                  "admitted | MiB moved |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        lines += md_rows("held-out (32 req.)", doc["arms"][arm]["full_heldout"])
        lines += md_rows("warm-up + greedy (bench order)", doc["arms"][arm]["bench_prefix"])
    (args.out / "served.md").write_text("\n".join(lines) + "\n")
    (args.out / "served.json").write_bytes(
        orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS)
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
