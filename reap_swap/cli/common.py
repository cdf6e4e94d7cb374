"""What several subcommands share: their JSON output and the API key a client subcommand sends."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import orjson


def json_bytes(obj: Any) -> bytes:
    """Indented JSON with a final newline (what every --json output and report file holds)."""
    return orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE)


def print_json(obj: Any) -> None:
    sys.stdout.buffer.write(json_bytes(obj))
    sys.stdout.flush()


def api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else $VLLM_API_KEY (vLLM's own variable for the same key)."""
    return args.api_key or os.environ.get("VLLM_API_KEY")
