"""The shape a newcomer reads (issue 43's limits): packages by concept, small files, no run log in
the code, a short README, scripts/ for setup, test data and the demo only."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "reap_swap"
SOURCES = sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def test_at_most_twelve_entries_directly_under_the_package():
    entries = sorted(p.name for p in PKG.iterdir() if p.name != "__pycache__")
    assert len(entries) <= 12, entries


def test_every_package_says_what_it_is_responsible_for():
    for init in PKG.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc.splitlines()[0]) > 20, f"{init.relative_to(ROOT)}: no one-line responsibility"


def test_no_module_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in SOURCES if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long


def test_no_measurement_run_cited_in_the_package():
    # run numbers, dates and issue numbers belong in research.md and docs/, not in code or --help
    cite = re.compile(r"\b[Rr]uns? \d+\b|\b20\d\d-\d\d-\d\d\b|\bissue \d+\b")
    found = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()[:80]}"
        for p in SOURCES
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if cite.search(line)
    ]
    assert not found, found


def test_scripts_hold_setup_test_data_and_the_demo_only():
    files = [p for p in (ROOT / "scripts").iterdir() if p.is_file()]
    assert len(files) <= 15, sorted(p.name for p in files)


def test_readme_is_at_most_3000_words():
    assert len((ROOT / "README.md").read_text().split()) <= 3000
