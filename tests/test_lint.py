"""The habits that keep the tree as it is: ruff format, ruff lint and the import contracts.

The tools come from the environment running the tests (the dev extras pin ruff and add
import-linter); a tool that is not installed skips its test, naming what to install.
"""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# Pure modules written by another helper: they join the pure-core contract once they exist
# (import-linter refuses a contract that names a missing module).
OPTIONAL_PURE = ("reap_swap.trace", "reap_swap.simulate")
# Contracts the lead enables once the other helpers' changes are merged (see .importlinter).
PENDING = ("vllm-only-in-compat", "no-cycles")


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


def _exists(module: str) -> bool:
    """In this checkout (not wherever else the package might resolve to)."""
    path = ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _contracts(tmp_path: Path) -> tuple[Path, list[str]]:
    """.importlinter with the optional pure modules that exist added to the pure core; the ids of
    the contracts to check now."""
    config = configparser.ConfigParser()
    config.read(ROOT / ".importlinter")
    section = "importlinter:contract:pure-core"
    present = [m for m in OPTIONAL_PURE if _exists(m)]
    config[section]["source_modules"] += "".join(f"\n{m}" for m in present)
    path = tmp_path / "importlinter.ini"
    with path.open("w") as f:
        config.write(f)
    ids = [
        s.removeprefix("importlinter:contract:")
        for s in config.sections()
        if s.startswith("importlinter:contract:")
    ]
    return path, [i for i in ids if i not in PENDING]


def test_import_contracts(tmp_path):
    lint = _tool("lint-imports")
    path, ids = _contracts(tmp_path)
    cmd = [lint, str(path), "--no-cache", "--no-logo"] + [a for i in ids for a in ("--contract", i)]
    res = _run(cmd, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    assert res.returncode == 0, f"import contracts broken:\n{res.stdout}{res.stderr}"
