"""Comparing greedy outputs between arms, merging several benches' reports, writing the outputs.

Why merge: on a machine with several GPUs an operator may run one bench per GPU at once (say one
budget each, with CUDA_VISIBLE_DEVICES); each bench still starts one server at a time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import orjson

from reap_swap.bench import server_driver as serving
from reap_swap.bench.config import BenchError
from reap_swap.bench.markdown import markdown_report
from reap_swap.bench.plot import plot
from reap_swap.bench.report import GIB, summarize_runs


def compare_outputs(ref: Sequence[Mapping], got: Sequence[Mapping]) -> dict:
    """Token-by-token when both sides have tokens, else character-by-character on the text."""
    if all(r.get("tokens") for r in ref) and all(g.get("tokens") for g in got):
        return {**serving.compare(ref, got), "compared_on": "tokens"}

    def chars(outputs):
        return [{"tokens": list(x.get("text") or "")} for x in outputs]

    return {
        **serving.compare(chars(ref), chars(got)),
        "compared_on": "text characters (no token logprobs in this mode)",
    }


def merge_reports(reports: Sequence[Mapping], command: str) -> dict:
    """Several bench.json of the same model, plan and prompts -> one report (table, ratios, plot).

    Why: on a machine with several GPUs an operator may run one bench per GPU at once (say one
    budget each, with CUDA_VISIBLE_DEVICES); each bench still starts one server at a time. The
    merged report relabels budget-dependent runs with their budget when there are several,
    re-compares every greedy output with one reference (the first `resident` run, else the first
    successful run) and recomputes the cross-run ratios. Each source's command is kept.
    """
    if not reports:
        raise BenchError("nothing to merge")
    first = reports[0]
    for key, get in (
        ("model", lambda r: (r.get("model") or {}).get("path")),
        ("plan identity", lambda r: (r.get("plan") or {}).get("identity")),
        ("prompts", lambda r: orjson.dumps(r.get("prompts"))),
    ):
        values = {get(r) for r in reports}
        if len(values) != 1:
            raise BenchError(f"cannot merge reports with different {key}")
    runs = [dict(run) for r in reports for run in r.get("runs", [])]
    budgets = {
        run.get("budget_bytes") for run in runs if run.get("budget_dependent") and run.get("budget_bytes")
    }
    for run in runs:
        if len(budgets) > 1 and run.get("budget_dependent") and run.get("budget_bytes"):
            run["label"] = f"{run['arm']}@{run['budget_bytes'] / GIB:.4g}GiB"
    labels = [run["label"] for run in runs]
    if len(set(labels)) != len(labels):
        raise BenchError(f"runs with the same label in the merged reports: {sorted(labels)}")
    ok = [run for run in runs if run.get("status") == "ok"]
    ref = next((run for run in ok if run["arm"] == "resident"), ok[0] if ok else None)
    for run in ok:
        run["greedy_vs_ref"] = compare_outputs(ref["greedy"], run["greedy"])
    merged = {k: v for k, v in first.items() if k not in ("runs", "summary")}
    merged.update(
        command=command,
        argv=None,
        runs=runs,
        merged_from=[
            {k: r.get(k) for k in ("command", "started_at", "finished_at", "environment")} for r in reports
        ],
        started_at=min(str(r.get("started_at")) for r in reports),
        finished_at=max(str(r.get("finished_at")) for r in reports),
    )
    merged["summary"] = summarize_runs(runs, ref["label"] if ref else None)
    return merged


def write_outputs(report: Mapping, out: Path) -> None:
    (out / "bench.json").write_bytes(
        orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS)
    )
    (out / "bench.md").write_text(markdown_report(report) + "\n")
    plot(report, out / "bench.png")
