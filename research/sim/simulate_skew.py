#!/usr/bin/env python3
"""Calibrate and check make_skewed_moe.py's construction on CPU, without the 14 GiB checkpoint.

Why: the router bias must be sized against the rms of the residual stream, which grows over
layers, and the resulting routing statistics must be known before the GPU run. This runs a
faithful forward of the kit model (same shapes, same N(0, 0.02) bf16 init, norms = 1, same
tokenizer via mk_model.build_tokenizer, all 128 experts of a layer generated when that layer is
reached and dropped after) on real corpus tokens, with the weights passed through the very same
`skew_tensors`. Layers are run one at a time over all sequences, so memory stays ~4 GiB.
The random draws differ from the GPU model's (different generator), the statistics do not.
Computation is float32 on bf16-rounded weights (vLLM runs bf16).

Outputs research-notes/skew-simulation.json: per layer the measured rho (median residual rms
entering the MoE), the top-25 % / top-50 % expert shares of routed selections pooled over the
mixed corpus, the same per domain, the overlap of the domains' top-25 % expert sets; plus, with
--grid, the same pooled shares for other (A, z) computed from the recorded router logits.

usage: simulate_skew.py [--per-domain 8] [--tokens 256] [--amp 3] [--zipf 0.6] [--grid]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import make_skewed_moe as msk  # noqa: E402

KIT = dict(
    hidden=2048,
    heads=32,
    kv_heads=4,
    head_dim=128,
    experts=128,
    inter=768,
    layers=12,
    topk=8,
    vocab=32000,
    eps=1e-6,
    rope_theta=10000.0,
    std=0.02,
)


def _rms_norm(x, eps=KIT["eps"]):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x, theta):
    """HF rotate-half RoPE on [S, heads, T, D]."""
    d, t = x.shape[-1], x.shape[-2]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = torch.outer(torch.arange(t, dtype=torch.float32), inv)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def share_stats(counts: torch.Tensor) -> dict:
    """Top-25 % / top-50 % of experts' share of routed selections."""
    s = counts.double().sort(descending=True).values
    e, tot = s.numel(), float(s.sum())
    return {
        "top25": round(float(s[: e // 4].sum()) / tot, 4),
        "top50": round(float(s[: e // 2].sum()) / tot, 4),
    }


def _top_set(counts, frac=0.25):
    return set(counts.argsort(descending=True)[: int(counts.numel() * frac)].tolist())


def route(noise, cls, r, con, layer, amp, zipf, rho, topk):
    """Top-k of noise logits + the construction's bias (recomputed for another A, z)."""
    e = noise.shape[1]
    strength = amp * torch.arange(1, e + 1, dtype=torch.float32) ** (-zipf)
    bias = torch.zeros(len(msk.CLASS_NAMES), e)
    for c in range(len(msk.CLASS_NAMES)):
        bias[c, con.ranks[layer][c]] = strength
    return (noise + bias[cls] * (rho / r)[:, None]).topk(topk, dim=1).indices


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mk-model", default="/work/shared/gpu-kit/mk_model.py")
    ap.add_argument("--corpus", default=str(ROOT / "data/corpus/calibration.jsonl"))
    ap.add_argument("--per-domain", type=int, default=8, help="records per domain")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per record (prefix)")
    ap.add_argument("--layers", type=int, default=KIT["layers"])
    ap.add_argument("--amp", type=float, default=msk.DEFAULTS["amp"])
    ap.add_argument("--zipf", type=float, default=msk.DEFAULTS["zipf"])
    ap.add_argument("--marker", type=float, default=msk.DEFAULTS["marker"])
    ap.add_argument("--seed", type=int, default=msk.DEFAULTS["seed"], help="construction seed")
    ap.add_argument("--model-seed", type=int, default=0)
    ap.add_argument("--rho", default="kit", help="'kit' (RHO_KIT), 'one', or comma list")
    ap.add_argument("--grid", action="store_true", help="also scan (A, z) on recorded logits")
    ap.add_argument("--out", default=str(ROOT / "research-notes/skew-simulation.json"))
    a = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    t0 = time.time()
    k = KIT
    H, E, I, L = k["hidden"], k["experts"], k["inter"], a.layers

    spec = importlib.util.spec_from_file_location("mk_model", a.mk_model)
    mk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mk)
    tokdir = tempfile.mkdtemp(prefix="skewsim-tok-")
    tok = mk.build_tokenizer(tokdir, k["vocab"]).backend_tokenizer
    classes = msk.token_classes(Path(tokdir) / "tokenizer.json")

    recs: dict[str, list[list[int]]] = {}
    for line in open(a.corpus):
        r = json.loads(line)
        ids = tok.encode(r["text"]).ids
        if len(ids) >= a.tokens and len(recs.setdefault(r["source"], [])) < a.per_domain:
            recs[r["source"]].append(ids[: a.tokens])
    domains = sorted(recs)
    ids = torch.tensor([s for d in domains for s in recs[d]])  # [S, T]
    S, T = ids.shape
    dom = torch.tensor([i for i, d in enumerate(domains) for _ in recs[d]]).repeat_interleave(T)
    cls = torch.as_tensor(classes)[ids.flatten()]

    if a.rho == "kit":
        rho = list(msk.RHO_KIT[:L]) if all(msk.RHO_KIT) else [1.0] * L
    elif a.rho == "one":
        rho = [1.0] * L
    else:
        rho = [float(x) for x in a.rho.split(",")]
    con = msk.build_construction(
        classes, hidden=H, experts=E, layers=L, seed=a.seed, amp=a.amp, zipf=a.zipf, marker=a.marker, rho=rho
    )

    g = torch.Generator().manual_seed(a.model_seed)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * k["std"]).to(torch.bfloat16)

    emb = msk.skew_tensors({"model.embed_tokens.weight": rnd(k["vocab"], H)}, con)[
        "model.embed_tokens.weight"
    ]
    h = emb[ids].float()  # [S, T, H]
    q_dim, kv_dim, hd = k["heads"] * k["head_dim"], k["kv_heads"] * k["head_dim"], k["head_dim"]
    layers_out, noises, rms_all = [], [], []
    for layer in range(L):
        p = f"model.layers.{layer}."
        w = {
            p + "self_attn.q_proj.weight": rnd(q_dim, H),
            p + "self_attn.k_proj.weight": rnd(kv_dim, H),
            p + "self_attn.v_proj.weight": rnd(kv_dim, H),
            p + "self_attn.o_proj.weight": rnd(H, q_dim),
            p + "mlp.gate.weight": rnd(E, H),
        }
        for e in range(E):
            pe = f"{p}mlp.experts.{e}."
            w[pe + "gate_proj.weight"] = rnd(I, H)
            w[pe + "up_proj.weight"] = rnd(I, H)
            w[pe + "down_proj.weight"] = rnd(H, I)
        w = {n: t.float() for n, t in msk.skew_tensors(w, con).items()}
        # attention (norm weights are 1)
        x = _rms_norm(h)
        q = _rms_norm((x @ w[p + "self_attn.q_proj.weight"].T).view(S, T, -1, hd)).transpose(1, 2)
        kk = _rms_norm((x @ w[p + "self_attn.k_proj.weight"].T).view(S, T, -1, hd)).transpose(1, 2)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(S, T, -1, hd).transpose(1, 2)
        q, kk = _rope(q, k["rope_theta"]), _rope(kk, k["rope_theta"])
        att = F.scaled_dot_product_attention(q, kk, v, is_causal=True, enable_gqa=True)
        h = h + att.transpose(1, 2).reshape(S, T, q_dim) @ w[p + "self_attn.o_proj.weight"].T
        # MoE
        hf = h.reshape(S * T, H)
        r = hf.pow(2).mean(-1).add(k["eps"]).sqrt()
        x = hf / r[:, None]
        gate = w[p + "mlp.gate.weight"]
        logits = x @ gate.T
        noises.append(logits - x[:, con.channels] @ gate[:, con.channels].T)
        rms_all.append(r)
        topw, topi = torch.softmax(logits, -1).topk(k["topk"], dim=-1)
        topw = topw / topw.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(E):
            tok_i, slot = (topi == e).nonzero(as_tuple=True)
            if tok_i.numel() == 0:
                continue
            xe = x[tok_i]
            pe = f"{p}mlp.experts.{e}."
            y = (F.silu(xe @ w[pe + "gate_proj.weight"].T) * (xe @ w[pe + "up_proj.weight"].T)) @ w[
                pe + "down_proj.weight"
            ].T
            out.index_add_(0, tok_i, y * topw[tok_i, slot][:, None])
        h = h + out.view(S, T, H)
        assert torch.equal(hf[:, con.channels], emb[ids].float().reshape(S * T, H)[:, con.channels])
        counts = torch.bincount(topi.flatten(), minlength=E)
        per_dom = [torch.bincount(topi[dom == i].flatten(), minlength=E) for i in range(len(domains))]
        sets = [_top_set(c) for c in per_dom]
        layers_out.append(
            {
                "layer": layer,
                "rho_used": rho[layer],
                "rho_measured": round(float(r.median()), 4),
                "rms_p10_p90": [round(float(r.quantile(0.1)), 4), round(float(r.quantile(0.9)), 4)],
                "pooled": share_stats(counts),
                "per_domain": {d: share_stats(c) for d, c in zip(domains, per_dom)},
                "per_class": {
                    n: share_stats(torch.bincount(topi[cls == c].flatten(), minlength=E))
                    for c, n in enumerate(msk.CLASS_NAMES)
                    if (cls == c).any()
                },
                "domain_top25_overlap": {
                    f"{domains[i]}~{domains[j]}": len(sets[i] & sets[j]) / len(sets[i])
                    for i in range(len(domains))
                    for j in range(i + 1, len(domains))
                },
                "noise_logit_std": round(float(noises[-1].std()), 4),
            }
        )
        print(json.dumps(layers_out[-1]), f"({time.time() - t0:.0f}s)", flush=True)
        del w

    res = {
        "what": "simulated routing of the skewed kit model (research/sim/simulate_skew.py)",
        "setup": {
            "records_per_domain": a.per_domain,
            "tokens_per_record": T,
            "tokens": S * T,
            "domains": domains,
            "corpus": str(Path(a.corpus).relative_to(ROOT))
            if Path(a.corpus).is_relative_to(ROOT)
            else a.corpus,
            "model_seed": a.model_seed,
            "kit": k,
            "dtype": "float32 on bf16 weights",
        },
        "construction": {"seed": a.seed, "amp_A": a.amp, "zipf_z": a.zipf, "marker_C": a.marker, "rho": rho},
        "mean_over_layers": {
            key: round(sum(x["pooled"][key] for x in layers_out) / L, 4) for key in ("top25", "top50")
        },
        "layers": layers_out,
        "rho_measured": [x["rho_measured"] for x in layers_out],
        "seconds": round(time.time() - t0, 1),
    }
    if a.grid:
        grid = []
        for amp in (0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0):
            for zipf in (0.3, 0.6, 1.0) if amp else (0.6,):
                st, ov = [], []
                for i in range(L):
                    sel = route(
                        noises[i], cls, rms_all[i], con, i, amp, zipf, float(rms_all[i].median()), k["topk"]
                    )
                    st.append(share_stats(torch.bincount(sel.flatten(), minlength=E)))
                    sets = [
                        _top_set(torch.bincount(sel[dom == j].flatten(), minlength=E))
                        for j in range(len(domains))
                    ]
                    ov += [
                        len(sets[x] & sets[y]) / len(sets[x])
                        for x in range(len(sets))
                        for y in range(x + 1, len(sets))
                    ]
                grid.append(
                    {
                        "amp_A": amp,
                        "zipf_z": zipf,
                        "top25_min_mean_max": [
                            min(s["top25"] for s in st),
                            round(sum(s["top25"] for s in st) / L, 4),
                            max(s["top25"] for s in st),
                        ],
                        "top50_min_mean_max": [
                            min(s["top50"] for s in st),
                            round(sum(s["top50"] for s in st) / L, 4),
                            max(s["top50"] for s in st),
                        ],
                        "domain_top25_overlap_mean": round(sum(ov) / len(ov), 4),
                    }
                )
                print(json.dumps(grid[-1]), flush=True)
        res["grid_note"] = (
            "pooled shares recomputed from the recorded noise logits with the bias "
            "for (A, z) and rho = measured median; hidden states not re-run"
        )
        res["grid"] = grid
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(
        json.dumps(
            {
                "out": a.out,
                "mean_over_layers": res["mean_over_layers"],
                "rho_measured": res["rho_measured"],
                "seconds": res["seconds"],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
