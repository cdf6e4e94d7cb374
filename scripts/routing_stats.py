#!/usr/bin/env python3
"""Per-domain routing statistics of a Qwen3-MoE checkpoint (HF transformers, CPU).

For every record of a JSONL split ({"text", "source"}), run the model with
output_router_logits=True and count, per layer, the experts picked by top-k of the router
softmax (exactly what the model routes to). From the per-domain counts:

  JS       Jensen-Shannon divergence (base 2, in [0, 1]) between two domains' expert-frequency
           distributions, per layer; reported as the mean over domain pairs, with min and max
  top25    share of routed selections carried by the 25 % most-used experts of the layer:
           "pooled" over all domains, and "per-domain" (each domain's own top 25 %, averaged)
  within   JS between two halves (alternate records) of the same domain: the noise floor
  H/Hmax   entropy of the per-domain distribution over log2(E), averaged over domains
  cover    (with --calib) each domain's top-25 % experts chosen on the calibration split:
           the share of that domain's held-out selections they carry (a plan-like check);
           also with ANOTHER domain's calibration top 25 % (the wrong slice), and with the
           top 25 % of all domains pooled (one static plan)

--random-init builds a model of the same config with fresh random weights (seeded) instead
of loading the checkpoint, for contrast.

usage: python scripts/routing_stats.py --model models/reap-mini-moe \
           --data data/corpus/heldout.jsonl [--calib data/corpus/calibration.jsonl] \
           [--random-init] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys

import numpy as np
import torch


def load_jsonl(path, per_domain=None):
    recs = []
    with open(path) as fh:
        for line in fh:
            if line.strip():
                recs.append(json.loads(line))
    if per_domain:
        seen, out = {}, []
        for r in recs:
            if seen.get(r["source"], 0) < per_domain:
                seen[r["source"]] = seen.get(r["source"], 0) + 1
                out.append(r)
        recs = out
    return recs


def load_model(path, random_init=False, seed=0, dtype=torch.bfloat16):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if random_init:
        cfg = AutoConfig.from_pretrained(path)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    return model, tok


@torch.no_grad()
def route_counts(model, tok, records, max_tokens=256, key=None):
    """{domain: int array [layers, experts]} of top-k selections over all tokens.

    key(index, record) -> group name; default: the record's "source" (its domain)."""
    cfg = model.config
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    out = {}
    for i, r in enumerate(records):
        ids = tok.encode(r["text"], add_special_tokens=False)[:max_tokens]
        if not ids:
            continue
        res = model(input_ids=torch.tensor([ids]), output_router_logits=True, use_cache=False)
        g = key(i, r) if key else r["source"]
        c = out.setdefault(g, np.zeros((len(res.router_logits), E), dtype=np.int64))
        for layer, lg in enumerate(res.router_logits):
            sel = torch.topk(torch.softmax(lg.float(), dim=-1), k, dim=-1).indices
            c[layer] += torch.bincount(sel.reshape(-1), minlength=E).numpy()
    return out


def js_div(p, q):
    """Jensen-Shannon divergence, base 2 (0 = identical, 1 = disjoint)."""
    p = np.asarray(p, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    p = p / p.sum()
    q = q / q.sum()
    m = 0.5 * (p + q)

    def kl(a, b):
        nz = a > 0
        return float(np.sum(a[nz] * np.log2(a[nz] / b[nz])))

    return 0.5 * kl(p, m) + 0.5 * kl(q, m)


def top_share(c, frac=0.25):
    c = np.sort(np.asarray(c, dtype=np.float64))[::-1]
    n = max(1, int(round(frac * len(c))))
    return float(c[:n].sum() / c.sum())


def entropy_ratio(c):
    p = np.asarray(c, dtype=np.float64)
    p = p[p > 0] / p.sum()
    return float(-(p * np.log2(p)).sum() / math.log2(len(c)))


def halves_key(i, r):
    """Group records by domain and alternate halves, for the within-domain noise floor."""
    return f"{r['source']}#{i % 2}"


def merge_halves(counts):
    out = {}
    for g, c in counts.items():
        d = g.split("#")[0]
        out[d] = out[d] + c if d in out else c.copy()
    return out


def summarize(counts, calib_counts=None, frac=0.25, half_counts=None):
    """Statistics from {domain: [layers, experts]} counts (see the module docstring).

    half_counts: {"<domain>#0"/"#1": counts} from two halves of each domain's records; adds
    js_within (JS between the halves of one domain, averaged): the sampling-noise floor that
    between-domain JS should be compared with."""
    doms = sorted(counts)
    L, E = counts[doms[0]].shape
    layers = []
    for layer in range(L):
        pairs = {
            f"{a}/{b}": js_div(counts[a][layer], counts[b][layer]) for a, b in itertools.combinations(doms, 2)
        }
        pooled = sum(counts[d][layer] for d in doms)
        row = {
            "layer": layer,
            "js_mean": float(np.mean(list(pairs.values()))) if pairs else 0.0,
            "js_min": float(min(pairs.values())) if pairs else 0.0,
            "js_max": float(max(pairs.values())) if pairs else 0.0,
            "js_pairs": pairs,
            "top25_pooled": top_share(pooled, frac),
            "top25_per_domain": {d: top_share(counts[d][layer], frac) for d in doms},
            "entropy_ratio_per_domain": {d: entropy_ratio(counts[d][layer]) for d in doms},
        }
        row["top25_per_domain_mean"] = float(np.mean(list(row["top25_per_domain"].values())))
        if half_counts is not None:
            row["js_within"] = float(
                np.mean(
                    [
                        js_div(half_counts[f"{d}#0"][layer], half_counts[f"{d}#1"][layer])
                        for d in doms
                        if f"{d}#1" in half_counts
                    ]
                )
            )
        row["entropy_ratio_mean"] = float(np.mean(list(row["entropy_ratio_per_domain"].values())))
        if calib_counts is not None:
            n = max(1, int(round(frac * E)))
            cover = {}
            for d in doms:
                if d not in calib_counts:
                    continue
                keep = np.argsort(-calib_counts[d][layer], kind="stable")[:n]
                cover[d] = float(counts[d][layer][keep].sum() / counts[d][layer].sum())
            pooled_cal = sum(calib_counts[d][layer] for d in calib_counts)
            keep = np.argsort(-pooled_cal, kind="stable")[:n]
            other = []
            for d in doms:
                for e in calib_counts:
                    if e != d:
                        keep_e = np.argsort(-calib_counts[e][layer], kind="stable")[:n]
                        other.append(counts[d][layer][keep_e].sum() / counts[d][layer].sum())
            row["calib_top25_cover_per_domain"] = cover
            row["calib_other_top25_cover_mean"] = float(np.mean(other)) if other else float("nan")
            row["calib_top25_cover_mean"] = float(np.mean(list(cover.values())))
            row["calib_pooled_top25_cover_mean"] = float(
                np.mean([counts[d][layer][keep].sum() / counts[d][layer].sum() for d in doms])
            )
        layers.append(row)
    return {
        "domains": doms,
        "experts": int(E),
        "layers": layers,
        "tokens_per_domain": {d: int(counts[d][0].sum()) for d in doms},
        "js_mean_over_layers": float(np.mean([r["js_mean"] for r in layers])),
        **(
            {"js_within_mean_over_layers": float(np.mean([r["js_within"] for r in layers]))}
            if half_counts is not None
            else {}
        ),
        "top25_per_domain_mean_over_layers": float(np.mean([r["top25_per_domain_mean"] for r in layers])),
        "top25_pooled_mean_over_layers": float(np.mean([r["top25_pooled"] for r in layers])),
        **(
            {
                "calib_cover_own_mean_over_layers": float(
                    np.mean([r["calib_top25_cover_mean"] for r in layers])
                ),
                "calib_cover_other_mean_over_layers": float(
                    np.mean([r["calib_other_top25_cover_mean"] for r in layers])
                ),
                "calib_cover_pooled_mean_over_layers": float(
                    np.mean([r["calib_pooled_top25_cover_mean"] for r in layers])
                ),
            }
            if calib_counts is not None
            else {}
        ),
    }


def markdown(summary, title):
    doms = summary["domains"]
    pairs = [f"{a}/{b}" for a, b in itertools.combinations(doms, 2)]
    calib = "calib_top25_cover_mean" in summary["layers"][0]
    lines = [
        f"**{title}** (selections per domain: "
        + ", ".join(f"{d} {n}" for d, n in summary["tokens_per_domain"].items())
        + ")",
        "",
    ]
    within = "js_within" in summary["layers"][0]
    head = (
        ["layer", "JS mean", "JS min", "JS max"]
        + (["JS within a domain (noise floor)"] if within else [])
        + ["top-25 % share, pooled", "top-25 % share, per domain (mean)", "H/Hmax per domain (mean)"]
    )
    if calib:
        head += [
            "held-out cover by own domain's calib top-25 %",
            "… by another domain's",
            "… by pooled calib top-25 %",
        ]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in summary["layers"]:
        cells = (
            [str(r["layer"]), f"{r['js_mean']:.3f}", f"{r['js_min']:.3f}", f"{r['js_max']:.3f}"]
            + ([f"{r['js_within']:.3f}"] if within else [])
            + [
                f"{r['top25_pooled']:.3f}",
                f"{r['top25_per_domain_mean']:.3f}",
                f"{r['entropy_ratio_mean']:.3f}",
            ]
        )
        if calib:
            cells += [
                f"{r['calib_top25_cover_mean']:.3f}",
                f"{r['calib_other_top25_cover_mean']:.3f}",
                f"{r['calib_pooled_top25_cover_mean']:.3f}",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "JS per domain pair and layer:",
        "",
        "| layer | " + " | ".join(pairs) + " |",
        "|" + "---|" * (len(pairs) + 1),
    ]
    for r in summary["layers"]:
        lines.append(f"| {r['layer']} | " + " | ".join(f"{r['js_pairs'][p]:.3f}" for p in pairs) + " |")
    lines += [
        "",
        "Top-25 % share per domain and layer:",
        "",
        "| layer | " + " | ".join(doms) + " |",
        "|" + "---|" * (len(doms) + 1),
    ]
    for r in summary["layers"]:
        lines.append(
            f"| {r['layer']} | " + " | ".join(f"{r['top25_per_domain'][d]:.3f}" for d in doms) + " |"
        )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/reap-mini-moe")
    ap.add_argument("--data", default="data/corpus/heldout.jsonl")
    ap.add_argument("--calib", default=None, help="calibration split for the cover column")
    ap.add_argument("--random-init", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--per-domain", type=int, default=None, help="use only the first N records per domain")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the summary (and raw counts) here")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    model, tok = load_model(a.model, a.random_init, a.seed, dtype)
    recs = load_jsonl(a.data, a.per_domain)
    half_counts = route_counts(model, tok, recs, a.max_tokens, key=halves_key)
    counts = merge_halves(half_counts)
    calib_counts = None
    if a.calib:
        calib_counts = route_counts(model, tok, load_jsonl(a.calib, a.per_domain), a.max_tokens)
    summary = summarize(counts, calib_counts, half_counts=half_counts)
    title = (f"random-init (seed {a.seed}) " if a.random_init else "trained ") + a.model
    print(markdown(summary, f"{title} on {a.data}"))
    if a.json:
        summary["counts"] = {d: c.tolist() for d, c in counts.items()}
        if calib_counts is not None:
            summary["calib_counts"] = {d: c.tolist() for d, c in calib_counts.items()}
        summary["args"] = vars(a)
        with open(a.json, "w") as fh:
            json.dump(summary, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
