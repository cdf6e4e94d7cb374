#!/usr/bin/env python3
"""Swap speed and mechanism cost of the CUDA residency engine, outside vLLM's server (H200).

Measures, on Qwen3-30B-A3B-shaped layers (E=128, H=2048, I=768, bf16, top-8):
  * swap-in of 1 %, 10 %, 100 % of the pool and of a 1 GiB delta: bytes copied, seconds, GB/s;
  * the no-op swap;
  * vLLM's fused_experts time (CUDA-graph replay) at 100/50/25/0 % of experts resident, next to
    plain HBM weights and plain pinned UVA weights.
Usage: PYTHONPATH=/tmp/site python3 research/gpu/gpu_swap_bench.py --out result.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from reap_swap.engine.residency.state import standalone_state, swap_state

E, H, I, TOPK = 128, 2048, 768, 8


def _weights(gen):
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    return w13, w2


def bench_swaps(num_layers: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = {l: _weights(gen) for l in range(num_layers)}
    t0 = time.perf_counter()
    st, _ = standalone_state(layers, num_slots=num_layers * E)
    setup = time.perf_counter() - t0
    del layers
    torch.cuda.empty_cache()
    unit = st.pool.unit_bytes
    pool_experts = num_layers * E
    all_keys = [(l, e) for l in range(num_layers) for e in range(E)]
    cases = {
        "1pct_pool": max(1, pool_experts // 100),
        "10pct_pool": pool_experts // 10,
        "1GiB_delta": -(-(2**30) // unit),
        "100pct_pool": pool_experts,
    }
    out = {
        "layers": num_layers,
        "unit_bytes": unit,
        "pool_slots": pool_experts,
        "setup_s": setup,
        "cases": {},
    }
    for name, n in cases.items():
        runs = []
        for rep in range(3):
            swap_state(st, {})  # everything back on host (no copy)
            torch.cuda.synchronize()
            keys = all_keys[:n] if rep % 2 == 0 else all_keys[-n:]
            target: dict[int, list[int]] = {}
            for l, e in keys:
                target.setdefault(l, []).append(e)
            t = time.perf_counter()
            res = swap_state(st, target)
            dt = time.perf_counter() - t
            runs.append(
                {
                    "experts": n,
                    "bytes": res.bytes_copied,
                    "s": dt,
                    "gbps": res.bytes_copied / dt / 1e9,
                    "phases": res.phases,
                }
            )
        out["cases"][name] = runs
    t = time.perf_counter()
    for _ in range(10):
        swap_state(st, target)
    out["noop_swap_s"] = (time.perf_counter() - t) / 10
    t = time.perf_counter()
    swap_state(st, {})
    out["evict_all_s"] = time.perf_counter() - t
    for entry in st.layers.values():
        entry.rng.release()
    st.pool.release()
    return out


def bench_remap() -> dict:
    """Driver cost of remapping 128 adjacent units: access set per unit vs once per run."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    st, _ = standalone_state({0: _weights(gen)}, num_slots=E)
    rng, pool = st.layers[0].rng, st.pool
    out = {}
    for label, defer in (("per_unit_access", False), ("access_per_run", True)):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for u in range(E):
            rng.map_device(u, pool.handles[u], defer_access=defer)
        calls = rng.flush_access()
        t_in = time.perf_counter() - t
        t = time.perf_counter()
        for u in range(E):
            rng.map_host(u, defer_access=defer)
        rng.flush_access()
        t_out = time.perf_counter() - t
        out[label] = {
            "map_device_us_per_unit": t_in / E * 1e6,
            "map_host_us_per_unit": t_out / E * 1e6,
            "set_access_calls": E if not defer else calls,
        }
    rng.release()
    pool.release()
    return out


def bench_kernel() -> dict:
    from vllm.model_executor.layers.fused_moe import fused_experts, fused_topk
    from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor

    gen = torch.Generator(device="cuda").manual_seed(1)
    w13, w2 = _weights(gen)
    st, views = standalone_state({0: (w13, w2)}, num_slots=E)
    v13, v2 = views[0]
    u13 = get_accelerator_view_from_cpu_tensor(w13.cpu().pin_memory())
    u2 = get_accelerator_view_from_cpu_tensor(w2.cpu().pin_memory())
    res = {}
    for m in (1, 8, 64):
        x = torch.randn(m, H, device="cuda", generator=gen).to(torch.bfloat16)
        tw, ti, _ = fused_topk(x, torch.randn(m, E, device="cuda", generator=gen), TOPK, renormalize=True)
        distinct = ti.flatten().unique().tolist()

        def timed(a, b, x=x, tw=tw, ti=ti):
            fused_experts(x, a, b, tw, ti)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fused_experts(x, a, b, tw, ti)
            for _ in range(5):
                g.replay()
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(50):
                g.replay()
            e.record()
            torch.cuda.synchronize()
            return s.elapsed_time(e) / 50 * 1000  # µs

        row = {"hbm_us": timed(w13, w2), "uva_us": timed(u13, u2)}
        for frac in (1.0, 0.5, 0.25, 0.0):
            k = int(E * frac)
            resident = torch.randperm(E, generator=torch.Generator().manual_seed(k))[:k].tolist()
            swap_state(st, {0: resident})
            hit = sum(1 for e in ti.flatten().tolist() if e in set(resident)) / ti.numel()
            hit_distinct = sum(1 for e in distinct if e in set(resident)) / len(distinct)
            t = timed(v13, v2)
            bound = row["hbm_us"] + (1 - hit_distinct) * (row["uva_us"] - row["hbm_us"])
            row[f"vmm_{int(frac * 100)}"] = {
                "us": t,
                "hit": hit,
                "hit_distinct": hit_distinct,
                "bound_us": bound,
                "of_bound": bound / t,
            }
        res[f"M{m}"] = row
    st.layers[0].rng.release()
    st.pool.release()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--out", default="swap_bench.json")
    args = ap.parse_args()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        import vllm

        result["vllm"] = vllm.__version__
    except ImportError:
        pass
    result["remap"] = bench_remap()
    result["swaps"] = bench_swaps(args.layers)
    result["kernel"] = bench_kernel()
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
