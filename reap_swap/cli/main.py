"""The ``reap-swap`` console script: one argparse subcommand per module, imported lazily.

Why lazy: ``validate`` must start in a blink on a machine without torch, while ``observe`` or
``bench`` import vLLM. Only the chosen subcommand's module is imported; ``--help`` lists them all
from the registry below without importing any.

Adding a subcommand (e.g. ``observe``): write a module that defines

    def add_arguments(parser: argparse.ArgumentParser) -> None: ...
    def run(args: argparse.Namespace) -> int: ...    # the process exit code

Its module docstring becomes the subcommand's ``--help`` text. Then add one line to ``COMMANDS``:
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from reap_swap import __version__

# name -> (module, one-line help). Keep alphabetical; one line per subcommand.
COMMANDS: dict[str, tuple[str, str]] = {
    "accept": (
        "reap_swap.cli.accept",
        "acceptance run on this card: reap-swap's output against stock vLLM, bit for bit, under swaps",
    ),
    "bench": (
        "reap_swap.cli.bench",
        "stock vLLM vs UVA offload vs the plan, one server per arm: speed, hit rate, outputs",
    ),
    "chat": (
        "reap_swap.cli.chat",
        "run one chat request end to end: select, swap, complete, print misses",
    ),
    "evaluate": (
        "reap_swap.cli.evaluate",
        "coverage of a plan on held-out observations (core, slices, oracles)",
    ),
    "observe": (
        "reap_swap.engine.observer",
        "run a corpus through vLLM and record routing per layer, tag and request",
    ),
    "plan": (
        "reap_swap.cli.plan",
        "build a plan from observation files (ours or REAP's) within a budget",
    ),
    "select": (
        "reap_swap.cli.select",
        "choose the active set for a prompt (static, prior, probe); print the payload",
    ),
    "simulate": (
        "reap_swap.cli.simulate",
        "replay a routing trace under device-cache policies: hits, misses, bytes moved, Belady",
    ),
    "validate": (
        "reap_swap.cli.validate",
        "check a plan file: schema, semantics, optionally a model's shape",
    ),
}


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """Every subcommand is listed; only ``selected`` gets its module imported and arguments added."""
    parser = argparse.ArgumentParser(prog="reap-swap", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"reap-swap {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        if name == selected:
            module = importlib.import_module(module_name)
            command.description = (module.__doc__ or help_text).strip()
            command.formatter_class = argparse.RawDescriptionHelpFormatter
            module.add_arguments(command)
            command.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    selected = next((arg for arg in argv if not arg.startswith("-")), None)
    args = build_parser(selected if selected in COMMANDS else None).parse_args(argv)
    try:
        return args.run(args)
    except BrokenPipeError:  # `... | head` closed the pipe: no traceback, but the output was cut short
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
