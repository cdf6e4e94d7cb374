"""Every vLLM import and vLLM-private attribute lives in reap_swap/compat/ (issue 14, item 2).

A grep, not an import graph: it also catches lazy imports inside functions and private attributes
reached through getattr strings, which an import linter cannot see.
"""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "reap_swap"
COMPAT = PACKAGE / "compat"
# `import vllm`, `import vllm.x as y`, `from vllm import`, `from vllm.x import` (not `vllm_config`)
VLLM_IMPORT = re.compile(r"^\s*(?:import\s+vllm\b(?!_)|from\s+vllm(?:\.|\s))", re.MULTILINE)
# vLLM marks its own attributes on torch objects `_vllm_*` (not `current_vllm_config`)
PRIVATE_ATTR = re.compile(r"(?<![A-Za-z0-9])_vllm_\w+")


def _offenders(pattern: re.Pattern[str]) -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if COMPAT in path.parents:
            continue
        text = path.read_text(encoding="utf-8")
        for m in pattern.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            out.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {text.splitlines()[line - 1].strip()}")
    return out


def test_patterns_match_what_they_should():
    assert VLLM_IMPORT.search("    from vllm import LLM") and VLLM_IMPORT.search("import vllm")
    assert VLLM_IMPORT.search("from vllm.inputs import TokensPrompt")
    assert not VLLM_IMPORT.search("from vllm_config import x") and not VLLM_IMPORT.search("import vllm_x")
    assert not VLLM_IMPORT.search("# uses vllm's import machinery")
    assert PRIVATE_ATTR.search('getattr(w, "_vllm_is_uva_offloaded")') and PRIVATE_ATTR.search(
        "w._vllm_x = 1"
    )
    assert not PRIVATE_ATTR.search("compat.current_vllm_config()")


def test_only_compat_imports_vllm():
    assert _offenders(VLLM_IMPORT) == [], "import vLLM through reap_swap/compat/ only"


def test_only_compat_touches_vllm_private_attributes():
    assert _offenders(PRIVATE_ATTR) == [], "vLLM's private attributes (_vllm_*) belong in reap_swap/compat/"
