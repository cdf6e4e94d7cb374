"""The acceptance run: is reap-swap's output bit-identical to stock vLLM on this machine and card?

usage: reap-swap accept MODEL [--plan PLAN] [--prompts N] [--tokens T] [--storm S] [--out DIR]
                        [--reap-args "FLAGS"] [-- VLLM_ARGS]

Starts one server at a time: stock vLLM (the reference), then `python -m reap_swap.server` with
the same vLLM arguments and only the plan (the server's defaults; without --plan, no --reap-plan).
Each gets --no-enable-prefix-caching and its own compile cache under DIR; CUDA graphs stay on
unless VLLM_ARGS say --enforce-eager. Both complete N token-id prompts x T greedy tokens
(ignore_eos, logprobs, temperature 0), one request at a time; the reap server does so
  (1) quiet, (2) while a thread swaps the active set every --swap-period-ms (random slices of the
  plan; random experts without slices or without a plan), (3) after the swaps stopped, (4) after
  a storm of S requests, --storm-concurrency at a time: chats, swaps, malformed payloads.
Then it reads /reap/status (the cache counters).

Pass: every phase's tokens and logprobs equal stock's bit for bit, every phase ran, and no request
got a 5xx or no answer. Prints the verdict table (decode tok/s per arm and phase included) and
writes DIR/accept.json (every number) and DIR/accept.md; server logs under DIR/logs.
Exit 0 pass, 1 fail, 2 refused inputs (the reason is printed). Details: docs/accept.md.

example: reap-swap accept Qwen/Qwen3-30B-A3B --plan plan.json -- --max-model-len 4096
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="model folder or hub id (both servers serve it)")
    _options(parser)
    parser.add_argument(
        "engine_args",
        nargs=argparse.REMAINDER,
        metavar="-- VLLM_ARGS",
        help="vLLM engine arguments for both servers, after --",
    )


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", type=Path, help="reap-swap plan JSON (default: none, no --reap-plan)")
    parser.add_argument("--prompts", type=int, default=4, help="token-id prompts per phase (default 4)")
    parser.add_argument("--tokens", type=int, default=192, help="greedy tokens per prompt (default 192)")
    parser.add_argument("--storm", type=int, default=240, help="requests of the storm (default 240)")
    parser.add_argument(
        "--storm-concurrency", type=int, default=8, help="storm requests in flight at once (default 8)"
    )
    parser.add_argument(
        "--swap-period-ms",
        type=float,
        default=20.0,
        help="pause between the swap thread's requests (default 20)",
    )
    parser.add_argument(
        "--reap-args",
        default="",
        metavar='"FLAGS"',
        help="extra flags for the reap server only, shell-quoted (default none: the server's defaults)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("accept-out"), help="output folder (default ./accept-out)"
    )
    parser.add_argument(
        "--startup-timeout", type=float, default=900.0, help="seconds to wait for /health per server"
    )
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def split_remainder(args: argparse.Namespace) -> list[str]:
    """The vLLM arguments, with the options written after MODEL parsed into ``args``.

    Why: argparse's REMAINDER after a positional swallows every later option, so
    `accept MODEL --plan P -- ARGS` leaves `--plan P -- ARGS` in the remainder, while
    `accept --plan P MODEL -- ARGS` leaves `ARGS` alone (the `--` dropped). With a `--` left, what
    precedes it must be accept's own options; without one, accept's options are taken out and the
    rest are vLLM's."""
    rest = list(args.engine_args or [])
    parser = argparse.ArgumentParser(prog="reap-swap accept MODEL", add_help=False, allow_abbrev=False)
    _options(parser)
    if "--" in rest:
        cut = rest.index("--")
        parser.parse_args(rest[:cut], namespace=args)
        return rest[cut + 1 :]
    _, engine_args = parser.parse_known_args(rest, namespace=args)
    return engine_args


def run(args: argparse.Namespace) -> int:
    from reap_swap.bench import server_driver as serving
    from reap_swap.bench.accept import AcceptConfig, run_accept

    engine_args = split_remainder(args)
    try:
        reap_args = shlex.split(args.reap_args)
    except ValueError as exc:
        print(f"error: --reap-args: {exc}", file=sys.stderr)
        return 2
    cfg = AcceptConfig(
        model=args.model,
        out=args.out,
        plan=args.plan,
        engine_args=engine_args,
        reap_args=reap_args,
        prompts=args.prompts,
        tokens=args.tokens,
        storm=args.storm,
        storm_concurrency=args.storm_concurrency,
        swap_period_s=args.swap_period_ms / 1000,
        startup_timeout_s=args.startup_timeout,
        progress=args.progress,
    )
    serving.stop_servers_on_sigterm()  # an accept killed by `timeout` still stops its server
    return run_accept(cfg, "reap-swap " + " ".join(shlex.quote(a) for a in sys.argv[1:]))
