"""Time the device cache's per-layer step on CUDA (issue 17): eager, replayed in a CUDA graph, and
torch.compile'd then replayed in a graph (checked equal to eager, state and remap, every step).

    PYTHONPATH=$PWD python research/gpu/bench_device_cache.py --log-dir $LOGDIR   # ~1-2 min on an H200

Writes $LOGDIR/device_cache_bench{--suffix}.json and prints one line per case: microseconds per
layer-step (policy only: no slot copy, whose cost is bytes / PCIe bandwidth, measured elsewhere).
``fast_*``: the Triton step, its mismatch count against the torch step (state tensors and remapped
ids, every step): the vectorised step (device_cache_fast.py, the serving default; ``--fast-warps``), same checks.
``*_graph48_us``: 48 layer-steps (48 caches, the same ids) captured in ONE graph and replayed with
the next step's routing each time, per layer-step: what a decode step pays per MoE layer, without
the per-replay launch cost that the single-step ``*_graph_us`` columns include
(``empty_graph_us``: that floor, a graph of one tiny kernel). ``expert_hit_rate``: the torch
reference's over the trace (random skewed routing: misses on most steps, so the fast step's
no-ranking/no-placement shortcut is not the common case here). ``copy_noop_graph48_us``: the
slot-copy launch of a step that admits nothing, per layer (48 in one graph, 9.4 MB units):
the persistent kernel (device_cache_copy.copy_units, the default since branch ``copynoop``;
``copy_programs``: its fixed grid); ``copy_noop_graph48_dense_us``: the first kernel (grid
N x chunks). ``copy_admit{k}_graph48_us`` / ``copy_admit{k}_gbps`` (and ``_dense_``): 48 layers
each admitting k experts (k = 1, 4, 16) from HOST-backed units of a real cache range
(device_cache_range.CacheRange: pinned host units read over PCIe, HBM slots), per layer and in
GB/s of expert bytes; the sources rotate over 48 units (480 MiB, far beyond L2) so no layer
re-reads cached bytes; ``copy_admit_mismatched``: slots not bit-equal to their source (or touched
without admission) after a replay, both kernels. ``--copy-only``: just these columns (~1 min).
Decision input: the step must cost well under ~3 % of a decode token per layer (research.md,
issue 17, device mechanism).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from reap_swap.engine.device_cache import copy as device_cache_copy
from reap_swap.engine.device_cache import fast as device_cache_fast
from reap_swap.engine.device_cache.copy import copy_units, copy_units_dense, unit_view
from reap_swap.engine.device_cache.fast import fast_policy
from reap_swap.engine.device_cache.layer import DeviceCache, remap_ids, step_counts

LAYERS = 48


def _ids(gen, steps, rows, experts, top_k):
    logits = torch.randn(steps, rows, experts, generator=gen) + torch.linspace(3, 0, experts)
    return torch.topk(logits, top_k, dim=-1).indices.to(torch.int32).cuda()


def _one(cache, ids):
    return remap_ids(ids, cache.step(step_counts(ids, cache.num_experts)))


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
    for name, fn in (("fast", _fast),):
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
    return out


def _copy_graph(copy_fn, units, plans, experts):
    copy_fn(units, plans[0], experts)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for plan in plans:
            copy_fn(units, plan, experts)
    return g


def bench_copy_noop(experts, slots, steps) -> dict:
    """The copy launch of a step admitting nothing, 48 per graph, both kernels (9.4 MB units)."""
    out = {}
    units = torch.zeros(experts + slots, 9_437_184 // 8, dtype=torch.int64, device="cuda")
    nothing = [torch.full((slots,), -1, dtype=torch.int64, device="cuda")] * LAYERS
    for name, fn in (("", copy_units), ("_dense", copy_units_dense)):
        g = _copy_graph(fn, units, nothing, experts)
        out[f"copy_noop_graph48{name}_us"] = _time(lambda t, g=g: g.replay(), min(steps, 50)) / LAYERS
    out["copy_programs"] = device_cache_copy.programs_for(units, slots)
    del units
    return out


def admit_plans(slots, k, sources, device) -> list[torch.Tensor]:
    """Per layer a ``copy_expert``: k admissions spread over the N slots, the sources rotating
    over the ``sources`` host units (consecutive layers read different bytes)."""
    where = [j * (slots // k) for j in range(k)]
    plans = []
    for layer in range(LAYERS):
        p = torch.full((slots,), -1, dtype=torch.int64)
        p[where] = torch.tensor([(layer * k + j) % sources for j in range(k)])
        plans.append(p.to(device))
    return plans


class AdmitRange:
    """One real cache range for the admission columns: SOURCES host-backed units, MAX_SLOTS HBM
    slots, units of 9.4 MB rounded up to the mapping granularity; sources filled once."""

    SOURCES, MAX_SLOTS = LAYERS, 128

    def __init__(self) -> None:
        from reap_swap.engine import vmm
        from reap_swap.engine.device_cache.range import CacheRange

        gran = vmm.ensure_available(0)
        self.unit_bytes = -(-9_437_184 // gran) * gran
        self.rng = CacheRange.create(self.SOURCES, self.MAX_SLOTS, self.unit_bytes, 0)
        self.units = unit_view(self.rng.as_bytes(), self.SOURCES + self.MAX_SLOTS, self.unit_bytes)
        gen = torch.Generator(device="cuda").manual_seed(0)
        for e in range(self.SOURCES):  # written over PCIe into the host units, once
            self.units[e].copy_(
                torch.randint(-(2**62), 2**62, self.units[e].shape, device="cuda", generator=gen)
            )
        torch.cuda.synchronize()

    def plans(self, slots, k):
        return admit_plans(slots, k, self.SOURCES, "cuda")

    def mismatched(self, plan, slots) -> int:
        """Slots (of the first ``slots``) not equal to their source / not left at the sentinel."""
        bad = 0
        for s, e in enumerate(plan.tolist()):
            got = self.units[self.SOURCES + s]
            bad += 0 if (torch.equal(got, self.units[e]) if e >= 0 else bool((got == -7).all())) else 1
        return bad

    def release(self) -> None:
        del self.units
        self.rng.release()


def bench_copy_admit(admit: AdmitRange, slots, ks=(1, 4, 16)) -> dict:
    """48 layers each admitting k host-backed experts, per layer (us) and GB/s, both kernels."""
    out, bad = {}, 0
    for k in (k for k in ks if k <= slots):
        plans = admit.plans(slots, k)
        for name, fn in (("", copy_units), ("_dense", copy_units_dense)):
            g = _copy_graph(fn, admit.units, plans, admit.SOURCES)
            admit.units[admit.SOURCES :].fill_(-7)
            g.replay()  # warm, then checked: the last layer's plan is what the slots hold
            torch.cuda.synchronize()
            bad += admit.mismatched(plans[-1], slots)
            us = _time(lambda t, g=g: g.replay(), 3) / LAYERS
            out[f"copy_admit{k}{name}_graph48_us"] = us
            out[f"copy_admit{k}{name}_gbps"] = round(k * admit.unit_bytes / (us * 1e3), 2)
            del g
    out["copy_admit_mismatched"] = bad
    out["copy_admit_unit_bytes"] = admit.unit_bytes
    return out


def bench(experts, slots, rows, top_k, steps, compiled) -> dict:
    gen = torch.Generator().manual_seed(0)
    ids = _ids(gen, steps, rows, experts, top_k)
    eager = DeviceCache(experts, slots, "cuda")
    out = {"experts": experts, "slots": slots, "rows": rows, "top_k": top_k, "steps": steps}
    out["eager_us"] = _time(lambda t: _one(eager, ids[t]), steps)
    fast_eager = DeviceCache(experts, slots, "cuda")
    _fast(fast_eager, ids[0].clone())
    out["fast_eager_us"] = _time(lambda t: _fast(fast_eager, ids[t]), steps)
    cases = [("graph_us", _one), ("fast_graph_us", _fast)]
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


def bench_copies(experts, slots, steps, admit) -> dict:
    out = bench_copy_noop(experts, slots, steps)
    try:
        out.update(
            bench_copy_admit(admit, slots) if not isinstance(admit, str) else {"copy_admit_error": admit}
        )
    except Exception as exc:  # noqa: BLE001 - keep the policy and no-op columns
        out["copy_admit_error"] = f"{type(exc).__name__}: {exc}"
    return out


def _admit_range():
    try:
        return AdmitRange()
    except Exception as exc:  # noqa: BLE001 - no VMM here: the admission columns say why
        return f"{type(exc).__name__}: {exc}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--log-dir", required=True, type=Path)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile case")
    p.add_argument("--suffix", default="", help="appended to the JSON file's name")
    p.add_argument("--fast-warps", type=int, default=device_cache_fast.NUM_WARPS)
    p.add_argument("--copy-only", action="store_true", help="only the copy columns (no policy step)")
    p.add_argument("--copy-programs-per-sm", type=int, default=device_cache_copy.PROGRAMS_PER_SM)
    args = p.parse_args()
    device_cache_fast.NUM_WARPS = args.fast_warps
    device_cache_copy.PROGRAMS_PER_SM = args.copy_programs_per_sm
    args.log_dir.mkdir(parents=True, exist_ok=True)
    results, admit = [], _admit_range()
    for experts, slots, rows, top_k in (
        (128, 64, 1, 8),
        (128, 64, 8, 8),
        (128, 32, 256, 8),
        (256, 128, 8, 8),
        (128, 64, 64, 8),
        (512, 128, 4, 8),
    ):
        r = {"experts": experts, "slots": slots, "rows": rows, "top_k": top_k}
        try:
            if not args.copy_only:
                r.update(bench(experts, slots, rows, top_k, args.steps, not args.no_compile))
            r.update(bench_copies(experts, slots, args.steps, admit))
        except Exception as exc:  # noqa: BLE001 - record the failure, keep the other cases
            r["error"] = f"{type(exc).__name__}: {exc}"
        r["fast_warps"] = args.fast_warps
        results.append(r)
        print(json.dumps(r), flush=True)
    (args.log_dir / f"device_cache_bench{args.suffix}.json").write_text(json.dumps(results, indent=1))
    if not isinstance(admit, str):
        admit.release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
