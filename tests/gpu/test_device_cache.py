"""The device expert cache on CUDA (issue 17): policy == simulator on a replayed trace (eager and
inside a CUDA graph), bitwise-equal fused-MoE outputs over E + N units with admissions, evictions
and read-through (eager and under a captured graph replayed with new inputs), a swap pinning its
set while the tail yields. One-line run (H200, ~1-2 min):

    PYTHONPATH=$PWD python -m pytest -q tests/gpu/test_device_cache.py 2>&1 | tee $LOGDIR/device_cache.log

The cached kernel runs under vLLM's ``override_config`` with the config vLLM picks for the stock
[E, ...] shapes: that is what compat.moe_cache's config alias does when serving (a config
looked up for E + N experts could tile differently and so round differently).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.gpu.standalone import replay_against_stock, skewed_routing  # noqa: E402

E, N, H, INTER, TOPK = 16, 6, 1024, 512, 2
TRACE = "data/traces/mini-moe-heldout.npz"


@pytest.fixture(scope="module")
def fm():
    return pytest.importorskip("vllm.model_executor.layers.fused_moe")


@pytest.fixture(scope="module")
def layer():
    from reap_swap.engine import vmm
    from reap_swap.engine.device_cache.range import rehome_with_slots
    from reap_swap.sizing.unit_layout import plan_unit

    gen = torch.Generator(device="cpu").manual_seed(0)
    w13 = (torch.randn(E, 2 * INTER, H, generator=gen) / 32).to(torch.bfloat16).cuda()
    w2 = (torch.randn(E, H, INTER, generator=gen) / 32).to(torch.bfloat16).cuda()
    slabs = [("w13_weight", w13[0].numel() * 2), ("w2_weight", w2[0].numel() * 2)]
    unit = plan_unit(slabs, vmm.ensure_available(0)).unit_bytes
    rng, range_bytes, views, ext = rehome_with_slots(w13, w2, unit, N, 0)
    yield {"w13": w13, "w2": w2, "unit": unit, "rng": rng, "bytes": range_bytes, "views": views, "ext": ext}
    rng.release()


def _cached(fm, layer, x, tw, ti, step):
    """Stock config for the [E, ...] shapes, then the kernel over E + N units on remapped ids."""
    import vllm.model_executor.layers.fused_moe.fused_moe as fmm

    cfg = fmm.try_get_optimal_moe_config(layer["w13"].size(), layer["w2"].size(), TOPK, None, x.shape[0])
    ids = step(ti)
    with fm.override_config(cfg):
        return fm.fused_experts(x, *layer["ext"], tw, ids, global_num_experts=E + N)


def _routing(gen, rows):
    return skewed_routing(gen, rows, E, H, TOPK)


def _layer_step(layer, slots=N):
    from reap_swap.engine.device_cache.copy import unit_view
    from reap_swap.engine.device_cache.layer import DeviceCache, LayerStep

    cache = DeviceCache(E, slots, "cuda")
    return LayerStep(cache, unit_view(layer["bytes"], E + N, layer["unit"]))


def test_a_policy_equals_simulator_on_the_trace_eager_and_in_a_graph():
    from reap_swap.cache.trace import load_trace
    from reap_swap.engine.device_cache.replay import Variant, compare_layer

    trace = load_trace(TRACE)
    for name, cap in (("dlfu", 6), ("dlfu-seeded", 9), ("core+dlfu", 9)):
        core = frozenset(range(4))
        compare_layer(trace, 1, Variant.of(name, core), cap, device="cuda")
    rows = int(max(trace.step_offsets[1:] - trace.step_offsets[:-1]))
    compare_layer(
        trace, 0, Variant.of("dlfu", frozenset()), 7, "cuda", step_fn=_graph_step(rows), pad_to=rows
    )


def _graph_step(rows):
    """A step_fn capturing step_counts + cache.step once (state restored after the warm-up)."""
    from reap_swap.engine.device_cache.layer import step_counts

    held = {}

    def run(cache, ids, valid):
        if "g" not in held:
            held["ids"], held["valid"] = ids.clone(), valid.clone()
            saved = [t.clone() for t in cache.state_tensors()]
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                cache.step(step_counts(held["ids"], cache.num_experts, held["valid"]))
            torch.cuda.current_stream().wait_stream(s)
            for t, v in zip(cache.state_tensors(), saved, strict=True):
                t.copy_(v)
            held["g"] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(held["g"]):
                cache.step(step_counts(held["ids"], cache.num_experts, held["valid"]))
        held["ids"].copy_(ids)
        held["valid"].copy_(valid)
        held["g"].replay()

    return run


def test_b_d_bitwise_equal_with_admissions_evictions_and_read_through(fm, layer):
    gen = torch.Generator().manual_seed(1)
    step = _layer_step(layer)
    for t in range(80):
        rows = (1, 1, 2, 4, 1, 8, 64)[t % 7]  # 64 rows: wider than the slots -> read-through
        x, tw, ti = _routing(gen, rows)
        ref = fm.fused_experts(x, layer["w13"], layer["w2"], tw, ti)
        out = _cached(fm, layer, x, tw, ti, step)
        assert torch.equal(out, ref), f"step {t}: max diff {(out.float() - ref.float()).abs().max()}"
    r = step.cache.read_counters()
    assert r["admitted"] > N and r["evicted"] > 0 and r["expert_hits"] > 0, r
    assert r["read_through_steps"] > 0 and r["bypassed"] > 0, r
    units = step.units
    for s, e in enumerate(step.cache.slot_expert.tolist()):  # the slots really hold the bytes
        assert e < 0 or torch.equal(units[E + s], units[e])


def test_b_bitwise_equal_under_a_captured_graph_with_new_inputs(fm, layer):
    gen = torch.Generator().manual_seed(2)
    step = _layer_step(layer)
    replay_against_stock(
        step,
        lambda: _routing(gen, 8),
        lambda x, tw, ti, valid: _cached(fm, layer, x, tw, ti, lambda ids: ids),
        lambda x, tw, ti, valid: _cached(fm, layer, x, tw, ti, lambda ids: step(ids, valid)),
        lambda x, tw, ti, valid: fm.fused_experts(x, layer["w13"], layer["w2"], tw, ti),
        "",
    )


def test_c_a_swap_pins_its_set_and_the_tail_yields(fm, layer):
    from reap_swap.engine import vmm

    rng, unit = layer["rng"], layer["unit"]
    pinned = [0, 1, 2]
    pool = vmm.DeviceSlotPool.create(len(pinned), unit, 0)
    try:
        for i, e in enumerate(pinned):  # a per-request swap: the experts' own units -> HBM
            vmm.copy_async(
                pool.unit_address(i), rng.unit_address(e), unit, torch.cuda.current_stream().cuda_stream
            )
        torch.cuda.synchronize()
        for i, e in enumerate(pinned):
            rng.map_device(e, pool.handles[i], defer_access=True)
        rng.flush_access()
        step = _layer_step(layer)
        step.seed([0, 5, 6, 7])  # copies the seeded bytes too
        step.cache.set_pinned(pinned, active_slots=N - 2)  # the tail yields two slots
        gen = torch.Generator().manual_seed(3)
        for t in range(40):
            x, tw, ti = _routing(gen, (1, 2, 4)[t % 3])
            ref = fm.fused_experts(x, layer["w13"], layer["w2"], tw, ti)
            assert torch.equal(_cached(fm, layer, x, tw, ti, step), ref), t
            held = set(step.cache.slot_expert.tolist())
            assert not held & set(pinned), "a pinned expert was cached in a slot"
            assert (step.cache.slot_expert[N - 2 :] < 0).all(), "the tail used a yielded slot"
            assert step.cache.table[pinned].tolist() == pinned
        assert step.cache.read_counters()["expert_hits"] > 0
    finally:
        for e in pinned:
            rng.map_host(e)
        pool.release()


class _Kernel:  # stands in for vLLM's FusedMoEKernel by the class names compat checks
    def __init__(self):
        self.fused_experts = type("TritonExperts", (), {"_lora_context": None})()
        self.prepare_finalize = type("MoEPrepareAndFinalizeNoDPEPModular", (), {})()
        self.calls = []

    def apply(self, hidden_states, w1, w2, topk_weights, topk_ids, global_num_experts, **_):
        self.calls.append(global_num_experts)
        return _torch_moe(hidden_states, w1, w2, topk_weights, topk_ids)


def _torch_moe(x, w13, w2, tw, ti):
    out = torch.zeros_like(x, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(ti.shape[1]):
            e = int(ti[t, k])
            gate, up = (w13[e].float() @ x[t].float()).chunk(2)
            out[t] += tw[t, k] * (w2[e].float() @ (torch.nn.functional.silu(gate) * up))
    return out


class _Method:
    is_monolithic = False
    unquantized_backend = type("B", (), {"name": "TRITON"})()

    def __init__(self):
        self.moe_kernel = _Kernel()

    def process_weights_after_loading(self, layer):
        pass


_Method.__name__ = _Method.__qualname__ = "UnquantizedFusedMoEMethod"


def engine_and_layer(monkeypatch, cfg, seed: int):
    """A CudaEngine with the cache config ``cfg`` over a one-layer plan (core [3, 4], a pool of 10
    experts) and a random bf16 expert module for it, not hooked yet: (engine, module, masters)."""
    from types import SimpleNamespace

    from reap_swap.engine.residency.engine import CudaEngine
    from reap_swap.engine.residency.refusals import LayerRefusals

    monkeypatch.setattr("reap_swap.compat.moe_cache.install_config_alias", lambda: "stand-in")
    unit = (2 * INTER * H + H * INTER) * 2
    plan = SimpleNamespace(
        layers={0: SimpleNamespace(core=[3, 4], num_experts=E)},
        swappable_budget_bytes=10 * unit,
        per_expert_bytes=unit,
    )
    engine = CudaEngine(plan, LayerRefusals(), cache=cfg)
    m = torch.nn.Module()
    m.layer_name, m.expert_map, m.global_num_experts = "model.layers.0.mlp.experts", None, E
    m.activation, m.apply_router_weight_on_input, m.quant_method = "silu", False, _Method()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for name, shape in (("w13_weight", (E, 2 * INTER, H)), ("w2_weight", (E, H, INTER))):
        w = (torch.randn(*shape, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        m.register_parameter(name, torch.nn.Parameter(w, requires_grad=False))
    return engine, m, (m.w13_weight.detach().clone(), m.w2_weight.detach().clone())


def test_e_engine_lends_pool_slots_seeds_and_serves_bitwise(monkeypatch):
    """CudaEngine with a CacheConfig: pool split (swap table keeps K), lent slot units mapped in
    the layer range, dlfu-seeded start (core copied into slots), forward through DeviceCaches equal
    to the masters' result bitwise, the kernel called over E + N units."""
    from reap_swap.engine.device_cache.api import DeviceCaches
    from reap_swap.engine.device_cache.lending import CacheConfig

    cfg = CacheConfig(DeviceCaches(), slots_per_layer=4, seed_core=True)
    engine, m, masters = engine_and_layer(monkeypatch, cfg, seed=5)
    try:
        engine.hook_layer(m, 0, quant_config={})
        m.quant_method.process_weights_after_loading(m)
        st = engine.state
        assert st.table.num_slots == 6 and cfg.lent == {0: 6} and not cfg.caches.refused
        assert st.table.resident().get(0, frozenset()) == frozenset()  # seeded: core in slots, not pinned
        owner, index = m.reap_device_cache
        assert owner.status()["layers"][0]["cached"] == [3, 4]
        g = torch.Generator().manual_seed(6)
        for t in range(12):
            x, tw, ti = _routing(g, 2)
            out = owner.forward(m, index, x, tw, ti, None, None, None)
            assert torch.equal(out, _torch_moe(x, *masters, tw, ti)), t
        assert set(m.quant_method.moe_kernel.calls) == {E + 4}
        assert owner.read_counters()[0]["admitted"] > 0
    finally:
        engine.release()
