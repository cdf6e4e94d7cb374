"""Coverage of a plan on held-out observations: core, core + best slices per request, oracles.

Per layer and overall: the share of routed selections the core covers, the best static set of the
same size would cover, core + the best plan slices per request would cover (needs observation
files written with ``observe --per-request``) and the best per-request set of that size. No
timing: this says whether a plan is worth serving. See reap_swap/planner/evaluate.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from reap_swap.cli.common import json_bytes
from reap_swap.plan.document import PlanError, load_plan
from reap_swap.planner.build import PlannerError
from reap_swap.planner.evaluate import EvaluationError, evaluate_observations, format_report
from reap_swap.sizing.model_shape import ModelShapeError, read_model_shape


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", required=True, type=Path, help="plan JSON")
    parser.add_argument(
        "--observations",
        nargs="+",
        required=True,
        metavar="FILE.pt",
        help="held-out observation files (merged)",
    )
    parser.add_argument("--model", help="also validate the plan against this model folder / config.json")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--out", type=Path, help="also write the JSON report here")
    parser.add_argument(
        "--allow-pickle", action="store_true", help="torch.load with weights_only=False (trusted files only)"
    )


def run(args: argparse.Namespace) -> int:
    from reap_swap.planner.observations import ObservationError, load_many  # imports torch

    try:
        shape = read_model_shape(args.model) if args.model else None
        plan = load_plan(args.plan, shape)
        report = evaluate_observations(plan, load_many(args.observations, allow_pickle=args.allow_pickle))
    except PlanError as exc:
        print(f"error: {args.plan}: {exc}", file=sys.stderr)
        return 1
    except (ModelShapeError, ObservationError, PlannerError, EvaluationError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    data = json_bytes(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_bytes(data)
    if args.json:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    else:
        print(format_report(report))
    return 0
