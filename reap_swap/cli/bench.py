"""Benchmark a plan against stock vLLM on this machine: one server per arm, same prompts, one report.

usage: reap-swap bench --model M --plan P --prompts FILE [--arms a,b,...] [--budget-gib G ...]
                       [--batch N] [--repeats R] [--out DIR] [-- vLLM engine args]
       reap-swap bench --merge DIR [DIR ...] --out DIR

Arms, run in turn (never two servers at once; each server's process group is killed and checked
gone before the next starts):
  resident     stock vLLM, all experts in GPU memory
  stock-uva    stock vLLM UVA offload with the budget's GPU memory for experts
               (--cpu-offload-gb = expert GiB - budget GiB, --cpu-offload-params w13_weight w2_weight)
  plan-static  reap-swap server, the plan's core resident, no swaps
  plan-swap    reap-swap server + the client's per-request selection (--strategy)

Per arm: TTFT, prefill tok/s, decode tok/s (1 stream and --batch), router hit rate (server
counters for the reap arms; derived for the stock arms), bytes copied by swaps, swap latency,
peak GPU memory, greedy outputs compared per prompt. One warm-up request is discarded; timings
are medians [min-max] of --repeats. Without CUDA the timing arms are skipped (the reap arms run
in accounting mode: hit rates and outputs). Writes DIR/bench.json, bench.md, bench.png.
--merge combines bench.json files of the same model, plan and prompts (e.g. one bench per GPU,
one budget each, run at the same time) into one report, table and plot.
Exit 0 when every started arm succeeded, 1 when one failed, 2 for unusable arguments.
The method and arms in detail: reap_swap/bench/run.py.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from reap_swap.bench.config import ARMS, DEFAULT_ARMS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _input_arguments(parser)
    _measurement_arguments(parser)
    parser.add_argument(
        "engine_args",
        nargs=argparse.REMAINDER,
        metavar="-- VLLM_ARGS",
        help="vLLM engine arguments for every arm, after --",
    )


def _input_arguments(parser: argparse.ArgumentParser) -> None:
    """What to bench: model, plan, prompts, arms, budgets, output (or reports to merge)."""
    parser.add_argument("--model", help="model folder (or hub id) that every arm serves (required)")
    parser.add_argument("--plan", type=Path, help="reap-swap plan JSON for the reap arms (required)")
    parser.add_argument(
        "--prompts",
        type=Path,
        help="JSONL, one {'messages': [...]} or {'prompt'|'text': ...} per line (as for observe; required)",
    )
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        metavar="DIR",
        help="merge the bench.json of these output folders into --out; runs nothing",
    )
    parser.add_argument(
        "--arms",
        default=",".join(DEFAULT_ARMS),
        help=f"comma-separated, run in this order, of {','.join(ARMS)} (default {','.join(DEFAULT_ARMS)}: "
        "the cache arms run when named)",
    )
    parser.add_argument(
        "--budget-gib",
        type=float,
        nargs="+",
        metavar="G",
        help="GPU memory for experts; stock-uva and plan-swap run once per value "
        "(default: the plan's budget)",
    )


def _measurement_arguments(parser: argparse.ArgumentParser) -> None:
    """How each arm is measured."""
    parser.add_argument(
        "--batch", type=int, default=4, help="concurrent streams of the batch measurement (default 4)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per arm (default 3)")
    parser.add_argument(
        "--out", type=Path, default=Path("bench-out"), help="output folder (default ./bench-out)"
    )
    parser.add_argument(
        "--strategy", default="prior", help="plan-swap selection: static, prior or probe (default prior)"
    )
    parser.add_argument(
        "--refresh-every",
        type=int,
        metavar="N",
        help="plan-swap: stream the greedy requests and consider a decode refresh every N chunks",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=32, help="tokens of each greedy output (default 32)"
    )
    parser.add_argument(
        "--decode-tokens", type=int, default=128, help="tokens of each timed stream (default 128)"
    )
    parser.add_argument(
        "--max-prompts", type=int, default=8, help="use the first N prompts of the file (default 8)"
    )
    parser.add_argument(
        "--prompt-chars", type=int, default=2000, help="cut text prompts to this many characters"
    )
    parser.add_argument(
        "--timings",
        choices=("auto", "on", "off"),
        default="auto",
        help="auto (default): measure timings only with CUDA; on: also on the CPU build",
    )
    parser.add_argument(
        "--startup-timeout", type=float, default=900.0, help="seconds to wait for /health per arm"
    )
    parser.add_argument(
        "--prefix-caching",
        action="store_true",
        help="leave vLLM's prefix caching on (default off: the same prompts are sent repeatedly)",
    )
    parser.add_argument(
        "--measure-lock",
        type=Path,
        help="take this file lock (flock) once a server is up and hold it until it stops: benches "
        "started side by side on one GPU overlap their start-ups but measure one at a time",
    )
    parser.add_argument(
        "--cache-device",
        choices=("on", "off"),
        default="on",
        help="plan-cache / plan-swap+cache on CUDA: pass --reap-cache-device on (default on; off: "
        "the server's default, where the cache does not engage on CUDA)",
    )
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def engine_args(values: list[str] | None) -> list[str]:
    """argparse keeps the separating '--' in a REMAINDER list on some Python versions."""
    values = list(values or [])
    return values[1:] if values and values[0] == "--" else values


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from reap_swap.bench.config import BenchConfig
    from reap_swap.bench.run import run_bench

    if args.merge:
        return merge(args)
    missing = [f"--{name}" for name in ("model", "plan", "prompts") if getattr(args, name) is None]
    if missing:
        print(f"error: {', '.join(missing)} required (or --merge DIR ...)", file=sys.stderr)
        return 2
    try:
        cfg = BenchConfig(
            model=args.model,
            plan=args.plan,
            prompts=args.prompts,
            out=args.out,
            arms=[a.strip() for a in args.arms.split(",") if a.strip()],
            budget_gib=args.budget_gib,
            batch=args.batch,
            repeats=args.repeats,
            max_tokens=args.max_tokens,
            decode_tokens=args.decode_tokens,
            max_prompts=args.max_prompts,
            prompt_chars=args.prompt_chars,
            strategy=args.strategy,
            refresh_every=args.refresh_every,
            timings=args.timings,
            startup_timeout_s=args.startup_timeout,
            prefix_caching=args.prefix_caching,
            measure_lock=args.measure_lock,
            cache_device=args.cache_device,
            progress=args.progress,
            engine_args=engine_args(args.engine_args),
        )
    except ValidationError as exc:
        for e in exc.errors():
            where = "--" + "-".join(str(p) for p in e["loc"] if isinstance(p, str)).replace("_", "-")
            print(f"error: {where}: {e['msg']}", file=sys.stderr)
        return 2
    if shutil.which("pgrep") is None:
        print("error: pgrep (procps) is needed to check that every server process is gone", file=sys.stderr)
        return 2
    from reap_swap.bench import server_driver as serving

    serving.stop_servers_on_sigterm()  # a bench killed by `timeout` still stops its server
    return run_bench(cfg)


def merge(args: argparse.Namespace) -> int:
    import orjson

    from reap_swap.bench.config import BenchError
    from reap_swap.bench.merge import merge_reports, write_outputs

    reports = []
    for folder in args.merge:
        path = folder / "bench.json"
        try:
            reports.append(orjson.loads(path.read_bytes()))
        except (OSError, orjson.JSONDecodeError) as exc:
            print(f"error: --merge {path}: {exc}", file=sys.stderr)
            return 2
    try:
        report = merge_reports(reports, "reap-swap " + " ".join(sys.argv[1:]))
    except BenchError as exc:
        print(f"error: --merge: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    write_outputs(report, args.out)
    print(f"bench: merged {len(reports)} reports into {args.out / 'bench.md'}", file=sys.stderr)
    return 0
