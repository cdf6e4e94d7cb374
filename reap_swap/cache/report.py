"""A simulation report as a markdown table, a per-layer table, a PNG plot, and the default-policy rule."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from reap_swap.cache.hybrid import SPLIT, TAILS
from reap_swap.cache.replay import POLICIES

MIB = 1 << 20
# Candidates for the server's --reap-cache default: device caches a plain client gets.
# The cache under a client's per-request swaps (hybrid.py): not a plain client's, so neither a
# candidate nor a competitor of the rule (``probe`` stays a competitor, as when the rule was set).
CLIENT_SWAP_POLICIES = frozenset({*TAILS, SPLIT})
ORACLES = ("belady", "belady-admit")  # offline bounds: neither candidates nor competitors
DEVICE_POLICIES = tuple(p for p in POLICIES if p not in ("static", "probe", *ORACLES, *CLIENT_SWAP_POLICIES))


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}"


def markdown_table(report: Mapping) -> str:
    lines = [
        "| budget | slots/layer | policy | selection hit % | expert hit % | decode expert hit % "
        "| admitted | prefetched | read-through steps | MiB moved |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        slots = "/".join(str(v) for v in row["slots"].values())
        head = f"| {row['budget']} | {slots} | {row['policy']} |"
        if row["status"] != "ok":
            lines.append(f"{head} refused: {row['reason']} | | | | | | |")
            continue
        t = row["totals"]
        lines.append(
            f"{head} {_pct(t['selection_hit_rate'])} | {_pct(t['expert_hit_rate'])} | "
            f"{_pct(t['decode_expert_hit_rate'])} | {t['admitted']:,} | {t['prefetched']:,} | "
            f"{t['read_through_steps']:,} | {t['bytes_moved'] / MIB:.1f} |"
        )
    return "\n".join(lines)


def layer_table(report: Mapping, metric: str = "expert_hit_rate") -> str:
    """One row per (budget, policy), one column per layer: ``metric`` in %."""
    ok = [r for r in report["rows"] if r["status"] == "ok"]
    if not ok:
        return ""
    layers = list(ok[0]["layers"])
    lines = [
        "| budget | policy | " + " | ".join(f"layer {l}" for l in layers) + " |",
        "|---|---|" + "---|" * len(layers),
    ]
    for r in ok:
        cells = " | ".join(_pct(r["layers"][l][metric]) for l in layers)
        lines.append(f"| {r['budget']} | {r['policy']} | {cells} |")
    return "\n".join(lines)


def _by_budget(report: Mapping, metric: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for r in report["rows"]:
        if r["status"] == "ok" and r["totals"][metric] is not None:
            out.setdefault(r["budget"], {})[r["policy"]] = r["totals"][metric]
    return out


def default_policy(
    reports: Sequence[Mapping],
    near: Sequence[str],
    everywhere: Sequence[str],
    *,
    metric: str = "expert_hit_rate",
    points: float = 3.0,
    candidates: Sequence[str] = DEVICE_POLICIES,
) -> dict:
    """The rule: within ``points`` of Belady at every budget in ``near`` and not below any other
    policy at every budget in ``everywhere``, on every report (trace). Returns each candidate's
    verdict and the reasons it fails."""
    verdicts = {}
    for cand in candidates:
        fails = []
        for i, rep in enumerate(reports):
            table = _by_budget(rep, metric)
            for b in near:
                row = table.get(b, {})
                if cand not in row or "belady" not in row:
                    fails.append(f"trace {i} budget {b}: {cand} or belady not simulated")
                elif 100 * (row["belady"] - row[cand]) > points:
                    fails.append(
                        f"trace {i} budget {b}: {100 * (row['belady'] - row[cand]):.1f} points below belady"
                    )
            for b in everywhere:
                row = table.get(b, {})
                better = [
                    p
                    for p, v in row.items()
                    if p not in (*ORACLES, cand)
                    and p not in CLIENT_SWAP_POLICIES
                    and cand in row
                    and v > row[cand] + 1e-12
                ]
                if cand not in row:
                    fails.append(f"trace {i} budget {b}: {cand} not simulated")
                elif better:
                    fails.append(f"trace {i} budget {b}: below {', '.join(sorted(better))}")
        verdicts[cand] = fails
    passing = [c for c, f in verdicts.items() if not f]
    return {"metric": metric, "passing": passing, "failures": verdicts}


def plot(report: Mapping, path: str | Path, title: str = "") -> None:
    """Hit rate (distinct experts, and selections) against the budget, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    for ax, metric, label in (
        (axes[0], "expert_hit_rate", "expert hit rate (distinct per step; Belady bounds it)"),
        (axes[1], "selection_hit_rate", "selection hit rate (the server's router-miss unit)"),
    ):
        series: dict[str, list[tuple[float, float]]] = {}
        for r in report["rows"]:
            if r["status"] == "ok" and r["totals"][metric] is not None:
                series.setdefault(r["policy"], []).append((r["budget_fraction"], 100 * r["totals"][metric]))
        for i, (policy, pts) in enumerate(series.items()):
            pts.sort()
            style = (
                {"color": "black", "linewidth": 2.5}
                if policy == "belady"
                else {"color": plt.cm.tab20(i % 20)}
            )
            ls = "--" if "seeded" in policy else (":" if policy.startswith("core+") else "-")
            ax.plot(
                [p[0] * 100 for p in pts],
                [p[1] for p in pts],
                marker="o",
                linestyle=ls,
                label=policy,
                **style,
            )
        ax.set_xlabel("budget, % of all expert bytes")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("hit rate, %")
    axes[1].legend(fontsize=8, loc="lower right")
    fig.suptitle(title or "device-cache policies in simulation", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
