#!/usr/bin/env python3
"""Router hit rate of static vs prior vs probe at the same budget, on held-out prompts.

Every number comes from the server's own counters: for each prompt and strategy, the client
selects, swaps, sends the chat completion and reads GET /router_misses/<id> (the probe pass runs
under its own id, so its prefill is not in the request's counts). The hit rate is
1 - missed/observed routed selections, pooled over all requests of an arm (and per domain); the
mass-weighted variant uses router gate weight instead of selection counts. For probe, its extra
cost is the wall time from opening the core-only probe request to having the selection (core-only
swap + prefill-only completion + misses read + selection), against the request's own completion.

Sanity check of the counters: a request's routed selections per layer must equal
(prompt tokens + completion tokens - 1) x top_k (the last sampled token is never fed back);
the script records every request where that does not hold (prefix caching would break it, so
start the server with --no-enable-prefix-caching).

Two reference arms: ``global`` (prior with the classifier switched off: the plan's global
ranking for every prompt) and ``oracle`` (slices chosen from the very routing the request had
in its static run, then the request run again: with greedy decoding and accounting residency the
routing is identical, so this bounds what any selection could reach with this plan's slices).

Arms run interleaved per prompt (static, prior, probe, then the next prompt) so drift in the
server affects all alike. Prompts: the first --per-domain records of each `source` in the
held-out file, cut to --prompt-chars at a line boundary, sent as one user message.

usage: python research/measure/measure_selection.py --server URL --plan PLAN [--budget-bytes N |
       --budget-fraction F] [--per-domain 25] [--max-tokens 32] [--out results.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import orjson

from reap_swap.client.reap_client import ReapClient
from reap_swap.client.selection import prompt_features, routed_share, select_prior, select_probe
from reap_swap.client.strategies import STRATEGIES
from reap_swap.plan.document import load_plan


def load_prompts(path: str, per_domain: int, chars: int) -> list[dict]:
    by_domain: dict[str, list[dict]] = defaultdict(list)
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        rec = orjson.loads(line)
        domain = rec.get("tag") or rec.get("source") or "untagged"
        if len(by_domain[domain]) >= per_domain:
            continue
        text = rec["text"]
        if len(text) > chars:
            cut = text.rfind("\n", 0, chars)
            text = text[: cut if cut > chars // 2 else chars]
        by_domain[domain].append({"domain": domain, "text": text, "path": rec.get("path")})
    return [p for d in sorted(by_domain) for p in by_domain[d]]


def budget_for(plan, args) -> int | None:
    if args.budget_bytes is not None:
        return args.budget_bytes
    if args.budget_fraction is not None:
        core, full = plan.core_bytes(), plan.swappable_budget_bytes
        pe = plan.per_expert_bytes
        return core + int(args.budget_fraction * (full - core)) // pe * pe
    return None


def pooled(rows: list[dict]) -> dict:
    obs = sum(r["observed"] for r in rows)
    miss = sum(r["missed"] for r in rows)
    mass = sum(r["observed_mass"] for r in rows)
    imass = sum(r["inactive_mass"] for r in rows)
    out = {
        "requests": len(rows),
        "observed_selections": obs,
        "missed_selections": miss,
        "hit_rate": 1 - miss / obs if obs else None,
        "mass_hit_rate": 1 - imass / mass if mass else None,
        "mean_request_hit_rate": sum(r["hit_rate"] for r in rows) / len(rows) if rows else None,
        "mean_completion_ms": sum(r["completion_ms"] for r in rows) / len(rows) if rows else None,
        "mean_slices": sum(r["slices"] for r in rows) / len(rows) if rows else None,
        "refreshes": sum(r.get("refreshes", 0) for r in rows),
        "routing_differs_from_static": sum(1 for r in rows if r.get("same_routing_as_static") is False),
        "mean_resident_bytes": sum(r["resident_bytes"] for r in rows) / len(rows) if rows else None,
    }
    probes = [r["probe_ms"] for r in rows if r.get("probe_ms") is not None]
    if probes:
        s = sorted(probes)
        out["probe_ms_mean"] = sum(s) / len(s)
        out["probe_ms_median"] = s[len(s) // 2]
        out["probe_prefill_ms_mean"] = sum(r["probe_prefill_ms"] for r in rows) / len(rows)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", required=True)
    ap.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"))
    ap.add_argument("--plan", required=True)
    ap.add_argument("--heldout", default="data/corpus/heldout.jsonl")
    ap.add_argument("--per-domain", type=int, default=25)
    ap.add_argument("--prompt-chars", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--budget-bytes", type=int)
    ap.add_argument(
        "--budget-fraction", type=float, help="core + this fraction of (plan budget - core), whole experts"
    )
    ap.add_argument(
        "--strategies",
        default=",".join(STRATEGIES),
        help="arms: static, prior, probe; 'global' (prior without the classifier) and "
        "'oracle' (slices chosen from the static run's own routing of the same request: "
        "greedy decoding routes identically, so this is the hindsight bound); "
        "'NAME+refresh' streams and allows decode refreshes (--refresh-every)",
    )
    ap.add_argument(
        "--refresh-every", type=int, default=8, help="chunks between refresh checks (+refresh arms)"
    )
    ap.add_argument("--out", help="write per-request rows and the summary here (JSON)")
    args = ap.parse_args()

    plan = load_plan(args.plan)
    budget = budget_for(plan, args)
    strategies = args.strategies.split(",")
    prompts = load_prompts(args.heldout, args.per_domain, args.prompt_chars)
    rows: list[dict] = []
    mismatches: list[dict] = []
    top_k = None
    t_start = time.time()
    with ReapClient(args.server, args.api_key, plan=plan, budget_bytes=budget) as client:
        status = client.status()
        model = client.served_model()
        for i, prompt in enumerate(prompts):
            messages = [{"role": "user", "content": prompt["text"]}]
            features = prompt_features(plan, messages)
            static_misses = None
            for strategy in strategies:
                rid = f"measure-{i:04d}-{strategy}"
                base, _, extra = strategy.partition("+")
                given = None
                if base == "global":  # ablation: prior without the prompt classifier
                    given = select_prior(plan, "", budget)
                elif base == "oracle":  # hindsight: this request's own routing, from the static run
                    if static_misses is None:
                        raise SystemExit("the oracle arm needs the static arm to run before it")
                    given = select_probe(plan, routed_share(static_misses), "", budget)
                r = client.chat(
                    messages,
                    strategy=base if given is None else "static",
                    request_id=rid,
                    max_tokens=args.max_tokens,
                    temperature=0.0,
                    ignore_eos=True,
                    selection=given,
                    refresh_every=args.refresh_every if extra == "refresh" else None,
                )
                if base == "static":
                    static_misses = r.router_misses
                same_routing = None
                if static_misses is not None and base != "static":
                    same_routing = all(
                        row.get("expert_counts") == static_misses["layers"][k].get("expert_counts")
                        for k, row in r.router_misses["layers"].items()
                    )
                totals = r.router_misses["totals"]
                usage = r.completion.get("usage") or {}
                routed_tokens = usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0) - 1
                per_layer = {k: v["observed_selections"] for k, v in r.router_misses["layers"].items()}
                if top_k is None and routed_tokens > 0 and per_layer:
                    top_k = next(iter(per_layer.values())) // routed_tokens
                expected = routed_tokens * (top_k or 0)
                if any(v != expected for v in per_layer.values()):
                    mismatches.append(
                        {"request_id": rid, "expected_per_layer": expected, "observed": per_layer}
                    )
                rows.append(
                    {
                        "request_id": rid,
                        "strategy": strategy,
                        "domain": prompt["domain"],
                        "family": features.family,
                        "prompt_tokens": usage.get("prompt_tokens"),
                        "completion_tokens": usage.get("completion_tokens"),
                        "observed": totals["observed_selections"],
                        "missed": totals["missed_selections"],
                        "observed_mass": totals["observed_mass"],
                        "inactive_mass": totals["inactive_mass"],
                        "hit_rate": r.hit_rate,
                        "slices": r.selection.slice_count,
                        "resident_bytes": r.selection.resident_bytes,
                        "signature": r.selection.signature,
                        "swap_noop": r.swap.get("noop"),
                        "completion_ms": r.timings_ms["completion_ms"],
                        "probe_ms": r.probe["total_ms"] if r.probe else None,
                        "probe_prefill_ms": r.probe["prefill_ms"] if r.probe else None,
                        "refreshes": sum(1 for x in r.refreshes if x["swapped"]),
                        "same_routing_as_static": same_routing,
                    }
                )
            if (i + 1) % 10 == 0:
                print(f"{i + 1}/{len(prompts)} prompts, {time.time() - t_start:.0f} s", file=sys.stderr)

    summary: dict = {
        "server": args.server,
        "model": model,
        "plan": args.plan,
        "plan_identity": plan.identity,
        "residency_mode": status.get("mode"),
        "budget_bytes": budget or plan.swappable_budget_bytes,
        "core_bytes": plan.core_bytes(),
        "plan_budget_bytes": plan.swappable_budget_bytes,
        "per_expert_bytes": plan.per_expert_bytes,
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "prompt_chars": args.prompt_chars,
        "top_k": top_k,
        "counter_mismatches": len(mismatches),
        "seconds": round(time.time() - t_start, 1),
        "arms": {},
        "by_domain": {},
    }
    for strategy in strategies:
        arm = [r for r in rows if r["strategy"] == strategy]
        summary["arms"][strategy] = pooled(arm)
        summary["by_domain"][strategy] = {
            d: pooled([r for r in arm if r["domain"] == d])["hit_rate"]
            for d in sorted({r["domain"] for r in arm})
        }
    fam = [r for r in rows if r["strategy"] == strategies[0]]
    summary["classifier"] = {
        "accuracy": sum(r["family"] == r["domain"] for r in fam) / len(fam) if fam else None,
        "confusion": {
            d: {
                f or "-": sum(1 for r in fam if r["domain"] == d and r["family"] == f)
                for f in sorted({r["family"] for r in fam}, key=str)
            }
            for d in sorted({r["domain"] for r in fam})
        },
    }
    print(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode())
    if mismatches:
        print(
            f"WARNING: {len(mismatches)} request(s) whose counters do not match their token counts "
            f"(first: {mismatches[0]})",
            file=sys.stderr,
        )
    if args.out:
        Path(args.out).write_bytes(
            orjson.dumps(
                {"summary": summary, "rows": rows, "mismatches": mismatches}, option=orjson.OPT_INDENT_2
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
