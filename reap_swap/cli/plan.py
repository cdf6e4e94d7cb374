"""Build a plan from observation files (ours from ``reap-swap observe`` or REAP's observations_*.pt).

The budget is a share of all expert bytes (--budget-ratio) or GiB (--budget-gib); --core-fraction
of it goes to the always-resident core, split across layers by marginal hit gain, the rest to
per-request specialist slices (--cache-tail caps the core to leave the device cache a tail). The plan is validated against the model before it is written; the
same inputs and flags always give the same bytes (inputs are recorded by SHA-256 in
scorerArtifacts). See reap_swap/planner/build.py for the method.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import get_args

from reap_swap.plan.document import validate_plan_document
from reap_swap.planner.build import PlannerConfig, PlannerError, build_plan, plan_bytes
from reap_swap.sizing.model_shape import ModelShapeError, read_model_shape


def _default(name: str):
    return PlannerConfig.model_fields[name].default


def _choices(name: str) -> list[str]:
    return list(get_args(PlannerConfig.model_fields[name].annotation))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags for PlannerConfig's knobs; defaults and choices come from PlannerConfig itself."""
    parser.add_argument(
        "--observations",
        nargs="+",
        required=True,
        metavar="FILE.pt",
        help="observation files (torch.save {layer_idx: {field: tensor}}); merged",
    )
    parser.add_argument(
        "--model",
        required=True,
        metavar="PATH",
        help="model folder or config.json (layers, experts, expert bytes)",
    )
    parser.add_argument("--model-name", help="the plan's 'model' field (default: --model as given)")
    budget = parser.add_mutually_exclusive_group(required=True)
    budget.add_argument("--budget-ratio", type=float, help="resident experts as a share of all expert bytes")
    budget.add_argument("--budget-gib", type=float, help="resident experts in GiB")
    _method_arguments(parser)
    parser.add_argument(
        "--allow-pickle", action="store_true", help="torch.load with weights_only=False (trusted files only)"
    )
    parser.add_argument("--out", required=True, type=Path, metavar="plan.json")


def cache_tail_value(text: str) -> int | str:
    """--cache-tail: auto or a slot count >= 0."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give auto, 0 or a positive slot count") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value}: give auto, 0 or a positive slot count")
    return value


def _method_arguments(parser: argparse.ArgumentParser) -> None:
    """The planner's method knobs (core split, signal, slices, guards, refreshes)."""
    parser.add_argument(
        "--core-fraction",
        type=float,
        default=_default("core_fraction"),
        help="share of the budget for the core",
    )
    parser.add_argument(
        "--cache-tail",
        type=cache_tail_value,
        default=_default("cache_tail"),
        metavar="{0,auto,N}",
        help="cap the core so the device cache's pinned form (--reap-cache lfu, core+dlfu: (pool - core) "
        "// layers tail slots per layer) keeps >= N tail slots per layer: core <= budget slots - layers "
        "x N, a layer's core <= its experts - N, in the greedy order; auto: 2 x the model's top_k; the "
        "freed core slots go to the specialists (default 0: no cap). At small budgets this can empty "
        "the core: see README (--reap-cache) for the GPU caveat",
    )
    parser.add_argument(
        "--signal",
        choices=_choices("signal"),
        default=_default("signal"),
        help="per-expert value: routed frequency (default), routed gate mass, or REAP saliency (a baseline)",
    )
    parser.add_argument(
        "--layer-allocation",
        choices=_choices("layer_allocation"),
        default=_default("layer_allocation"),
        help="core split across layers: by marginal hit gain (default) or equal counts",
    )
    parser.add_argument("--slice-size", type=int, help="experts per slice (default: derived from the budget)")
    parser.add_argument(
        "--slices-per-request",
        type=int,
        default=_default("slices_per_request"),
        help="slices a request may add per layer; sets the default slice size",
    )
    parser.add_argument(
        "--candidate-pool-multiplier", type=float, default=_default("candidate_pool_multiplier")
    )
    parser.add_argument(
        "--no-reap-guard",
        dest="reap_guard",
        action="store_false",
        help="do not protect high-REAP-saliency experts",
    )
    parser.add_argument("--reap-guard-multiple", type=float, default=_default("reap_guard_multiple"))
    parser.add_argument("--reap-guard-max-fraction", type=float, default=_default("reap_guard_max_fraction"))
    parser.add_argument(
        "--no-super-experts",
        dest="super_experts",
        action="store_false",
        help="do not force max_activations outliers into the core",
    )
    parser.add_argument("--super-expert-quantile", type=float, default=_default("super_expert_quantile"))
    parser.add_argument(
        "--max-refreshes-per-request", type=int, default=_default("max_refreshes_per_request")
    )
    parser.add_argument(
        "--group-size",
        choices=["auto", "1", "2", "4", "8"],
        help="plan for the grouped engine (--reap-group-size): price experts at their HBM in whole "
        "groups of b and size the core and every slice in multiples of b (auto: the engine's rule, "
        "the smallest b wasting < 12 %%); default: experts at checkpoint bytes, no groupSize",
    )


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from reap_swap.planner.observations import ObservationError, load_many  # imports torch

    try:
        config = PlannerConfig(**{k: v for k, v in vars(args).items() if k in PlannerConfig.model_fields})
        shape = read_model_shape(args.model)
        observations = load_many(args.observations, allow_pickle=args.allow_pickle)
        doc = build_plan(observations, shape, config, args.model_name or args.model)
    except ValidationError as exc:
        print(f"error: bad planner parameters:\n{exc}", file=sys.stderr)
        return 2
    except (ModelShapeError, ObservationError, PlannerError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    report = validate_plan_document(doc, shape)
    if not report.ok:  # a planner bug: say so, write nothing
        print("error: the planner produced an invalid plan (a bug); not written:", file=sys.stderr)
        print(report.format_text(), file=sys.stderr)
        return 3
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(plan_bytes(doc))
    s, b = doc["summary"], doc["budget"]
    print(
        f"wrote {args.out}: {s['layerCount']} layers, {s['totalCoreExperts']} core experts, "
        f"{s['totalSlices']} slices; budget {b['swappable_expert_budget_bytes']:,} bytes "
        f"(core {b['core_budget_bytes']:,}); identity {report.summary['identity'][:16]}"
    )
    if "groupSize" in doc:
        g = doc["scorerArtifacts"]["grouping"]
        print(
            f"group size {doc['groupSize']} ({g['why']}): {g['hbmBytesPerExpert']:,.0f} HBM bytes per "
            f"expert in groups of {g['groupHbmBytes']:,} ({g['paddingOverhead']:.1%} over the unpadded slabs)"
        )
    for note in doc["scorerArtifacts"]["notes"]:
        print(f"note: {note}")
    return 0
