"""Check a plan offline: schema, semantics and (with --model) the model's shape.

Exit 0 when valid, 1 when not (or when the plan or model config cannot be read). Every error is
printed with its JSON path, then a summary; ``--json`` prints the same as one JSON document.
"""

from __future__ import annotations

import argparse

from reap_swap.cli.common import print_json
from reap_swap.plan.document import (
    PlanError,
    PlanIssue,
    ValidationReport,
    read_plan_document,
    validate_plan_document,
)
from reap_swap.sizing.model_shape import ModelShapeError, read_model_shape


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", metavar="PLAN", help="plan JSON file")
    parser.add_argument(
        "--model",
        metavar="PATH",
        help="model config.json or model folder: check layers, experts and expert bytes",
    )
    parser.add_argument("--json", action="store_true", help="print the report as one JSON document")


def _report(args: argparse.Namespace) -> ValidationReport:
    try:
        shape = read_model_shape(args.model) if args.model else None
        return validate_plan_document(read_plan_document(args.plan), shape)
    except PlanError as exc:
        return exc.report
    except ModelShapeError as exc:
        return ValidationReport((PlanIssue("--model", str(exc)),), ())
    except OSError as exc:
        return ValidationReport((PlanIssue("$", f"cannot read {exc.filename}: {exc.strerror}"),), ())


def run(args: argparse.Namespace) -> int:
    report = _report(args)
    if args.json:
        print_json({"plan": args.plan, **report.to_dict()})
    else:
        print(f"plan {args.plan}" + (f" (model {args.model})" if args.model else ""))
        print(report.format_text())
    return 0 if report.ok else 1
