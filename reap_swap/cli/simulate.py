"""Replay a routing trace under device-cache policies and budgets: hits, misses, bytes moved.

usage: reap-swap simulate --trace T.npz [--plan P.json] --budget 0.125 0.25 0.5 [--policy lru belady ...]
                          [--layer-slots core+tail|uniform] [--prior-trace CAL.npz]
                          [--json OUT.json] [--plot OUT.png] [--per-layer]

A budget is a fraction of all expert bytes (0.25) or a size (1.5GiB); each layer gets a fixed
number of slots from it (--layer-slots; the mechanism and every policy are described in
reap_swap/cache/__init__.py). Policies that use the plan's core (static, probe, *-seeded,
core+*, probe+lfu / probe+dlfu / probe+core+dlfu(-split): the client's probe set pinned per request, the
cache in the slots left over, as the server's accounting mode) need --plan and are refused, with the reason, where the core does not fit the slots.
Prints the markdown table (and with --per-layer the expert hit rate per layer); --json writes
every count per policy, budget and layer; --plot a PNG of hit rate against budget.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import orjson

from reap_swap.cache.online import LFU_DECAY


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from reap_swap.cache.replay import ALLOCATIONS, POLICIES

    parser.add_argument(
        "--trace", required=True, type=Path, help="routing trace (.npz, reap-swap observe --trace)"
    )
    parser.add_argument("--plan", type=Path, help="plan JSON (its core seeds / pins the plan policies)")
    parser.add_argument(
        "--budget", nargs="+", required=True, help="fractions of all expert bytes (0.25) or sizes (1.5GiB)"
    )
    parser.add_argument(
        "--policy", nargs="+", default=list(POLICIES), choices=POLICIES, help="policies (default: all)"
    )
    parser.add_argument("--layer-slots", choices=ALLOCATIONS, default="core+tail", help="per-layer slots")
    parser.add_argument(
        "--lfu-decay",
        type=float,
        default=LFU_DECAY,
        help="LFU score decay per step (chosen on a calibration trace, research.md)",
    )
    parser.add_argument(
        "--prior-trace",
        type=Path,
        help="calibration routing trace of the same model (never the replayed one): the transition "
        "table of dlfu-markov-seeded, which is refused without it",
    )
    parser.add_argument(
        "--markov-weight",
        type=float,
        default=16.0,
        help="weight of the transition prior in score units (16: chosen on the calibration trace)",
    )
    parser.add_argument("--json", type=Path, help="write the full report here")
    parser.add_argument("--plot", type=Path, help="write a PNG plot here")
    parser.add_argument("--per-layer", action="store_true", help="also print the per-layer expert hit rates")


def run(args: argparse.Namespace) -> int:
    from reap_swap.cache import report as rep
    from reap_swap.cache.replay import SimulationError, simulate
    from reap_swap.cache.trace import TraceError, load_trace
    from reap_swap.plan.document import PlanError, load_plan

    try:
        trace = load_trace(args.trace)
        plan = load_plan(args.plan) if args.plan is not None else None
        prior = load_trace(args.prior_trace) if args.prior_trace is not None else None
        result = simulate(
            trace,
            plan,
            args.budget,
            args.policy,
            allocation=args.layer_slots,
            lfu_decay=args.lfu_decay,
            prior_trace=prior,
            markov_weight=args.markov_weight,
        )
    except (TraceError, SimulationError, ValueError) as exc:
        if isinstance(exc, PlanError):
            print(f"error: --plan {args.plan}: {exc.report.format_text()}", file=sys.stderr)
        else:
            print(f"error: {exc}", file=sys.stderr)
        return 2
    result["trace"]["file"] = str(args.trace)
    print(rep.markdown_table(result))
    if args.per_layer:
        print()
        print(rep.layer_table(result))
    if args.json is not None:
        args.json.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
        print(f"wrote {args.json}")
    if args.plot is not None:
        rep.plot(
            result,
            args.plot,
            title=f"{trace.model}: {trace.num_requests} requests, {trace.num_steps:,} steps",
        )
        print(f"wrote {args.plot}")
    return 0
