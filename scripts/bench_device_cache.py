"""Time the device cache's per-layer step on CUDA (issue 17): eager, replayed in a CUDA graph, and
torch.compile'd then replayed in a graph (checked equal to eager, state and remap, every step).

    PYTHONPATH=$PWD python scripts/bench_device_cache.py --log-dir $LOGDIR   # ~1-2 min on an H200

Writes $LOGDIR/device_cache_bench{--suffix}.json and prints one line per case: microseconds per
layer-step (policy only: no slot copy, whose cost is bytes / PCIe bandwidth, measured elsewhere).
``fused_*``: the first one-program Triton step (device_cache_fused.py), its mismatch count
against the torch step (state tensors and remapped ids, every step). ``fast_*``: the vectorised
step (device_cache_fast.py, the serving default; ``--fast-warps``), same checks.
``*_graph48_us``: 48 layer-steps (48 caches, the same ids) captured in ONE graph and replayed with
the next step's routing each time, per layer-step: what a decode step pays per MoE layer, without
the per-replay launch cost that the single-step ``*_graph_us`` columns include
(``empty_graph_us``: that floor, a graph of one tiny kernel). ``expert_hit_rate``: the torch
reference's over the trace (random skewed routing: misses on most steps, so the fast step's
no-ranking/no-placement shortcut is not the common case here). ``copy_noop_graph48_us``: the
slot-copy launch of a step that admits nothing (grid N x chunks of a 9.4 MB unit), per layer, for
scale. Decision input: the step must cost well under ~3 % of a decode token per layer (research.md,
issue 17, device mechanism).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from reap_swap.residency import device_cache_fast
from reap_swap.residency.device_cache import DeviceCache, remap_ids, step_counts
from reap_swap.residency.device_cache_copy import copy_units
from reap_swap.residency.device_cache_fast import fast_policy
from reap_swap.residency.device_cache_fused import fused_policy

LAYERS = 48


def _ids(gen, steps, rows, experts, top_k):
    logits = torch.randn(steps, rows, experts, generator=gen) + torch.linspace(3, 0, experts)
    return torch.topk(logits, top_k, dim=-1).indices.to(torch.int32).cuda()


def _one(cache, ids):
    return remap_ids(ids, cache.step(step_counts(ids, cache.num_experts)))


def _fused(cache, ids):
    return fused_policy(cache, ids, None)


def _fast(cache, ids):
    return fast_policy(cache, ids, None)


def _graph(fn, cache, static):
    saved = [t.clone() for t in cache.state_tensors()]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn(cache, static)
    torch.cuda.current_stream().wait_stream(s)
    for t, v in zip(cache.state_tensors(), saved, strict=True):
        t.copy_(v)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(cache, static)
    return g, out


def _time(run, steps) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for t in range(steps):
        run(t)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e6


def _graph_layers(fn, caches, static):
    """One graph of ``fn`` over every cache in turn (a decode step's MoE layers)."""
    saved = [[t.clone() for t in c.state_tensors()] for c in caches]
    for c in caches:
        fn(c, static)  # compile / allocate outside the capture
    torch.cuda.synchronize()
    for c, vals in zip(caches, saved, strict=True):
        for t, v in zip(c.state_tensors(), vals, strict=True):
            t.copy_(v)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [fn(c, static) for c in caches]
    return g, outs


def bench_layers(experts, slots, ids, steps) -> dict:
    """Per layer-step in a 48-layer graph: fused, fast (last layer checked against eager torch),
    the empty-graph floor and the no-op slot copy."""
    out = {}
    for name, fn in (("fused", _fused), ("fast", _fast)):
        caches = [DeviceCache(experts, slots, "cuda") for _ in range(LAYERS)]
        ref, static = DeviceCache(experts, slots, "cuda"), ids[0].clone()
        g, outs = _graph_layers(fn, caches, static)
        mismatches = 0
        for t in range(steps):
            static.copy_(ids[t])
            g.replay()
            want = _one(ref, ids[t])
            same = torch.equal(outs[-1], want) and all(
                torch.equal(a, b)
                for a, b in zip(caches[-1].state_tensors(), ref.state_tensors(), strict=True)
            )
            mismatches += 0 if same else 1
        out[f"{name}_graph48_mismatched_steps"] = mismatches
        c = ref.read_counters()
        out["expert_hit_rate"] = round(c["expert_hits"] / max(c["experts"], 1), 3)

        def replay(t, static=static, g=g):  # new routing every step, as in serving
            static.copy_(ids[t])
            g.replay()

        out[f"{name}_graph48_us"] = _time(replay, steps) / LAYERS
    tiny = torch.zeros(1, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        tiny.add_(1)
    out["empty_graph_us"] = _time(lambda t: g.replay(), steps)
    units = torch.zeros(experts + slots, 9_437_184 // 8, dtype=torch.int64, device="cuda")
    nothing = torch.full((slots,), -1, dtype=torch.int64, device="cuda")
    copy_units(units, nothing, experts)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(LAYERS):
            copy_units(units, nothing, experts)
    out["copy_noop_graph48_us"] = _time(lambda t: g.replay(), min(steps, 20)) / LAYERS
    del units
    return out


def bench(experts, slots, rows, top_k, steps, compiled) -> dict:
    gen = torch.Generator().manual_seed(0)
    ids = _ids(gen, steps, rows, experts, top_k)
    eager = DeviceCache(experts, slots, "cuda")
    out = {"experts": experts, "slots": slots, "rows": rows, "top_k": top_k, "steps": steps}
    out["eager_us"] = _time(lambda t: _one(eager, ids[t]), steps)
    fused_eager = DeviceCache(experts, slots, "cuda")
    _fused(fused_eager, ids[0].clone())  # compile the Triton kernel outside the timing
    out["fused_eager_us"] = _time(lambda t: _fused(fused_eager, ids[t]), steps)
    fast_eager = DeviceCache(experts, slots, "cuda")
    _fast(fast_eager, ids[0].clone())
    out["fast_eager_us"] = _time(lambda t: _fast(fast_eager, ids[t]), steps)
    cases = [("graph_us", _one), ("fused_graph_us", _fused), ("fast_graph_us", _fast)]
    if compiled:
        cases.append(("compiled_graph_us", torch.compile(_one, dynamic=False)))
    for name, fn in cases:
        cache, ref = DeviceCache(experts, slots, "cuda"), DeviceCache(experts, slots, "cuda")
        static = ids[0].clone()
        g, remapped = _graph(fn, cache, static)
        mismatches = 0
        for t in range(steps):
            static.copy_(ids[t])
            g.replay()
            want = _one(ref, ids[t])
            same = torch.equal(remapped, want) and all(
                torch.equal(a, b) for a, b in zip(cache.state_tensors(), ref.state_tensors(), strict=True)
            )
            mismatches += 0 if same else 1
        out[name.replace("_us", "_mismatched_steps")] = mismatches

        def replay(t, static=static, g=g):
            static.copy_(ids[t])
            g.replay()

        out[name] = _time(replay, steps)
    out.update(bench_layers(experts, slots, ids, steps))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--log-dir", required=True, type=Path)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile case")
    p.add_argument("--suffix", default="", help="appended to the JSON file's name")
    p.add_argument("--fast-warps", type=int, default=device_cache_fast.NUM_WARPS)
    args = p.parse_args()
    device_cache_fast.NUM_WARPS = args.fast_warps
    args.log_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for experts, slots, rows, top_k in (
        (128, 64, 1, 8),
        (128, 64, 8, 8),
        (128, 32, 256, 8),
        (256, 128, 8, 8),
        (128, 64, 64, 8),
        (512, 128, 4, 8),
    ):
        try:
            r = bench(experts, slots, rows, top_k, args.steps, not args.no_compile)
        except Exception as exc:  # noqa: BLE001 - record the failure, keep the other cases
            r = {"experts": experts, "slots": slots, "rows": rows, "error": f"{type(exc).__name__}: {exc}"}
        r["fast_warps"] = args.fast_warps
        results.append(r)
        print(json.dumps(r), flush=True)
    (args.log_dir / f"device_cache_bench{args.suffix}.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
