#!/usr/bin/env python3
"""Why does a swap's publish step (cuMemSetAccess per run of remapped units) cost more per rank
under TP=2 (23.8 ms for a 25 -> 50 % swap, research.md runs 5-6) than on one GPU (3 ms for a
100 % swap, run 4)? Outside vLLM, on the 2-GPU machine, with the engine's own swap path.

Each condition: 12 layers of TP=2-shard-shaped experts (E=128, H=2048, I=384 per rank, bf16),
a pool for 50 %, then 5 times: 25 % -> 50 % (32 admissions per layer) and back; phases per swap.
  alone       one process on GPU 0
  peer        one process on GPU 0 after peer access to GPU 1 was enabled (as under TP)
  concurrent  two processes, GPU 0 and GPU 1, swapping at the same moments (as TP ranks do)
  full        one process on GPU 0, unsharded experts (I=768): the run-4 unit size
Needs torch and cuda-python only (no vLLM). Usage: python3 research/gpu/gpu_publish_cost.py --out F
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

E, H, LAYERS, REPS = 128, 2048, 12, 5


def run(device: int, inter: int, peer: bool, barrier=None) -> dict:
    import torch

    from reap_swap.engine.residency.state import standalone_state, swap_state

    torch.cuda.set_device(device)
    if peer:  # a device-to-device copy makes torch enable peer access (what TP's collectives need)
        other = 1 - device
        torch.ones(1, device=f"cuda:{other}").to(f"cuda:{device}")
    gen = torch.Generator(device=f"cuda:{device}").manual_seed(device)
    layers = {}
    for layer in range(LAYERS):
        w13 = (torch.randn(E, 2 * inter, H, device=f"cuda:{device}", generator=gen) * 0.02).to(torch.bfloat16)
        w2 = (torch.randn(E, H, inter, device=f"cuda:{device}", generator=gen) * 0.02).to(torch.bfloat16)
        layers[layer] = (w13, w2)
    st, _ = standalone_state(layers, num_slots=LAYERS * E // 2, device=device)
    del layers
    torch.cuda.empty_cache()
    quarter = {layer: list(range(E // 4)) for layer in range(LAYERS)}
    half = {layer: list(range(E // 2)) for layer in range(LAYERS)}
    swap_state(st, quarter)
    ups, downs = [], []
    for _ in range(REPS):
        if barrier is not None:
            barrier.wait()
        ups.append(swap_state(st, half).phases)
        if barrier is not None:
            barrier.wait()
        downs.append(swap_state(st, quarter).phases)
    unit = st.pool.unit_bytes
    for entry in st.layers.values():
        entry.rng.release()
    st.pool.release()

    def med(rows, key):
        return statistics.median(r[key] * 1000 for r in rows)

    return {
        "device": device,
        "inter": inter,
        "peer": peer,
        "unit_bytes": unit,
        "up_ms": {k: med(ups, k) for k in ups[0]},
        "down_ms": {k: med(downs, k) for k in downs[0]},
        "up_runs": ups,
    }


def _child(args):
    device, inter, peer, barrier, queue = args
    queue.put(run(device, inter, peer, barrier))


def concurrent(inter: int, peer: bool) -> list[dict]:
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_child, args=((d, inter, peer, barrier, queue),)) for d in (0, 1)]
    for p in procs:
        p.start()
    out = [queue.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return sorted(out, key=lambda r: r["device"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="publish_cost.json")
    ap.add_argument("--conditions", default="alone,peer,concurrent,concurrent_peer,full")
    a = ap.parse_args()
    result = {}
    for cond in a.conditions.split(","):
        try:
            if cond == "alone":
                result[cond] = run(0, 384, False)
            elif cond == "peer":
                result[cond] = run(0, 384, True)
            elif cond == "concurrent":
                result[cond] = concurrent(384, False)
            elif cond == "concurrent_peer":
                result[cond] = concurrent(384, True)
            elif cond == "full":
                result[cond] = run(0, 768, False)
        except Exception as exc:  # noqa: BLE001 - keep the other conditions
            result[cond] = {"error": repr(exc)}
        rows = result[cond] if isinstance(result[cond], list) else [result[cond]]
        for r in rows:
            print(
                cond,
                r.get("device"),
                "up",
                {k: round(v, 2) for k, v in (r.get("up_ms") or {}).items()},
                "down",
                {k: round(v, 2) for k, v in (r.get("down_ms") or {}).items()},
                r.get("error", ""),
                flush=True,
            )
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
