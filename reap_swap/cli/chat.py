"""Run one chat request end to end against a reap-swap server.

Selects the active set for the prompt (--strategy), swaps it in (or only opens the request when
it is already resident), sends the chat completion through the server's OpenAI-compatible route,
then prints the answer, the swap summary and the request's router misses. Exit 1 on any error.
"""

from __future__ import annotations

import argparse
import sys

from reap_swap.cli.common import api_key, print_json
from reap_swap.cli.select import add_prompt_arguments, read_messages
from reap_swap.client.strategies import STRATEGIES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", required=True, metavar="URL", help="e.g. http://127.0.0.1:8000")
    parser.add_argument("--api-key", help="bearer key (default: $VLLM_API_KEY)")
    parser.add_argument(
        "--plan", metavar="PLAN", help="plan JSON file (default: the server's plan file, if readable here)"
    )
    add_prompt_arguments(parser)
    parser.add_argument("--strategy", choices=STRATEGIES, default="prior", help="default: prior")
    parser.add_argument(
        "--budget-bytes", type=int, metavar="N", help="budget for this request (default: the plan's)"
    )
    parser.add_argument("--model", help="served model name (default: the first of /v1/models)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--request-id", help="default: a random reap-<hex> id")
    parser.add_argument(
        "--refresh-every",
        type=int,
        metavar="N",
        help="stream, and after every N chunks consider a decode_refresh swap",
    )
    parser.add_argument("--json", action="store_true", help="print everything as one JSON document")


def _layers(misses: dict) -> list[str]:
    rows = []
    for layer, row in sorted((misses.get("layers") or {}).items(), key=lambda kv: int(kv[0])):
        rows.append(
            f"  layer {layer}: {row['missed_selections']}/{row['observed_selections']} selections missed "
            f"({row['miss_ratio']:.3f}), inactive experts {row['inactive_experts']}"
        )
    return rows


def run(args: argparse.Namespace) -> int:
    from reap_swap.client.reap_client import ReapClient, ReapHTTPError

    try:
        messages = read_messages(args)
        kwargs = {"max_tokens": args.max_tokens, "temperature": args.temperature}
        if args.model:
            kwargs["model"] = args.model
        with ReapClient(
            args.server, api_key(args), plan=args.plan, strategy=args.strategy, budget_bytes=args.budget_bytes
        ) as client:
            result = client.chat(
                messages, request_id=args.request_id, refresh_every=args.refresh_every, **kwargs
            )
    except (ReapHTTPError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # httpx transport errors and the like: one line, not a traceback
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print_json(result.to_dict())
        return 0
    s, sel, t = result.swap, result.selection, result.timings_ms
    print(result.answer)
    print(
        f"--- request {result.request_id}, strategy {sel.strategy}: {sel.slice_count} slice(s), "
        f"signature {sel.signature}"
    )
    print(
        f"swap: {s['opened_with']}, noop {s['noop']}, bytes copied {s['bytes_copied']}, delta {s['delta']}, "
        f"resident {s['resident_bytes']} of {s['budget_bytes']} bytes, server {s['server_seconds']}"
    )
    if result.probe:
        print(f"probe: {result.probe['total_ms']:.1f} ms extra (prefill {result.probe['prefill_ms']:.1f} ms)")
    for r in result.refreshes:
        print(
            f"refresh after {r['after_chunks']} chunks: {'swapped' if r['swapped'] else 'kept'} ({r['ms']:.1f} ms)"
        )
    totals = result.router_misses.get("totals") or {}
    hit = result.hit_rate
    print(
        f"router misses: {totals.get('missed_selections')}/{totals.get('observed_selections')} selections "
        f"(hit rate {hit:.3f})"
        if hit is not None
        else "router misses: nothing routed"
    )
    for line in _layers(result.router_misses):
        print(line)
    print("timings ms: " + ", ".join(f"{k} {v:.1f}" for k, v in t.items()))
    return 0
