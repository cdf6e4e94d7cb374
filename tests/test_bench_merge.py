"""`reap-swap bench --merge`: reports of one model/plan/prompts (e.g. one per GPU) become one report."""

import copy
import json
from pathlib import Path

import pytest

from reap_swap.bench import config as bench_config
from reap_swap.bench import env as bench_env
from reap_swap.bench import markdown as bench_markdown
from reap_swap.bench import merge as bench_merge
from reap_swap.cli import bench as bench_cmd

FIXTURE = Path(__file__).resolve().parents[1] / "research-notes" / "bench-mini-cpu.json"


def _split():
    """The committed CPU bench (two budgets in one run) as two single-budget reports."""
    full = json.loads(FIXTURE.read_text())
    a, b = copy.deepcopy(full), copy.deepcopy(full)
    small, large = sorted({r["budget_bytes"] for r in full["runs"] if r.get("budget_bytes")})
    a["runs"] = [dict(r, label=r["arm"]) for r in full["runs"] if r.get("budget_bytes") in (None, small)]
    b["runs"] = [dict(r, label=r["arm"]) for r in full["runs"] if r.get("budget_bytes") == large]
    return full, a, b


def test_merge_relabels_budgets_and_recompares():
    full, a, b = _split()
    merged = bench_merge.merge_reports([a, b], "reap-swap bench --merge a b --out m")
    assert sorted(r["label"] for r in merged["runs"]) == sorted(r["label"] for r in full["runs"])
    assert merged["summary"]["reference"] == "plan-static"  # first successful run (resident was skipped)
    for run in merged["runs"]:
        if run["status"] == "ok":
            assert run["greedy_vs_ref"]["of"] == len(full["prompts"])
    assert len(merged["merged_from"]) == 2 and merged["command"].startswith("reap-swap bench --merge")
    assert set(merged["summary"]["ratios"]) == set(full["summary"]["ratios"])


def test_merge_refuses_different_plans():
    _, a, b = _split()
    b["plan"] = dict(b["plan"], identity="something-else")
    with pytest.raises(bench_config.BenchError, match="plan identity"):
        bench_merge.merge_reports([a, b], "x")


def test_merge_refuses_duplicate_labels():
    _, a, _ = _split()
    with pytest.raises(bench_config.BenchError, match="same label"):
        bench_merge.merge_reports([a, copy.deepcopy(a)], "x")


def test_cli_merge_writes_table_and_plot(tmp_path, capsys):
    _, a, b = _split()
    for name, rep in (("a", a), ("b", b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "bench.json").write_text(json.dumps(rep))
    parser = __import__("argparse").ArgumentParser()
    bench_cmd.add_arguments(parser)
    args = parser.parse_args(
        ["--merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "m")]
    )
    assert bench_cmd.run(args) == 0
    assert (tmp_path / "m" / "bench.md").read_text().count("plan-swap@") >= 2
    assert (tmp_path / "m" / "bench.png").stat().st_size > 0


def test_cli_without_model_or_merge_is_an_error(capsys):
    parser = __import__("argparse").ArgumentParser()
    bench_cmd.add_arguments(parser)
    assert bench_cmd.run(parser.parse_args([])) == 2
    assert "--model" in capsys.readouterr().err


def test_merged_markdown_lists_its_sources():
    _, a, b = _split()
    text = bench_markdown.markdown_report(
        bench_merge.merge_reports([a, b], "reap-swap bench --merge a b --out m")
    )
    assert text.count("merged from:") == 2


def test_visible_gpu_ids(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert bench_env.visible_gpu_ids() == ["--id=1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert bench_env.visible_gpu_ids() == ["--id=0,1"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert bench_env.visible_gpu_ids() == []
