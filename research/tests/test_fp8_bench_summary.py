"""research/gpu/fp8_bench_summary.py on a real merged report (moved from tests/test_skewed_fp8.py)."""

from __future__ import annotations

from pathlib import Path

from harness_modules import load_script


def test_summary_table_from_run_3s_merged_bench(tmp_path):
    """The summariser on a real merged report (run 3's bf16 skewed bench): the ratios research.md states."""
    summ = load_script("fp8_bench_summary")
    src = Path(__file__).resolve().parents[2] / "research-notes/h200-2026-11-30/bench-skew.json"
    assert summ.main([str(src), "--out", str(tmp_path)]) == 0
    md = (tmp_path / "fp8_bench.md").read_text()
    assert "3.29x (1 stream), 3.24x (8 streams)" in md and "2.57x (1 stream), 2.27x" in md
    assert "| stock-uva@6.75GiB | 6.75 GiB (50.0 %) | 6.750 GiB (50.0 %) | 0.500 (derived)" in md
    assert (tmp_path / "fp8_bench.png").stat().st_size > 1000
    reap = {"arm": "plan-swap", "reap_status": {"workers": [{"engine": {"pool_hbm_bytes": 6 * 2**20}}]}}
    assert summ.expert_hbm(reap, 10) == 6 * 2**20
