#!/usr/bin/env python3
"""Held-out coverage of planned cores: our planner vs frequency-only and REAP-only rankings.

Why: a plan is worth serving only if the experts it keeps resident are the ones held-out traffic
routes to. This measures, on a corpus split into a calibration and a held-out half, the share of
held-out routed selections each method's core covers at the same byte budget (and, for ours, core
+ the best slices per request), next to the hindsight oracles. Re-run it on any Qwen3-MoE-style
model (e.g. the trained mini MoE) to replace the numbers in research.md.

Steps (outputs cached in --work-dir; --force recomputes):
  1. reap-swap observe  calibration -> calib.pt       (vLLM counters: frequency, gate mass, co-activation)
  2. reap-swap observe  held-out --per-request -> heldout.pt
  3. REAP saliency on the calibration half with transformers -> calib_reap.pt, in REAP's observer
     layout (total_tokens, expert_frequency, pairwise_expert_frequency, ean_sum, weighted_ean_sum,
     ean_mean, reap, weighted_expert_frequency_sum, max_activations). Our own implementation of
     REAP's definitions (gate weight = full softmax probability, as REAP's observer by default;
     output norm of the unweighted expert output), for HF Qwen3-MoE-style blocks (mlp.gate.weight,
     mlp.experts.gate_up_proj / down_proj).
  4. plans per budget ratio and method, all with the same core fraction, evaluated on heldout.pt.

Methods:
  ours              planner defaults on calib.pt: routed-frequency value, core split across layers by
                    marginal hit gain, slices from true co-activation
  ours+reap         planner defaults on calib_reap.pt: same, plus super experts and the REAP guard
  ours/freq-slices  as ours, co-activation removed: slices fall back to frequency-rank buckets
  freq-uniform      frequency ranking, the same core count in every layer, no guards
  reap-uniform      REAP saliency ranking, the same core count in every layer, no guards
  reap-greedy       REAP saliency shares through the greedy cross-layer split, no guards

usage: python research/measure/measure_plan_coverage.py --model DIR [--calibration C.jsonl --heldout H.jsonl |
       --corpus ALL.jsonl] [--budget-ratios 0.125 0.25 0.375 0.5] [--work-dir artifacts/coverage]
       [-- extra vLLM engine args]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

DEFAULT_ENGINE = ["--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(256 << 20)]


def split_corpus(corpus: Path, work: Path) -> tuple[Path, Path]:
    """Halves by a hash of each line's text: stable, and independent of line order."""
    calib, held = work / "split_calibration.jsonl", work / "split_heldout.jsonl"
    with open(corpus, "rb") as f, open(calib, "wb") as c, open(held, "wb") as h:
        for line in f:
            (c if hashlib.sha256(line).digest()[0] % 2 == 0 else h).write(line)
    return calib, held


def observe(model: str, corpus: Path, out: Path, per_request: bool, engine: list[str], force: bool) -> None:
    if out.exists() and not force:
        return
    cmd = [
        sys.executable,
        "-m",
        "reap_swap.cli",
        "observe",
        "--model",
        model,
        "--corpus",
        str(corpus),
        "--out",
        str(out),
        *(["--per-request"] if per_request else []),
        *engine,
    ]
    print("+", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True)


def reap_saliency(model_dir: str, corpus: Path, out: Path, force: bool) -> None:
    """REAP's observer statistics per MoE layer, by forward pre-hooks on the sparse MoE blocks."""
    if out.exists() and not force:
        return
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from reap_swap.planner.corpus import read_corpus, tokenize_records

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = model.config
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    records, _ = read_corpus(corpus)
    tokenized, _ = tokenize_records(tok, records, cfg.max_position_embeddings)
    state: dict[int, dict[str, torch.Tensor]] = {}

    def hook_for(layer: int, block):
        def pre_hook(_module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            logits = torch.nn.functional.linear(x, block.gate.weight.float())
            probs = torch.softmax(logits, dim=-1)
            selected = torch.topk(logits, k, dim=-1).indices
            s = state.setdefault(
                layer,
                {
                    "total_tokens": torch.tensor(0, dtype=torch.long),
                    "expert_frequency": torch.zeros(E, dtype=torch.long),
                    "ean_sum": torch.zeros(E, dtype=torch.float64),
                    "weighted_ean_sum": torch.zeros(E, dtype=torch.float64),
                    "weighted_expert_frequency_sum": torch.zeros(E, dtype=torch.float64),
                    "max_activations": torch.zeros(E, dtype=torch.float32),
                },
            )
            s["total_tokens"] += x.shape[0]
            s["expert_frequency"] += torch.bincount(selected.reshape(-1), minlength=E)
            experts = block.experts
            for e in range(E):
                rows = (selected == e).any(dim=-1)
                if not rows.any():
                    continue
                gate, up = torch.nn.functional.linear(x[rows], experts.gate_up_proj[e].float()).chunk(
                    2, dim=-1
                )
                y = torch.nn.functional.linear(experts.act_fn(gate) * up, experts.down_proj[e].float())
                norms = y.norm(dim=-1).double()
                g = probs[rows, e].double()
                s["ean_sum"][e] += norms.sum()
                s["weighted_ean_sum"][e] += (norms * g).sum()
                s["weighted_expert_frequency_sum"][e] += g.sum()
                s["max_activations"][e] = torch.maximum(s["max_activations"][e], y.max().float())

        return pre_hook

    handles = []
    for name, module in model.named_modules():
        if hasattr(module, "gate") and hasattr(module, "experts") and hasattr(module.experts, "gate_up_proj"):
            layer = int(name.split("layers.")[1].split(".")[0])
            handles.append(module.register_forward_pre_hook(hook_for(layer, module)))
    if not handles:
        raise SystemExit(f"{model_dir}: no Qwen3-MoE-style sparse MoE blocks found")
    with torch.no_grad():
        for _rec, ids in tqdm(tokenized, desc="REAP saliency", unit="rec"):
            model(torch.tensor([ids]))
    for h in handles:
        h.remove()
    for s in state.values():
        freq = s["expert_frequency"]
        safe = freq.clamp(min=1).double()
        s["reap"] = (s["weighted_ean_sum"] / safe).float()
        s["ean_mean"] = (s["ean_sum"] / safe).float()
        s["pairwise_expert_frequency"] = freq[None, :] + freq[:, None]
    torch.save(dict(sorted(state.items())), out)


def methods(calib, calib_reap):
    from reap_swap.planner.observation_types import Observations

    def strip_coact(o: Observations) -> Observations:
        layers = {i: dataclasses.replace(s, coactivation=None) for i, s in o.layers.items()}
        tags = {
            t: {i: dataclasses.replace(s, coactivation=None) for i, s in ls.items()}
            for t, ls in o.tags.items()
        }
        return dataclasses.replace(o, layers=layers, tags=tags)

    off = dict(reap_guard=False, super_experts=False)
    return {
        "ours": (calib, {}),
        "ours+reap": (calib_reap, {}),
        "ours/freq-slices": (strip_coact(calib), {}),
        "freq-uniform": (calib, dict(layer_allocation="uniform", **off)),
        "reap-uniform": (calib_reap, dict(signal="reap", layer_allocation="uniform", **off)),
        "reap-greedy": (calib_reap, dict(signal="reap", **off)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--calibration", type=Path, default=ROOT / "data/corpus/calibration.jsonl")
    ap.add_argument("--heldout", type=Path, default=ROOT / "data/corpus/heldout.jsonl")
    ap.add_argument("--corpus", type=Path, help="one corpus, split into halves by line hash")
    ap.add_argument("--budget-ratios", type=float, nargs="+", default=[0.125, 0.25, 0.375, 0.5])
    ap.add_argument("--core-fraction", type=float, default=0.75)
    ap.add_argument(
        "--slice-size", type=int, help="experts per slice for every method (default: the planner's)"
    )
    ap.add_argument("--work-dir", type=Path, default=ROOT / "artifacts/coverage")
    ap.add_argument("--force", action="store_true")
    args, engine = ap.parse_known_args()
    engine = [a for a in engine if a != "--"] or DEFAULT_ENGINE
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    calib_corpus, held_corpus = (
        split_corpus(args.corpus, work) if args.corpus else (args.calibration, args.heldout)
    )

    observe(args.model, calib_corpus, work / "calib.pt", False, engine, args.force)
    observe(args.model, held_corpus, work / "heldout.pt", True, engine, args.force)
    reap_saliency(args.model, calib_corpus, work / "calib_reap.pt", args.force)

    from reap_swap.plan.document import load_plan
    from reap_swap.planner.build import PlannerConfig, build_plan
    from reap_swap.planner.evaluate import evaluate_observations
    from reap_swap.planner.observations import load_observations
    from reap_swap.sizing.model_shape import read_model_shape

    shape = read_model_shape(args.model)
    calib, calib_reap = load_observations(work / "calib.pt"), load_observations(work / "calib_reap.pt")
    held = load_observations(work / "heldout.pt")
    # share of calibration selections on which vLLM's and transformers' routing differ (near-ties)
    disagree = max(
        float(np.abs(calib.layers[i].expert_frequency - calib_reap.layers[i].expert_frequency).sum())
        / 2
        / max(1, int(calib.layers[i].expert_frequency.sum()))
        for i in calib.layers
    )
    rows, per_layer_core = [], {}
    for ratio in args.budget_ratios:
        for name, (obs, extra) in methods(calib, calib_reap).items():
            config = PlannerConfig(
                budget_ratio=ratio, core_fraction=args.core_fraction, slice_size=args.slice_size, **extra
            )
            doc = build_plan([obs], shape, config, args.model)
            report = evaluate_observations(load_plan(doc, shape), [held])
            o = report["overall"]
            rows.append(
                {
                    "budget_ratio": ratio,
                    "method": name,
                    "core": o["core"],
                    "oracle_core": o["oracle_core"],
                    "core_plus_slices": o["core_plus_slices"],
                    "oracle_per_request": o["oracle_per_request"],
                    "core_experts": doc["summary"]["totalCoreExperts"],
                    "layer_core": [r["core"] for r in report["layers"]],
                }
            )
            if name == "ours":
                per_layer_core[ratio] = {k: len(v["coreExperts"]) for k, v in doc["perLayer"].items()}
    flatness = {}
    for i, s in held.layers.items():
        p = s.expert_frequency / s.expert_frequency.sum()
        flatness[f"layer_{i}"] = round(float(-(p[p > 0] * np.log(p[p > 0])).sum() / np.log(len(p))), 4)
    result = {
        "model": args.model,
        "calibration": str(calib_corpus),
        "heldout": str(held_corpus),
        "calibration_tokens": calib.layers[min(calib.layers)].total_tokens,
        "heldout_tokens": held.layers[min(held.layers)].total_tokens,
        "heldout_requests": int(held.records.counts.shape[0]),
        "max_layer_share_routed_differently_vllm_vs_transformers": disagree,
        "core_fraction": args.core_fraction,
        "slice_size": args.slice_size,
        "engine_args": engine,
        "heldout_normalised_entropy_per_layer": flatness,
        "ours_core_experts_per_layer": per_layer_core,
        "super_experts": build_plan(
            [calib_reap], shape, PlannerConfig(budget_ratio=max(args.budget_ratios)), args.model
        )["scorerArtifacts"]["superExperts"],
        "rows": rows,
    }
    suffix = f"-slice{args.slice_size}" if args.slice_size else ""
    (work / f"results{suffix}.json").write_text(json.dumps(result, indent=2))
    (work / f"results{suffix}.md").write_text(table(result))
    plot(result, work / f"coverage{suffix}.png")
    print(table(result))
    return 0


def table(result: dict) -> str:
    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}"

    lines = [
        "| budget | method | core experts | core % | oracle core % | core+slices % | oracle/request % |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['budget_ratio']} | {r['method']} | {r['core_experts']} | {pct(r['core'])} | "
            f"{pct(r['oracle_core'])} | {pct(r['core_plus_slices'])} | {pct(r['oracle_per_request'])} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = list(dict.fromkeys(r["method"] for r in result["rows"]))
    for name in names:
        rs = [r for r in result["rows"] if r["method"] == name]
        ax.plot(
            [r["budget_ratio"] for r in rs], [100 * r["core"] for r in rs], marker="o", label=f"{name} core"
        )
    rs = [r for r in result["rows"] if r["method"] == "ours"]
    ax.plot([r["budget_ratio"] for r in rs], [100 * r["oracle_core"] for r in rs], "k--", label="oracle core")
    ax.plot(
        [r["budget_ratio"] for r in rs],
        [100 * r["core_plus_slices"] for r in rs],
        "k:",
        marker="s",
        label="ours core + best slices",
    )
    ax.set_xlabel("budget (share of all expert bytes)")
    ax.set_ylabel("held-out routed selections covered (%)")
    ax.set_title(
        f"held-out coverage, core fraction {result['core_fraction']}"
        + (f", slice size {result['slice_size']}" if result["slice_size"] else "")
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
