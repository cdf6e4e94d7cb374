"""Choose the active set for a prompt and print the chosen slices and the swap payload.

static and prior need only the plan. probe needs the router misses of a prefill-only pass with
the core resident: either a saved GET /router_misses answer (--misses FILE), or --server URL
to run that pass now. Nothing is swapped; pipe --payload-only into
`curl -d @- URL/swap_active_set` to apply it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import orjson

from reap_swap.cli.common import api_key, print_json
from reap_swap.client.selection import SelectionError, missed_mass
from reap_swap.client.strategies import STRATEGIES, select
from reap_swap.plan.document import PlanError, load_plan


def add_prompt_arguments(parser: argparse.ArgumentParser) -> None:
    """--prompt TEXT | --messages FILE (shared with `chat`)."""
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="the user prompt ('-' reads stdin)")
    src.add_argument(
        "--messages", metavar="FILE", help='JSON file: OpenAI chat messages, a list or {"messages": [...]}'
    )


def read_messages(args: argparse.Namespace) -> list[dict]:
    if args.prompt is not None:
        text = sys.stdin.read() if args.prompt == "-" else args.prompt
        return [{"role": "user", "content": text}]
    doc = orjson.loads(Path(args.messages).read_bytes())
    messages = doc.get("messages") if isinstance(doc, dict) else doc
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError(f"{args.messages}: expected a list of {{role, content}} messages")
    return messages


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", required=True, metavar="PLAN", help="plan JSON file")
    add_prompt_arguments(parser)
    parser.add_argument("--strategy", choices=STRATEGIES, default="prior", help="default: prior")
    parser.add_argument(
        "--budget-bytes", type=int, metavar="N", help="budget for this request (default: the plan's)"
    )
    parser.add_argument("--request-id", default="select-1", help="request_id written into the payload")
    parser.add_argument(
        "--misses", metavar="FILE", help="probe: a saved GET /router_misses answer (core-only pass)"
    )
    parser.add_argument("--server", metavar="URL", help="probe: run the prefill-only pass on this server")
    parser.add_argument("--api-key", help="bearer key for --server (default: $VLLM_API_KEY)")
    parser.add_argument(
        "--json", action="store_true", help="print selection and payload as one JSON document"
    )
    parser.add_argument("--payload-only", action="store_true", help="print only the swap payload (JSON)")


def run(args: argparse.Namespace) -> int:
    try:
        plan = load_plan(args.plan)
        messages = read_messages(args)
        probe_info = None
        if args.strategy == "probe" and args.misses:
            misses = missed_mass(orjson.loads(Path(args.misses).read_bytes()))
            selection = select(plan, "probe", messages, budget_bytes=args.budget_bytes, probe=misses)
        elif args.strategy == "probe":
            if not args.server:
                print("error: --strategy probe needs --misses FILE or --server URL", file=sys.stderr)
                return 2
            from reap_swap.client.reap_client import ReapClient

            with ReapClient(args.server, api_key(args), plan=plan, strategy="probe") as client:
                selection, probe_info = client.select(
                    messages, budget_bytes=args.budget_bytes, request_id=args.request_id
                )
        else:
            selection = select(plan, args.strategy, messages, budget_bytes=args.budget_bytes)
    except (PlanError, SelectionError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    payload = selection.payload(args.request_id)
    if args.payload_only:
        print_json(payload)
    elif args.json:
        print_json({"selection": selection.to_dict(), "payload": payload, "probe": probe_info})
    else:
        d = selection.to_dict()
        print(
            f"strategy {d['strategy']}: {d['slice_count']} slice(s), {d['resident_experts']} resident experts, "
            f"{d['resident_bytes']:,} of {d['budget_bytes']:,} bytes, signature {d['signature']}"
        )
        if selection.features is not None:
            f = selection.features
            print(
                f"prompt: {f.length_tokens} tokens, family {f.family or '-'}, weights "
                + ", ".join(f"{k} {v:.3f}" for k, v in f.weights.items())
            )
        if probe_info is not None:
            print(
                f"probe: {probe_info['total_ms']:.1f} ms (prefill {probe_info['prefill_ms']:.1f} ms), "
                f"core-only miss ratio {(probe_info.get('totals') or {}).get('miss_ratio', 0):.3f}"
            )
        for layer, ids in d["slices"].items():
            print(f"  {layer}: " + ", ".join(f"{sid} ({selection.values.get(sid, 0):.4g})" for sid in ids))
        print("payload:")
        print_json(payload)
    return 0
