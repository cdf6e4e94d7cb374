"""CudaEngine's load-time decisions on CPU (no GPU, no vLLM): when it attaches and which reason a
refused layer gets. Fake layers carry what the engine reads (a quant method by class name, the
w13/w2 tensors); `_state_for` is replaced by a fake state so the decisions run without CUDA."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from reap_swap.engine.residency import engine as engine_mod  # noqa: E402
from reap_swap.engine.residency.binding import meta_tensors  # noqa: E402
from reap_swap.engine.residency.refusals import LayerRefusals  # noqa: E402

E, H, I = 4, 256, 128


class UnquantizedFusedMoEMethod:  # the class name and backend the engine accepts
    is_monolithic = False
    unquantized_backend = SimpleNamespace(name="TRITON")

    def process_weights_after_loading(self, layer):
        pass


def layer(index, dtype=torch.bfloat16, device="cpu"):
    m = torch.nn.Module()
    m.layer_name = f"model.layers.{index}.mlp.experts"
    m.expert_map, m.top_k, m.quant_method = None, 2, UnquantizedFusedMoEMethod()
    for name, shape in (("w13_weight", (E, 2 * I, H)), ("w2_weight", (E, H, I))):
        t = torch.zeros(shape, dtype=dtype, device=device)
        m.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    return m


def cpu_engine(plan_layers=(0,)):
    plan = SimpleNamespace(
        layers={l: SimpleNamespace(core=[], num_experts=E) for l in plan_layers},
        swappable_budget_bytes=0,
        per_expert_bytes=1,
    )
    eng = engine_mod.CudaEngine(plan, LayerRefusals())
    state = SimpleNamespace(plan=plan, granularity=2 * 2**20, pool=None)
    eng._state_for = lambda layer: state  # no CUDA: the decisions before any byte moves

    def bind(m, granularity):  # the engine's _bind, with CPU tensors counted as device memory
        names = ("UnquantizedFusedMoEMethod", "TritonExperts")
        b = engine_mod.bind_module(
            m, engine_mod.layer_sizes(m), {}, names, granularity, on_device=lambda t: True
        )
        return b.refusal or b

    eng._bind = bind
    return eng


def test_a_layer_on_meta_waits_for_the_call_with_data():
    """vLLM 0.26 online fp8: weights on meta until the layerwise loader materializes them."""
    eng = cpu_engine()
    m = layer(0, device="meta")
    assert meta_tensors(m) == ["w13_weight", "w2_weight"]
    eng.hook_layer(m, 0, quant_config={})
    m.quant_method.process_weights_after_loading(m)  # a call before the data: no decision
    assert eng.refusals.reasons == {} and eng.pending_meta == {"model.layers.0.mlp.experts": 0}
    assert eng.state is None
    for name in ("w13_weight", "w2_weight"):  # what _layerwise_process does: materialize, load
        p = getattr(m, name)
        setattr(m, name, torch.nn.Parameter(torch.zeros(p.shape, dtype=torch.float32), requires_grad=False))
    m.quant_method.process_weights_after_loading(m)  # the real call decides (here: a refusal)
    assert eng.pending_meta == {}
    assert eng.refusals.reasons == {
        "model.layers.0.mlp.experts": "dtype torch.float32 not supported (bf16/fp16 only)"
    }


def test_an_unsupported_layer_outside_the_plan_names_what_is_unsupported():
    eng = cpu_engine(plan_layers=(0,))
    m3 = layer(3, dtype=torch.float32)
    m2 = layer(2)
    for index, m in ((3, m3), (2, m2)):
        eng.attach_after_load(m, index)
    assert eng.refusals.reasons == {
        "model.layers.3.mlp.experts": "dtype torch.float32 not supported (bf16/fp16 only)",
        "model.layers.2.mlp.experts": "layer 2 is not in the plan",
    }
    assert eng.refusals.on_hbm == {3: True, 2: True}


def test_status_carries_each_workers_engine_facts_and_the_fallbacks_per_layer_refusals():
    from reap_swap.engine.residency.accounting import AccountingResidency
    from reap_swap.server.swap_report import engine_summary

    why = {"model.layers.0.mlp.experts": "<layout>: MarlinExperts implies the expert stride"}
    fallback = AccountingResidency({0: frozenset()}, 8, "CUDA residency engine unavailable (...)", why)
    facts = engine_summary(fallback.status())
    assert facts == {
        "reason": "CUDA residency engine unavailable (...)",
        "refused_layers": why,
        "bytes_copied_total": 0,
    }
    cuda = {"mode": "cuda", "unit_bytes": 6 << 20, "pool_slots": 256, "kept_whole_hbm_bytes": 16,
            "layers_rehomed": [0, 1], "refused_layers": {}, "rehomed_tensors": {0: ["w13_weight"]}, "swaps": 3}  # fmt: skip
    facts = engine_summary(cuda)
    assert facts["unit_bytes"] == 6 << 20 and facts["pool_slots"] == 256 and "swaps" not in facts
    assert facts["rehomed_tensors"] == {"0": ["w13_weight"]}  # JSON keys


def _recording_engine(monkeypatch, cache=None, core=(1, 2)):
    """cpu_engine with the byte-moving steps replaced by recorders: what attach_after_load calls,
    in which order, with what (the real steps need CUDA; tests/gpu/test_cuda_engine.py runs them)."""
    from reap_swap.engine.device_cache import lending as device_cache_engine

    calls = []
    eng = cpu_engine()
    eng.cache = cache
    eng.plan.layers[0].core = list(core)
    table = SimpleNamespace(resident=lambda: {})
    st = SimpleNamespace(plan=eng.plan, granularity=2**16, pool=None, device=0, layers={}, table=table)
    st.load_seconds, st.host_cache_release, st.exact_pinned_released = 0.0, None, 0
    eng._state_for = lambda layer: st
    monkeypatch.setattr(engine_mod, "_ensure_pool", lambda st_, unit, c: calls.append(("pool", unit, c)))
    monkeypatch.setattr(
        engine_mod,
        "rehome",
        lambda t, lay, dev, on_copied=None: calls.append(("rehome", sorted(t))) or ("rng", 7, dict(t)),
    )
    monkeypatch.setattr(engine_mod, "swap_state", lambda st_, cur: calls.append(("swap", cur)))
    monkeypatch.setattr(
        engine_mod.vmm, "map_masters_at_load", lambda rng, what: calls.append(("mirror", rng, what))
    )
    monkeypatch.setattr(engine_mod.vllm_moe, "mark_uva_offloaded", lambda p: calls.append(("mark", p.shape)))
    monkeypatch.setattr(engine_mod.vllm_moe, "release_cached_pinned_memory", lambda: "released")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty",)))

    def cache_rehome(cfg, st_, m, index, w13, w2, unit):
        calls.append(("cache_rehome", index, unit))
        return "crng", 9, w13, w2, "ext"

    monkeypatch.setattr(device_cache_engine, "rehome_layer", cache_rehome)
    monkeypatch.setattr(
        device_cache_engine, "engage", lambda cfg, st_, m, i, r, b, e: calls.append(("engage", i, r, b, e))
    )
    return eng, st, calls


@pytest.mark.parametrize("publish", [None, 8])  # None: swap.PUBLISH_EVERY (ahead): masters mirrored at load
@pytest.mark.parametrize("cache", [None, "core+dlfu", "dlfu-seeded"])
def test_attach_rehomes_points_the_parameters_and_seeds_the_core_in_order(monkeypatch, cache, publish):
    cfg = None if cache is None else SimpleNamespace(seed_core=cache == "dlfu-seeded")
    eng, st, calls = _recording_engine(monkeypatch, cache=cfg)
    st.publish_every = publish
    m = layer(0)
    eng.attach_after_load(m, 0)
    assert eng.refusals.reasons == {} and m._reap_vmm
    unit = st.layers[0].unit_bytes
    moved = [("cache_rehome", 0, unit)] if cfg else [("rehome", ["w13_weight", "w2_weight"])]
    seeded = [] if cache == "dlfu-seeded" else [("swap", {0: {1, 2}})]
    mirrored = [("mirror", "crng" if cfg else "rng", "layer 0")] if publish is None else []
    engaged = [("engage", 0, "crng", 9, "ext")] if cfg else []
    assert calls == [
        ("pool", unit, cfg),
        *moved,
        ("mark", (E, 2 * I, H)),
        ("mark", (E, H, I)),
        *seeded,
        *mirrored,
        *engaged,
        ("empty",),
    ]
    entry = st.layers[0]
    assert (entry.rng, entry.range_bytes, entry.num_experts) == (("crng", 9) if cfg else ("rng", 7)) + (E,)
    assert st.host_cache_release == "released" and st.load_seconds > 0
    before = list(calls)
    eng.attach_after_load(m, 0)  # the loader's second call: nothing happens again
    assert calls == before


def marks_of(calls: list) -> list[int]:
    return [i for i, c in enumerate(calls) if c[0] == "mark"]


def test_attach_releases_the_exact_pinned_copies_after_pointing_the_parameters(monkeypatch):
    """--reap-exact-pinning (compat/pinning.py): vLLM's registered copy of a re-homed tensor is let go
    only once the parameter points at the engine's range, and its bytes are counted."""
    from reap_swap.compat import pinning

    eng, st, calls = _recording_engine(monkeypatch)
    m = layer(0)
    w13 = m.w13_weight.data
    monkeypatch.setitem(pinning._registered, w13.data_ptr(), pinning.Copy(w13, w13.nbytes))

    def release(ptrs):
        ptrs = list(ptrs)
        calls.append(("release", ptrs))
        return sum(pinning._registered.pop(p).nbytes for p in ptrs)

    monkeypatch.setattr(engine_mod.vllm_pinning, "release", release)
    monkeypatch.setattr(pinning, "_cuda_unregister", lambda p: calls.append(("unregister", p)) or 0)
    eng.attach_after_load(m, 0)
    rehomed = next(i for i, c in enumerate(calls) if c[0] == "rehome")
    assert calls.index(("unregister", w13.data_ptr())) < rehomed  # drained before the copy
    marks = marks_of(calls)
    released = [i for i, c in enumerate(calls) if c[0] == "release"]
    assert released and released[0] > max(marks) and calls[released[0]][1] == [w13.data_ptr()]
    assert st.exact_pinned_released == w13.nbytes and not pinning._registered


def test_the_servers_swap_publish_setting_reaches_the_engine_state_and_its_store(monkeypatch):
    """--reap-swap-publish 8 (run 24's way back to chunks): the worker runtime builds the engine with
    it, the engine's state carries it, and a store built as production builds it (VmmStore(st)) uses it."""
    from reap_swap.config.settings import Settings
    from reap_swap.engine.residency.swap import PUBLISH_AHEAD
    from reap_swap.engine.residency.vmm_store import VmmStore
    from reap_swap.engine.runtime import WorkerRuntime

    monkeypatch.setattr(engine_mod.vmm, "ensure_available", lambda device: 2 << 20)
    monkeypatch.setattr(engine_mod.torch.cuda, "Stream", lambda device=None: "stream")
    monkeypatch.setattr(engine_mod.torch.cuda, "current_device", lambda: 0)
    for setting, value in (("8", 8), ("ahead", PUBLISH_AHEAD)):
        runtime = WorkerRuntime(config={}, settings=Settings(plan_file="p", swap_publish=setting), plan=None)
        eng = runtime.cuda_engine("cuda")
        st = eng._state_for(layer(0))
        assert (eng.publish_every, st.publish_every, VmmStore(st).publish_every) == (value, value, value)
        assert VmmStore(st).copies_read_masters == (value == PUBLISH_AHEAD)
