"""The device cache under the conditions of issue 42's report, at kernel level:
random bf16 Qwen3-MoE shape, near-uniform routing, plan core 0..31 pinned in HBM, N = 16 cache slots
(`--reap-cache-slots swaps` at a 50 % pool: n = min(2*top_k, (768-384)/12/2) = 16), E + N = 144,
per-request swaps (core + a slice) every 20 steps and a storm (a swap every step), CUDA-graph
replays of 1-row and 8-row (3 padding rows with garbage ids) steps, a 16-row padded prefill graph
and eager prefills of 17..40 rows (read-through steps).

What it adds over test_device_cache_serving_sequence.py / test_device_cache_seeded.py:
- the served slot count (N = 16, E + N = 144) and near-uniform routing (heavy churn: ~5 admissions
  per 1-row step, read-through at every prefill);
- the pinned set really HBM-backed in the experts' own units and *moved by swaps* (map_device /
  map_host between steps after a quiesce, then DeviceCache.set_pinned: what cuda_backend.apply +
  device_cache_serving.on_swap do), inside a run with captured graphs;
- the reference is the stock kernel on CONTIGUOUS HBM COPIES of the original weights, not on the
  layer range: the server's --reap-cache-shadow compares against run_stock, which reads the same
  own units as the cached call, so wrong bytes in a pinned/host own unit are invisible to it;
- every 10 steps, every occupied slot AND every own unit (pinned or host-backed) is compared with
  the masters.

Run on the GPU box (vLLM 0.26.0 kit installed):
    PYTHONPATH=$PWD python -m pytest -q -s tests/gpu/test_device_cache_uniform_swaps.py  (results: research.md)
A failure names the step, its kind, the rows, and which units/slots hold wrong bytes.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

E, N, H, INTER, TOPK = 128, 16, 2048, 768, 8
CORE = list(range(32))


@pytest.fixture(scope="module")
def fm():
    return pytest.importorskip("vllm.model_executor.layers.fused_moe")


@pytest.fixture(scope="module")
def fmm():
    return pytest.importorskip("vllm.model_executor.layers.fused_moe.fused_moe")


@pytest.fixture(scope="module")
def layer():
    from reap_swap.engine import vmm
    from reap_swap.engine.device_cache.range import rehome_with_slots
    from reap_swap.sizing.unit_layout import plan_unit

    gen = torch.Generator(device="cpu").manual_seed(0)
    w13 = (torch.randn(E, 2 * INTER, H, generator=gen) * 0.02).to(torch.bfloat16).cuda()
    w2 = (torch.randn(E, H, INTER, generator=gen) * 0.02).to(torch.bfloat16).cuda()
    slabs = [("w13_weight", w13[0].numel() * 2), ("w2_weight", w2[0].numel() * 2)]
    unit = plan_unit(slabs, vmm.ensure_available(0)).unit_bytes
    rng, range_bytes, views, ext = rehome_with_slots(w13, w2, unit, N, 0)
    pool = vmm.DeviceSlotPool.create(64, unit, 0)  # the swap table's slots (core + slices)
    yield {"w13": w13, "w2": w2, "unit": unit, "rng": rng, "bytes": range_bytes, "views": views,
           "ext": ext, "pool": pool}  # fmt: skip
    for e in range(E):
        rng.map_host(e)
    pool.release()
    rng.release()


@pytest.fixture
def stock_rule(monkeypatch, fmm):
    from reap_swap.compat import moe_cache

    monkeypatch.setattr(moe_cache, "_UNITS", {E + N: E})
    monkeypatch.setattr(
        fmm, "_prepare_expert_assignment", moe_cache.stock_assignment(fmm._prepare_expert_assignment)
    )


class Swapper:
    """The pinned set in HBM: own units remapped onto pool slots (the engine's swap, reduced)."""

    def __init__(self, layer):
        self.layer, self.where, self.free = layer, {}, list(range(64))

    def apply(self, step, pinned):
        from reap_swap.engine import vmm

        rng, pool, unit = self.layer["rng"], self.layer["pool"], self.layer["unit"]
        torch.cuda.synchronize()  # quiesce (swap.py)
        for e in sorted(set(self.where) - set(pinned)):
            rng.map_host(e)
            self.free.append(self.where.pop(e))
        for e in sorted(set(pinned) - set(self.where)):
            s = self.free.pop(0)
            vmm.copy_async(
                pool.unit_address(s), rng.unit_address(e), unit, torch.cuda.current_stream().cuda_stream
            )
            self.where[e] = s
        torch.cuda.synchronize()
        for e, s in sorted(self.where.items()):
            if rng.backing[e] is None:
                rng.map_device(e, pool.handles[s], defer_access=True)
        rng.flush_access()
        step.cache.set_pinned(sorted(pinned))  # device_cache_serving.on_swap


def _cfg(fmm, rows):
    return fmm.try_get_optimal_moe_config((E, 2 * INTER, H), (E, H, INTER), TOPK, None, rows)


def _cached(fm, fmm, layer, x, tw, ids):
    with fm.override_config(_cfg(fmm, x.shape[0])):
        return fm.fused_experts(x, *layer["ext"], tw, ids, global_num_experts=E + N)


def _uniform(gen, rows):
    logits = torch.randn(rows, E, generator=gen) * 0.3  # near-uniform routing
    tw, ti = torch.topk(torch.softmax(logits, -1), TOPK)
    tw = tw / tw.sum(-1, keepdim=True)
    x = torch.randn(rows, H, generator=gen).to(torch.bfloat16)
    return x.cuda(), tw.float().cuda(), ti.to(torch.int32).cuda()


def _bad_units(layer, step):
    """Slots whose bytes are not their expert's, own units whose bytes are not the master's."""
    units = step.units
    w13, w2 = layer["w13"], layer["w2"]
    v13, v2 = layer["views"]
    bad_own = [e for e in range(E) if not (torch.equal(v13[e], w13[e]) and torch.equal(v2[e], w2[e]))]
    bad_slot = [
        s
        for s, e in enumerate(step.cache.slot_expert.tolist())
        if e >= 0 and not torch.equal(units[E + s], units[e])
    ]
    return bad_own, bad_slot


def test_uniform_routing_with_swaps_bitwise(fm, fmm, layer, stock_rule):
    from reap_swap.engine.device_cache.copy import unit_view
    from reap_swap.engine.device_cache.layer import DeviceCache, LayerStep

    step = LayerStep(
        DeviceCache(E, N, "cuda"), unit_view(layer["bytes"], E + N, layer["unit"]), step="triton"
    )
    swapper = Swapper(layer)
    swapper.apply(step, CORE)  # the plan core, pinned at load
    gen = torch.Generator().manual_seed(7)
    pick = random.Random(7)
    stock_w = (layer["w13"].clone(), layer["w2"].clone())  # contiguous HBM copies: the stock server's bytes

    def stock(x, tw, ti):
        return fm.fused_experts(x, *stock_w, tw, ti)

    # graphs: 1 row, 8 rows (5 real), 16 rows (a padded prefill of 11 tokens); warm-ups run first
    graphs = {}
    for rows, real in ((1, 1), (8, 5), (16, 11)):
        x, tw, ti = _uniform(gen, rows)
        valid = (torch.arange(rows) < real).cuda()
        for _ in range(2):
            _cached(fm, fmm, layer, x, tw, step(ti, valid))
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = _cached(fm, fmm, layer, x, tw, step(ti, valid))
        graphs[rows] = (g, x, tw, ti, valid, out, real)

    def run_graph(rows):
        g, x, tw, ti, valid, out, real = graphs[rows]
        nx, ntw, nti = _uniform(gen, rows)
        junk = torch.randint(0, E, nti.shape, generator=gen, dtype=torch.int32).cuda()
        nti = torch.where(valid[:, None], nti, junk)  # stale ids on padding rows
        x.copy_(nx), tw.copy_(ntw), ti.copy_(nti)
        g.replay()
        return out[:real], stock(x, tw, ti)[:real]

    storm = False
    for t in range(1500):
        if t % 300 == 250:
            storm = not storm
        if storm or t % 20 == 19:  # a per-request swap: core + a slice (or back to the core)
            slice_ = pick.sample(range(32, E), pick.choice([0, 8, 16, 24]))
            swapper.apply(step, CORE + slice_)
        kind = pick.random()
        if kind < 0.05:  # an eager read-through prefill
            rows = pick.randint(17, 40)
            x, tw, ti = _uniform(gen, rows)
            got = _cached(fm, fmm, layer, x, tw, step(ti, torch.ones(rows, dtype=torch.bool, device="cuda")))
            ref, what = stock(x, tw, ti), f"eager {rows}"
        else:
            rows = 16 if kind < 0.1 else 8 if kind < 0.3 else 1
            got, ref = run_graph(rows)
            what = f"graph {rows}"
        if not torch.equal(got, ref):
            diff = (got.float() - ref.float()).abs().max().item()
            own, slots = _bad_units(layer, step)
            pytest.fail(
                f"step {t} ({what}): max diff {diff:.3e}; own units with wrong bytes {own}, slots {slots}; "
                f"pinned {sorted(swapper.where)[:40]}; counters {step.cache.read_counters()}"
            )
        if t % 10 == 0:
            own, slots = _bad_units(layer, step)
            assert not own and not slots, f"step {t}: own units {own}, slots {slots} hold wrong bytes"
    c = step.cache.read_counters()
    print("UNIFORM_SWAPS", c)
    assert c["admitted"] > 1000 and c["read_through_steps"] > 20, c
