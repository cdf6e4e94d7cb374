"""research/gpu/gpu_summarize.py on the committed H200 results (research-notes/h200-2026-11-30)."""

import shutil
import sys
from pathlib import Path

from harness_modules import load_script

ROOT = Path(__file__).resolve().parents[2]
NOTES = ROOT / "research-notes" / "h200-2026-11-30"


def _summarize(tmp_path, files: dict[str, str], capsys) -> str:
    for sub, name in files.items():
        (tmp_path / sub).mkdir()
        shutil.copy(NOTES / name, tmp_path / sub / "gpu_e2e.json")
    mod = load_script("gpu_summarize")
    argv = sys.argv
    sys.argv = ["gpu_summarize.py", str(tmp_path), "--json", str(tmp_path / "derived.json")]
    try:
        assert mod.main() == 0
    finally:
        sys.argv = argv
    return capsys.readouterr().out


def test_run3_tables(tmp_path, capsys):
    out = _summarize(
        tmp_path,
        {"e2e0": "run3-lane0-e2e.json", "e2e1": "run3-lane1-e2e.json", "tp": "run3-tp2-e2e.json"},
        capsys,
    )
    assert "| reap-sweep 50 % | 8/8 |" in out
    assert "| 50 % | 0.509 | 110.7 (102.0–113.0) | 99.5 | 1.112 |" in out
    assert "| 1GiB | 114 | 1,075,838,976 |" in out
    assert (
        "fault_swap: HTTP 500" in out
        and "status_after_fault: signature 32cf2372a05a66e4, consistent True" in out
    )
    assert (tmp_path / "derived.json").exists()


def test_run4_counters_equal(tmp_path, capsys):
    out = _summarize(tmp_path, {"e2e0": "run4-clean-e2e.json", "e2e1": "run4-counters-e2e.json"}, capsys)
    assert "all requests equal: **True**" in out
    assert "reap-swap at 100 % / stock: 0.946 (1 stream), 1.006 (8 streams)" in out


def test_probe_section_counts_bitwise_equal_layers_per_rank():
    mod = load_script("gpu_summarize")

    def rank(i, d1="a"):
        return {"tp_rank": i, "inputs": {"1": "x"}, "layers": {"L0": {"1": d1}, "L1": {"1": "b"}}}

    ref = {"ranks": [rank(0), rank(1)]}
    lines = mod.probe_section(
        ref,
        [
            ("same", {"ranks": [rank(0), rank(1)]}),
            ("off", {"ranks": [rank(0, "z"), rank(1, "z")]}),
            ("dead", {"ranks": None, "error": {"text": "boom"}}),
        ],
    )
    text = "\n".join(lines)
    assert "| same | 0 | 2/2 |  | True |" in text and "| same | 1 | 2/2 |  | True |" in text
    assert "| off | 1 | 1/2 | L0@1 | True |" in text
    assert "| dead | | failed:" in text
    assert mod.probe_section(None, []) == ["(no reference probe)"]


def test_run6_tp2_tables(tmp_path, capsys):
    out = _summarize(tmp_path, {"tp": "run6-tp2-e2e.json"}, capsys)
    assert "| reap-tp after_fault | 1 | 48/48 |  | True |" in out
    assert "| after_fault | 8/8 |" in out and "| stock-uva-half | 8/8 |" in out
    assert "swap 25 % -> 50 % (server ms): [80.5, 80.0, 81.3]" in out
    assert "stock UVA TP=2 with half the expert bytes offloaded: 183.5 (183.3–184.3)" in out
    assert "all requests equal: **True**" in out
