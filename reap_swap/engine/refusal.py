"""A worker's load-time refusal, handed to the launcher through a file.

The refusal happens in a worker (inside vLLM's load_model), where the launcher cannot catch it: the
worker writes its message to a file whose path is in the environment (inherited by the engine and
worker processes); the launcher prints it as its one error line and exits 1.
"""

from __future__ import annotations

import os
from pathlib import Path

# Not REAP_* on purpose: settings.py refuses unknown REAP_* variables; this one is internal.
REFUSAL_ENV = "REAPSWAP_REFUSAL_FILE"


class BudgetRefused(RuntimeError):
    """--reap-budget cannot be served here; the message carries the numbers."""


def arm_refusal_file(run_dir: Path, environ: dict = os.environ) -> Path:  # noqa: B006 - the process env
    """Before the engine starts: where a worker's refusal will be written (an empty file now)."""
    path = Path(run_dir) / f"reap-swap-refusal-{os.getpid()}.txt"
    path.write_text("")
    environ[REFUSAL_ENV] = str(path)
    return path


def record_refusal(message: str, environ: dict = os.environ) -> None:  # noqa: B006
    """In a worker: append the refusal for the launcher (no-op when no launcher armed the file)."""
    path = environ.get(REFUSAL_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(message.replace("\n", " ") + "\n")


def read_refusal(path: Path | None) -> str | None:
    """In the launcher, after the engine failed: the first refusal a worker wrote, else None."""
    try:
        lines = [line for line in Path(path).read_text().splitlines() if line.strip()] if path else []
    except OSError:
        return None
    return lines[0] if lines else None
