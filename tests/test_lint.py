"""The habits that keep the tree as it is: ruff format, ruff lint and the import contracts.

The tools come from the environment running the tests (the dev extras pin ruff and add
import-linter); a tool that is not installed skips its test, naming what to install.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed beside {sys.executable}: pip install -e '.[dev]'")
    return found


def _run(cmd: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, **env}
    )


def test_ruff_format():
    res = _run([_tool("ruff"), "format", "--check", "."])
    assert res.returncode == 0, (
        f"ruff format would change files (run `ruff format .`):\n{res.stdout}{res.stderr}"
    )


def test_ruff_check():
    res = _run([_tool("ruff"), "check", "."])
    assert res.returncode == 0, f"ruff check found problems:\n{res.stdout}{res.stderr}"


def test_import_contracts(tmp_path):
    lint = _tool("lint-imports")
    cmd = [lint, str(ROOT / ".importlinter"), "--no-cache"]
    res = _run(cmd, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    assert res.returncode == 0, f"import contracts broken:\n{res.stdout}{res.stderr}"
