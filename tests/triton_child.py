"""Run a test file's Triton tests in a child pytest under TRITON_INTERPRET=1 (CPU).

Triton decides at decoration time whether a @triton.jit function is interpreted, so the variable
must be set before the kernel module is imported: the parent test only starts the child."""

from __future__ import annotations

import os
import subprocess
import sys

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def run_child_pytest(path: str) -> None:
    """Every test of `path` must pass (none skipped) in the interpreted child."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], run.stdout[-2000:]
