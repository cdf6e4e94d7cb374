#!/usr/bin/env python3
"""End-to-end check of reap-swap on a GPU against stock vLLM (one server at a time).

Arms (each: start server, greedy completions of fixed prompts, decode tok/s, stop):
  stock-gpu      stock vLLM, every expert in HBM
  stock-uva      stock vLLM, --cpu-offload-gb = half the expert bytes (layer-granular)
  reap-core      python -m reap_swap.server with a plan whose core is --core-fraction of the
                 experts; then swaps to larger resident sets (all in the same server), with greedy
                 text, tok/s, router hit rate and swap timings at each
  reap-empty     the same with an empty core (nothing resident)
Greedy texts are compared with stock-gpu. Results go to OUT/gpu_e2e.json (+ server logs).

Usage (on the device, after installing the kit):
  python3 scripts/gpu_e2e.py --model /tmp/model --out $OUT [--arms stock-gpu,reap-core,...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, when not on PYTHONPATH
from reap_swap import serving  # noqa: E402
from reap_swap.serving import Server, compare, log  # noqa: E402,F401  (gpu_selfcheck imports these from here)

PROMPTS = [
    "The history of the printing press",
    "def quicksort(items):",
    "Explain how a transformer model",
    "In a small village by the sea,",
    "The capital of France is",
    "SELECT name, count(*) FROM",
    "Photosynthesis converts light into",
    "Once upon a time there was a",
]
COMMON = ["--served-model-name", "m", "--dtype", "bfloat16", "--max-model-len", "2048",
          "--max-num-seqs", "8", "--gpu-memory-utilization", "0.35", "--moe-backend", "triton"]


def make_plan(model: Path, core_fraction: float, slice_size: int, out: Path) -> dict:
    """A plan for a random model: core = the first experts of each layer, slices over the rest."""
    cfg = json.loads((model / "config.json").read_text())
    layers, experts = cfg["num_hidden_layers"], cfg["num_experts"]
    per_expert = 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"] * 2
    n_core = int(experts * core_fraction)
    per_layer = {}
    for l in range(layers):
        rest = list(range(n_core, experts))
        slices = [
            {"sliceId": f"layer_{l}_slice_{i:02d}", "experts": rest[j:j + slice_size],
             "byteCost": len(rest[j:j + slice_size]) * per_expert}
            for i, j in enumerate(range(0, len(rest), slice_size))
        ]
        per_layer[f"layer_{l}"] = {"rawLayerKey": str(l), "numExperts": experts,
                                   "coreExperts": list(range(n_core)),
                                   "coreByteCost": n_core * per_expert, "sliceCatalog": slices}
    total = layers * experts * per_expert
    plan = {"mode": "dynamic_core_specialist", "model": str(model),
            "budget": {"per_expert_bytes": per_expert, "swappable_expert_budget_bytes": total,
                       "core_budget_bytes": layers * n_core * per_expert,
                       "specialist_budget_bytes": total - layers * n_core * per_expert,
                       "max_refreshes_per_request": 4},
            "perLayer": per_layer}
    out.write_text(json.dumps(plan))
    return plan


def greedy(url: str, max_tokens=48) -> list[dict]:
    return serving.greedy_completions(url, PROMPTS, max_tokens=max_tokens)


def decode_speed(url: str, batch: int, n=256, repeats=3) -> dict:
    return serving.decode_speed(url, PROMPTS, batch, n=n, repeats=repeats)


def reap_measure(srv: Server, label: str, active_set: dict | None, res: dict, ref) -> None:
    entry = {}
    if active_set is not None:
        r = httpx.post(srv.url + "/swap_active_set", json={
            "request_id": f"swap-{label}", "phase": "prefill", "active_set": active_set}, timeout=300)
        entry["swap_status"] = r.status_code
        entry["swap"] = r.json()
        log(label, "swap", r.status_code, {k: entry["swap"].get(k) for k in ("bytes_copied", "timing", "signature")})
    else:
        httpx.post(srv.url + "/warm_active_set", json={
            "request_id": f"swap-{label}", "phase": "prefill", "active_set": {},
            "reset_router_stats": True}, timeout=300)
    entry["greedy"] = greedy(srv.url)
    entry["vs_stock_gpu"] = compare(ref, entry["greedy"]) if ref else None
    entry["decode_1"] = decode_speed(srv.url, 1)
    entry["decode_8"] = decode_speed(srv.url, 8, n=128)
    entry["router_misses"] = httpx.get(srv.url + f"/router_misses/swap-{label}", timeout=60).json()
    entry["status"] = httpx.get(srv.url + "/reap/status", timeout=60).json()
    log(label, "decode", entry["decode_1"], entry["decode_8"], "vs stock", entry["vs_stock_gpu"])
    res[label] = entry


def counter_check(srv: Server, plan: dict, res: dict, n_requests=4, max_tokens=16) -> None:
    """Our graph-mode counters vs vLLM's own per-token routed-experts output, same requests."""
    import base64
    import io

    import numpy as np

    httpx.post(srv.url + "/warm_active_set", json={"request_id": "count-check", "phase": "prefill",
                                                  "active_set": {}, "reset_router_stats": True}, timeout=300)
    core = {int(k.split("_")[1]): set(v["coreExperts"]) for k, v in plan["perLayer"].items()}
    counts, lens = None, []
    for i in range(n_requests):
        r = httpx.post(srv.url + "/v1/completions", json={
            "model": "m", "prompt": f"{PROMPTS[i]} (check {i})", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}, timeout=120)
        r.raise_for_status()
        arr = np.load(io.BytesIO(base64.b64decode(r.json()["choices"][0]["routed_experts"])))
        lens.append(list(arr.shape))
        layers, E = arr.shape[1], plan["perLayer"]["layer_0"]["numExperts"]
        c = np.zeros((layers, E), dtype=np.int64)
        for l in range(layers):
            np.add.at(c[l], arr[:, l, :].ravel(), 1)
        counts = c if counts is None else counts + c
    misses = httpx.get(srv.url + "/router_misses/count-check", timeout=60).json()
    independent = {str(l): {"observed_selections": int(counts[l].sum()),
                            "missed_selections": int(sum(counts[l][e] for e in range(counts.shape[1]) if e not in core[l]))}
                   for l in range(counts.shape[0])}
    res["counter_check"] = {"routed_experts_shapes": lens, "independent": independent, "ours": misses}
    log("counter check", independent.get("0"), str(misses)[:400])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/model")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--arms", default="stock-gpu,reap-core,reap-empty,stock-uva")
    ap.add_argument("--core-fraction", type=float, default=0.25)
    ap.add_argument("--eager", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    model = Path(args.model)
    results_path = out / "gpu_e2e.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}

    def save():
        results_path.write_text(json.dumps(results, indent=1))

    cfg = json.loads((model / "config.json").read_text())
    expert_gib = cfg["num_hidden_layers"] * cfg["num_experts"] * 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"] * 2 / 2**30
    common = COMMON + (["--enforce-eager"] if args.eager else [])
    vllm = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)] + common
    reap = [sys.executable, "-m", "reap_swap.server", str(model)] + common
    ref = results.get("stock-gpu", {}).get("greedy")
    for arm in args.arms.split(","):
        log("arm", arm)
        try:
            if arm == "stock-gpu":
                with Server(arm, vllm, out) as srv:
                    results[arm] = {"startup_s": srv.startup_s, "greedy": greedy(srv.url),
                                    "decode_1": decode_speed(srv.url, 1), "decode_8": decode_speed(srv.url, 8, n=128)}
                    ref = results[arm]["greedy"]
                    log(arm, results[arm]["decode_1"], results[arm]["decode_8"])
            elif arm == "stock-uva":
                half = ["--offload-backend", "uva", "--cpu-offload-gb", f"{expert_gib / 2:.3f}",
                        "--cpu-offload-params", "w13_weight", "w2_weight"]
                with Server(arm, vllm + half, out) as srv:
                    g = greedy(srv.url)
                    results[arm] = {"startup_s": srv.startup_s, "greedy": g,
                                    "vs_stock_gpu": compare(ref, g) if ref else None,
                                    "decode_1": decode_speed(srv.url, 1), "decode_8": decode_speed(srv.url, 8, n=128)}
                    log(arm, results[arm]["decode_1"], results[arm]["decode_8"])
            elif arm == "reap-routed":
                plan_path = out / "plan-reap-routed.json"
                plan = make_plan(model, args.core_fraction, 8, plan_path)
                res = results.setdefault(arm, {})
                with Server(arm, reap + ["--reap-plan", str(plan_path), "--enable-return-routed-experts"], out) as srv:
                    res["startup_s"] = srv.startup_s
                    counter_check(srv, plan, res)
            elif arm in ("reap-core", "reap-empty"):
                frac = args.core_fraction if arm == "reap-core" else 0.0
                plan_path = out / f"plan-{arm}.json"
                make_plan(model, frac, 8, plan_path)
                res = results.setdefault(arm, {})
                with Server(arm, reap + ["--reap-plan", str(plan_path)], out) as srv:
                    res["startup_s"] = srv.startup_s
                    reap_measure(srv, "start", None, res, ref)
                    if arm == "reap-core":
                        n_core = int(cfg["num_experts"] * frac)
                        experts = cfg["num_experts"]
                        for pct in (50, 100, 25):
                            k = experts * pct // 100
                            aset = {f"layer_{l}": list(range(n_core, max(n_core, k)))
                                    for l in range(cfg["num_hidden_layers"])}
                            reap_measure(srv, f"swap{pct}_{len(res)}", aset, res, ref)
                            save()
            save()
        except Exception as exc:  # keep going with the next arm
            log(arm, "FAILED", repr(exc))
            results[arm] = {"error": repr(exc)}
            save()
    save()


if __name__ == "__main__":
    main()
