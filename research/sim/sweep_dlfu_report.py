"""The tables of research-notes/olmoe/policy-sweep.md from sweep_dlfu_run.py's JSON files.

PYTHONPATH=$PWD .venv/bin/python research/sim/sweep_dlfu_report.py --dir /tmp/psweep
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep_dlfu_run import allocate  # noqa: E402

B = ("0.125", "0.25", "0.5")
SYN = [f"{m}-{s}" for m in ("mini", "skew", "skew12cpu", "skew12h200") for s in ("calibration", "heldout")]
OLM = ("olmoe-eval25", "olmoe-eval80", "olmoe-calib20")


def load(d: Path, name: str) -> dict:
    return orjson.loads((d / f"final-{name}.json").read_bytes())


def tri(rows: dict, name: str, metric: str) -> str:
    return " / ".join(f"{rows[b]['rows'][name][metric]:.4f}" for b in B)


def cell(r: dict, ds: str, name: str, metric: str = "selection_miss") -> str:
    return tri(r[ds]["budgets"], name, metric)


def delta(r: dict, ds: str, name: str, base: str, metric: str) -> str:
    v = r[ds]["budgets"]
    return " / ".join(f"{100 * (v[b]['rows'][name][metric] - v[b]['rows'][base][metric]):+.2f}" for b in B)


def tune_split(r: dict, name: str, b: str) -> float:
    """Files 45:100 of each domain (eval80 minus the subset: warm-started after files 20:45)."""
    e80, e25 = r["olmoe-eval80"]["budgets"][b]["rows"][name], r["olmoe-eval25"]["budgets"][b]["rows"][name]
    return 1 - (e80["selection_hits"] - e25["selection_hits"]) / (e80["selections"] - e25["selections"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, required=True)
    d = ap.parse_args(argv).dir
    p, inc, mk, fs = load(d, "params"), load(d, "inc"), load(d, "markov"), load(d, "foresight")
    curves = load(d, "curves")
    out = []
    w = out.append
    decays = (
        "0.5",
        "0.7",
        "0.8",
        "0.85",
        "0.9",
        "0.92",
        "0.94",
        "0.95",
        "0.96",
        "0.97",
        "0.98",
        "0.99",
        "0.995",
        "1",
    )
    # ---- A: OLMoE decay x start x slots (demand admission: the kernel today)
    w("### A. OLMoE, kernel parameters: decay x start x slots (miss ratio 12.5 / 25 / 50 %)\n")
    w(
        "| decay | seeded, plan slots (`dlfu-seeded`), subset | cold, uniform slots (`dlfu`), subset | "
        "pinned core, plan slots (`core+dlfu`), subset | seeded, calib. files 0:20 | seeded, eval. split 20:100 |"
    )
    w("|---|---|---|---|---|---|")
    for dc in decays:
        w(
            f"| {dc} | {cell(p, 'olmoe-eval25', f'seeded/demand/plan-slots/{dc}')} | "
            f"{cell(p, 'olmoe-eval25', f'cold/demand/uniform/{dc}')} | "
            f"{cell(p, 'olmoe-eval25', f'pinned/demand/plan-slots/{dc}')} | "
            f"{cell(p, 'olmoe-calib20', f'seeded/demand/plan-slots/{dc}')} | "
            f"{cell(p, 'olmoe-eval80', f'seeded/demand/plan-slots/{dc}')} |"
        )
    # ---- B: synthetic, decay of the default form
    for metric, title in (
        ("expert_miss", "expert miss (distinct experts per step: the metric 0.8 was tuned on)"),
        ("selection_miss", "selection miss (routed selections)"),
    ):
        w(
            f"\n### B. Synthetic traces, `dlfu-seeded` (plan slots), {title}: 0.8 absolute, other decays as points vs 0.8 (+ = worse)\n"
        )
        cols = ("0.9", "0.95", "0.96", "0.97", "0.99")
        w("| trace | 0.8 (today) | " + " | ".join(cols) + " |")
        w("|---|---|" + "---|" * len(cols))
        for ds in SYN + ["olmoe-eval25"]:
            base = "seeded/demand/plan-slots/0.8"
            w(
                f"| {ds} | {cell(p, ds, base, metric)} | "
                + " | ".join(delta(p, ds, f"seeded/demand/plan-slots/{c}", base, metric) for c in cols)
                + " |"
            )
    # ---- C: admission bit
    w("\n### C. Admission (`dlfu-admit`: one key bit dropped in the kernel), seeded, plan slots\n")
    w(
        "| trace | metric | demand 0.8 (today) | admit 0.8, points vs today | demand 0.96, points vs today | admit 0.96, points vs today |"
    )
    w("|---|---|---|---|---|---|")
    for ds in ["olmoe-eval25", *SYN]:
        metric = "selection_miss" if ds.startswith("olmoe") else "expert_miss"
        base = "seeded/demand/plan-slots/0.8"
        w(
            f"| {ds} | {metric} | {cell(p, ds, base, metric)} | {delta(p, ds, 'seeded/admit/plan-slots/0.8', base, metric)} | "
            f"{delta(p, ds, 'seeded/demand/plan-slots/0.96', base, metric)} | {delta(p, ds, 'seeded/admit/plan-slots/0.96', base, metric)} |"
        )
    # ---- D: per-layer decay, per-layer slots (host-side choices) on OLMoE
    w(
        "\n### D. OLMoE, per-layer choices made on the calibration files 0:20, scored on the subset / eval. split\n"
    )
    w(
        "| choice | budget | slots per layer | subset | eval. split 20:100 | same with one decay, uniform slots (subset / eval.) |"
    )
    w("|---|---|---|---|---|---|")
    for dc in ("0.8", "0.96"):
        for b, total in (("0.125", 128), ("0.25", 256), ("0.5", 512)):
            alloc = allocate(curves["olmoe-calib20"], dc, total, 64)
            layers = list(curves["olmoe-calib20"][f"{dc}/1"])
            res, uni = [], []
            for ev in ("olmoe-eval25", "olmoe-eval80"):
                c = curves[ev]
                sel = sum(c[f"{dc}/1"][l][0] for l in layers)
                mis = sum(
                    c[f"{dc}/{s}"][l][0] - c[f"{dc}/{s}"][l][1] for l, s in zip(layers, alloc, strict=True)
                )
                um = sum(c[f"{dc}/{total // 16}"][l][0] - c[f"{dc}/{total // 16}"][l][1] for l in layers)
                res.append(f"{mis / sel:.4f}")
                uni.append(f"{um / sel:.4f}")
            w(
                f"| slots by DP on calib. curves, cold `dlfu` {dc} | {b} | {alloc} | {res[0]} | {res[1]} | {' / '.join(uni)} |"
            )
    g = "seeded/demand/plan-slots"
    for b in B:
        cal = p["olmoe-calib20"]["budgets"][b]["rows"]
        names = [n for n in cal if n.startswith(g + "/")]
        layers = list(cal[names[0]]["layers"])
        pick = {
            l: min(names, key=lambda n, l=l: 1 - cal[n]["layers"][l][1] / cal[n]["layers"][l][0])
            for l in layers
        }
        res = []
        for ev in ("olmoe-eval25", "olmoe-eval80"):
            er = p[ev]["budgets"][b]["rows"]
            sel = sum(er[pick[l]]["layers"][l][0] for l in layers)
            hit = sum(er[pick[l]]["layers"][l][1] for l in layers)
            res.append(f"{1 - hit / sel:.4f}")
        decs = ",".join(pick[l].rsplit("/", 1)[1] for l in layers)
        w(
            f"| decay per layer (best on calib.), `dlfu-seeded` | {b} | plan slots; decays {decs} | {res[0]} | {res[1]} | |"
        )
    # ---- E: kernel changes
    w("\n### E. Kernel changes, OLMoE (miss ratio 12.5 / 25 / 50 %; table and weights from files 0:20)\n")
    w("| policy | subset | eval. split 20:100 | files 45:100 (tuning split) 50 % |")
    w("|---|---|---|---|")
    rows = ["seeded/demand/plan-slots/0.8", "seeded/demand/plan-slots/0.96"]
    rows += [
        f"markov{x}/{a}/plan-slots/{dc}"
        for x in ("4", "8", "16", "32")
        for a in ("demand", "admit")
        for dc in ("0.8", "0.94", "0.96")
    ]
    for n in rows:
        w(
            f"| {n} | {cell(mk, 'olmoe-eval25', n)} | {cell(mk, 'olmoe-eval80', n)} | {tune_split(mk, n, '0.5'):.4f} |"
        )
    best = {
        b: min(
            (n for n in mk["olmoe-eval25"]["budgets"][b]["rows"] if n.startswith("markov")),
            key=lambda n, b=b: tune_split(mk, n, b),
        )
        for b in B
    }
    w(
        "\nbest markov row on the tuning split (files 45:100), per budget: "
        + "; ".join(
            f"{float(b) * 100:g} % {n}: subset {mk['olmoe-eval25']['budgets'][b]['rows'][n]['selection_miss']:.4f}"
            for b, n in best.items()
        )
    )
    w(
        "\nstep increment capped at min(selections, cap) (kernel change), subset / synthetic expert miss vs today (points):\n"
    )
    w("| variant | OLMoE subset | " + " | ".join(SYN) + " |")
    w("|---|---|" + "---|" * len(SYN))
    for n in (
        "seeded/demand/plan-slots/0.96",
        "seeded-cap1/demand/plan-slots/0.9",
        "seeded-cap1/demand/plan-slots/0.96",
        "seeded-cap4/demand/plan-slots/0.96",
    ):
        w(
            f"| {n} | {cell(inc, 'olmoe-eval25', n)} | "
            + " | ".join(delta(inc, ds, n, "seeded/demand/plan-slots/0.8", "expert_miss") for ds in SYN)
            + " |"
        )
    w("\nmarkov rows on the synthetic traces, expert miss vs today (points; table from the other split):\n")
    w("| variant | " + " | ".join(SYN) + " |")
    w("|---|" + "---|" * len(SYN))
    for n in (
        "markov16/admit/plan-slots/0.8",
        "markov8/demand/plan-slots/0.96",
        "markov16/demand/plan-slots/0.96",
        "markov8/admit/plan-slots/0.94",
    ):
        w(
            f"| {n} | "
            + " | ".join(delta(mk, ds, n, "seeded/demand/plan-slots/0.8", "expert_miss") for ds in SYN)
            + " |"
        )
    # ---- F: foresight references
    w("\n### F. References (not servable): exact next-k-step routing ranks first, OLMoE subset\n")
    w("| reference | demand admission | admission control |")
    w("|---|---|---|")
    for k in ("1", "2", "4"):
        for extra in ("", "+markov8"):
            n = f"foresight{k}{extra}"
            w(
                f"| {n} (rest by dlfu 0.96{' + markov 8' if extra else ''}) | {cell(fs, 'olmoe-eval25', n + '/demand/plan-slots/0.96')} | "
                f"{cell(fs, 'olmoe-eval25', n + '/admit/plan-slots/0.96')} |"
            )
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
