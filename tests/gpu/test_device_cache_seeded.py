"""--reap-cache-seed seeded on CUDA (issue 17, device_cache_seeded.py): the whole pool lent to the
layer's cache (K = 0), seeded with the core; per-request swaps through CudaResidency.apply pin
their set inside the cache slots (own units remapped onto the slots' physical handles); every
forward bitwise equal to the masters' result before, between and after swaps; a set wider than
the slots refused before anything moves. One-line run (H200, < 1 min):

    PYTHONPATH=$PWD python -m pytest -q tests/gpu/test_device_cache_seeded.py 2>&1 | tee $LOGDIR/device_cache_seeded.log
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.gpu.test_device_cache import INTER, E, H, _Method, _routing, _torch_moe  # noqa: E402


def _engine(monkeypatch, fused):
    from types import SimpleNamespace

    from reap_swap.residency.device_cache_api import DeviceCaches
    from reap_swap.residency.device_cache_engine import CacheConfig
    from reap_swap.residency.engine import CudaEngine
    from reap_swap.residency.refusals import LayerRefusals

    monkeypatch.setattr("reap_swap.compat.moe_cache.install_config_alias", lambda: "stand-in")
    unit = (2 * INTER * H + H * INTER) * 2
    plan = SimpleNamespace(
        layers={0: SimpleNamespace(core=[3, 4], num_experts=E)},
        swappable_budget_bytes=10 * unit,
        per_expert_bytes=unit,
    )
    cfg = CacheConfig(DeviceCaches(fused=fused), 0, seed_core=True, auto=True, layer_slots={})
    engine = CudaEngine(plan, LayerRefusals(), cache=cfg)
    m = torch.nn.Module()
    m.layer_name, m.expert_map, m.global_num_experts = "model.layers.0.mlp.experts", None, E
    m.activation, m.apply_router_weight_on_input, m.quant_method = "silu", False, _Method()
    gen = torch.Generator(device="cuda").manual_seed(7)
    for name, shape in (("w13_weight", (E, 2 * INTER, H)), ("w2_weight", (E, H, INTER))):
        w = (torch.randn(*shape, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        m.register_parameter(name, torch.nn.Parameter(w, requires_grad=False))
    masters = (m.w13_weight.detach().clone(), m.w2_weight.detach().clone())
    engine.hook_layer(m, 0, quant_config={})
    m.quant_method.process_weights_after_loading(m)
    return engine, cfg, m, masters


def _serve(m, masters, gen, steps, forced=None):
    owner, index = m.reap_device_cache
    for t in range(steps):
        x, tw, ti = _routing(gen, 3)
        if forced is not None:  # route row 0 to pinned experts: read through their own units
            ti[0] = torch.tensor(forced[:2], dtype=ti.dtype, device=ti.device)
        out = owner.forward(m, index, x, tw, ti, None, None, None)
        assert torch.equal(out, _torch_moe(x, *masters, tw, ti)), t


@pytest.mark.parametrize("fused", [False, True], ids=["torch-step", "fast-triton-step"])
def test_seeded_swaps_pin_inside_the_slots_and_serve_bitwise(monkeypatch, fused):
    from reap_swap.residency.cuda_backend import CudaResidency
    from reap_swap.residency.slot_table import PoolCapacityError

    engine, cfg, m, masters = _engine(monkeypatch, fused)
    try:
        st = engine.state
        assert st.table.num_slots == 0 and cfg.lent == {0: 0} and cfg.lent_slots == {0: 10}
        owner, _ = m.reap_device_cache
        assert owner.status()["layers"][0]["cached"] == [3, 4]  # seeded: the core in slots
        backend = CudaResidency(engine)
        assert backend.seeded is not None and backend.resident()[0] == frozenset({3, 4})
        gen = torch.Generator().manual_seed(8)
        _serve(m, masters, gen, 8)
        out = backend.apply({0: [0, 1, 2, 9]})
        assert out["bytes_copied"] > 0 and backend.resident()[0] == frozenset({0, 1, 2, 9})
        s = owner.status()["layers"][0]
        assert s["pinned"] == [0, 1, 2, 9] and s["active"] == 6
        rng = st.layers[0].rng
        assert all(rng.backing[e] is not None for e in (0, 1, 2, 9))  # own units on the slots
        _serve(m, masters, gen, 8, forced=[9, 0])
        before = owner.status()
        with pytest.raises(PoolCapacityError):
            backend.apply({0: list(range(11))})
        assert owner.status() == before  # nothing moved
        backend.apply({0: [3]})
        assert all(rng.backing[e] is None for e in (0, 1, 2, 9)) and rng.backing[3] is not None
        _serve(m, masters, gen, 8, forced=[3, 9])
        backend.apply({0: []})
        assert owner.status()["layers"][0]["active"] == 10
        _serve(m, masters, gen, 8)
        c = owner.read_counters()[0]
        assert c["admitted"] > 0 and c["steps"] == 32
    finally:
        engine.release()
