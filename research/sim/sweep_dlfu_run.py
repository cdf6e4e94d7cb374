"""The parameter sweep of research-notes/olmoe/policy-sweep.md: what the device kernel's policy
(``dlfu``) can express by parameters -- decay, start (cold / seeded / pinned core), slot allocation
(the plan's core+tail / uniform), plus the one-bit admission variant -- on the OLMoE decode traces
and on the synthetic traces the decay was tuned on, at 12.5 / 25 / 50 %.

    PYTHONPATH=$PWD nice -n 19 .venv/bin/python research/sim/sweep_dlfu_run.py --out /tmp/psweep/sweep.json

Replays with sweep_dlfu.replay (checked equal to ``reap-swap simulate`` count for count by
``sweep_dlfu.py --check``). The OLMoE traces and plans live under /tmp/olmoe (research-notes/olmoe/
olmoe.md says how to regenerate them); the synthetic ones are committed under data/traces and
research-notes/cache-sim.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import orjson

from reap_swap.cache.replay import parse_budget
from reap_swap.cache.trace import load_trace
from reap_swap.plan.document import load_plan
from reap_swap.sizing.cache_tail import layer_slots

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep_dlfu import Config, add, rates, replay  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OL = Path("/tmp/olmoe")
CS = ROOT / "research-notes/cache-sim"
BUDGETS = ("0.125", "0.25", "0.5")
DOMAINS = ("general", "coding", "math", "reasoning")
DECAYS = (0.5, 0.7, 0.8, 0.85, 0.9, 0.92, 0.94, 0.95, 0.96, 0.97, 0.98, 0.99, 0.995, 1.0)


def _mini_plans():
    return {
        "0.125": CS / "plan-0.125.json",
        "0.25": CS / "plan-0.25.json",
        "0.5": ROOT / "plans/reap-mini-moe.plan.json",
    }


def _dir_plans(d):
    return {b: d / f"plan-{b}.json" for b in BUDGETS}


def datasets() -> dict[str, tuple[list[Path], dict[str, Path]]]:
    ol_plans = {b: OL / f"plans/plan-{b}.json" for b in BUDGETS}
    out = {
        "olmoe-eval25": ([OL / f"traces/eval25-{d}.npz" for d in DOMAINS], ol_plans),
        "olmoe-calib20": ([OL / "traces/calib20.npz"], ol_plans),
        "olmoe-eval80": ([OL / f"traces/eval80-{d}.npz" for d in DOMAINS], ol_plans),
        "mini-calibration": ([ROOT / "data/traces/mini-moe-calibration.npz"], _mini_plans()),
        "mini-heldout": ([ROOT / "data/traces/mini-moe-heldout.npz"], _mini_plans()),
    }
    for name in ("skew", "skew12cpu", "skew12h200"):
        for split in ("calibration", "heldout"):
            out[f"{name}-{split}"] = ([CS / name / f"skew-{split}.npz"], _dir_plans(CS / name))
    return out


def configs_for(trace, plan, budget: str, decays=DECAYS) -> list[Config]:
    total = len(trace.layers) * trace.num_experts * trace.per_expert_bytes
    n = parse_budget(budget, total).bytes // trace.per_expert_bytes
    core = {l: frozenset(plan.layers[l].core) for l in trace.layers}
    plan_slots, _ = layer_slots(n, trace.layers, core, "core+tail", trace.num_experts)
    uni, _ = layer_slots(n, trace.layers, None, "uniform", trace.num_experts)
    out = []
    for d in decays:
        for admit in (False, True):
            a = "admit" if admit else "demand"
            for start in ("cold", "seeded", "pinned"):
                if start != "cold" and any(len(core[l]) > plan_slots[l] for l in trace.layers):
                    continue
                out.append(Config(f"{start}/{a}/plan-slots/{d:g}", d, plan_slots, core, start, admit))
            out.append(Config(f"cold/{a}/uniform/{d:g}", d, uni, core, "cold", admit))
    return out


def prior_of(name: str) -> Path:
    """The calibration trace whose transition tables a dataset's markov rows use (never itself
    for the held-out sets: OLMoE's files 0:20; the synthetic sets' other split)."""
    if name.startswith("olmoe"):
        return OL / "traces/calib20.npz"
    base, split = name.rsplit("-", 1)
    other = "heldout" if split == "calibration" else "calibration"
    return datasets()[f"{base}-{other}"][0][0]


MARKOV_DECAYS = (0.8, 0.9, 0.94, 0.96, 0.98)
MARKOV_WEIGHTS = (4.0, 8.0, 16.0, 32.0, 64.0)


def markov_configs(trace, plan, budget: str, prior) -> list[Config]:
    """dlfu-markov-seeded (prior.DLFUMarkov: a kernel change) over decay x weight x admission."""
    import numpy as np

    from reap_swap.cache.mechanism import LayerSteps
    from reap_swap.cache.prior import transition_table

    base = [c for c in configs_for(trace, plan, budget, MARKOV_DECAYS) if c.name.startswith("seeded/")]
    st = prior.request_first_steps()
    steps = [LayerSteps.from_counts(l, prior.step_counts(l), st) for l in trace.layers]
    out = list(base)
    for w in MARKOV_WEIGHTS:
        tab = np.stack([transition_table(s, w) for s in steps])
        for c in base:
            start, a, slots, d = c.name.split("/")
            out.append(
                Config(f"markov{w:g}/{a}/{slots}/{d}", c.decay, c.slots, c.core, "seeded", c.admit, table=tab)
            )
    return out


INC_CAPS = (1, 4)


def inc_configs(trace, plan, budget: str) -> list[Config]:
    """Today's seeded/pinned dlfu, and the same with a step's score increment capped at
    ``min(selections, cap)`` per expert (a kernel change: one min before the shift)."""
    base = [
        c
        for c in configs_for(trace, plan, budget)
        if c.name.split("/")[:3] in (["seeded", "demand", "plan-slots"], ["cold", "demand", "uniform"])
    ]
    out = list(base)
    for cap in INC_CAPS:
        for c in base:
            start, a, slots, d = c.name.split("/")
            out.append(
                Config(
                    f"{start}-cap{cap}/{a}/{slots}/{d}", c.decay, c.slots, c.core, start, c.admit, inc_cap=cap
                )
            )
    return out


def foresight_configs(trace, plan, budget: str, prior) -> list[Config]:
    """REFERENCES, not servable: experts routed in the next k steps (read from the trace) rank
    first, soonest first; the rest by dlfu at 0.96, alone or + the transition prior (weight 8)."""
    import numpy as np

    from reap_swap.cache.mechanism import LayerSteps
    from reap_swap.cache.prior import transition_table

    st = prior.request_first_steps()
    tab = np.stack(
        [transition_table(LayerSteps.from_counts(l, prior.step_counts(l), st), 8.0) for l in trace.layers]
    )
    base = next(c for c in configs_for(trace, plan, budget, (0.96,)) if c.name.startswith("seeded/demand/"))
    out = []
    for k in (1, 2, 4):
        for admit in (False, True):
            a = "admit" if admit else "demand"
            out.append(
                Config(
                    f"foresight{k}/{a}/plan-slots/0.96",
                    0.96,
                    base.slots,
                    base.core,
                    "seeded",
                    admit,
                    foresight=k,
                )
            )
            out.append(
                Config(
                    f"foresight{k}+markov8/{a}/plan-slots/0.96",
                    0.96,
                    base.slots,
                    base.core,
                    "seeded",
                    admit,
                    table=tab,
                    foresight=k,
                )
            )
    return out


def alloc_curves(names, out_path: Path, decays=(0.8, 0.96)) -> dict:
    """Per-layer counts of cold dlfu at 1..E slots in every layer (for a per-layer slot allocation
    chosen on a calibration trace: ``allocate``)."""
    result = {}
    for name, (files, _) in datasets().items():
        if names and name not in names:
            continue
        traces = [load_trace(f) for f in files]
        layers, e = traces[0].layers, traces[0].num_experts
        cfgs = [Config(f"{d:g}/{s}", d, {l: s for l in layers}) for d in decays for s in range(1, e + 1)]
        acc = {}
        for tr in traces:
            for r in replay(tr, cfgs):
                acc[r["name"]] = add(acc.get(r["name"], {}), r)
        result[name] = {k: v["layers"] for k, v in acc.items()}
        print(f"{name}: curves", flush=True)
    out_path.write_bytes(orjson.dumps(result, option=orjson.OPT_NON_STR_KEYS))
    return result


def allocate(curves: dict, decay: str, total: int, max_slots: int) -> list[int]:
    """Slots per layer (trace order) minimising the summed selection misses of ``curves``
    (layer -> per-slot-count counts), sum = ``total``, each in [1, max_slots]: exact DP."""
    layers = list(next(iter(curves.values())))
    miss = {
        (l, s): curves[f"{decay}/{s}"][l][0] - curves[f"{decay}/{s}"][l][1]
        for l in layers
        for s in range(1, max_slots + 1)
    }
    best = {0: (0, [])}
    for l in layers:
        nxt = {}
        for used, (m, alloc) in best.items():
            for s in range(1, min(max_slots, total - used) + 1):
                cand = (m + miss[l, s], [*alloc, s])
                if used + s not in nxt or cand[0] < nxt[used + s][0]:
                    nxt[used + s] = cand
        best = nxt
    return best[total][1]


def run(names, out_path: Path, family: str = "params") -> dict:
    result = {}
    for name, (files, plans) in datasets().items():
        if names and name not in names:
            continue
        traces = [load_trace(f) for f in files]
        result[name] = {"files": [str(f) for f in files], "budgets": {}}
        for b in BUDGETS:
            t0 = time.time()
            plan = load_plan(plans[b])
            if family == "foresight":
                cfgs = foresight_configs(traces[0], plan, b, load_trace(prior_of(name)))
            elif family == "inc":
                cfgs = inc_configs(traces[0], plan, b)
            elif family == "markov":
                cfgs = markov_configs(traces[0], plan, b, load_trace(prior_of(name)))
            else:
                cfgs = configs_for(traces[0], plan, b)
            acc = {}
            for tr in traces:
                for r in replay(tr, cfgs):
                    acc[r["name"]] = add(acc.get(r["name"], {}), r)
            result[name]["budgets"][b] = {
                "plan": str(plans[b]),
                "slots": {"plan": cfgs[0].slots},
                "rows": {k: rates(v) for k, v in acc.items()},
            }
            print(f"{name} {b}: {len(cfgs)} configs, {time.time() - t0:.0f} s", flush=True)
        out_path.write_bytes(orjson.dumps(result, option=orjson.OPT_NON_STR_KEYS))
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", nargs="*", help="dataset names (default: all)")
    ap.add_argument("--family", choices=("params", "markov", "inc", "foresight", "curves"), default="params")
    args = ap.parse_args(argv)
    if args.family == "curves":
        alloc_curves(args.only, args.out)
    else:
        run(args.only, args.out, args.family)
    return 0


if __name__ == "__main__":
    sys.exit(main())
