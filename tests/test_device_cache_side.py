"""Slot rows for per-expert side tensors (engine/device_cache/side.py, compat.moe_cache
slot_row_places / point_slot_rows, device_cache_api.bind_slot_rows): the device cache on block-quantized experts, on CPU tensors.

The fake kernel reads its scales the way vLLM's TritonExperts does (``quant_config._w1.scale``,
indexed by the id it is given) and dequantizes blockwise, so a slot whose scale row is not its
expert's gives another output: vLLM PR #50562's bug. The cached layer (DeviceCaches.engage +
forward: policy step, slot copies, remap, slot-row refresh, kernel over E + N units) must equal the
uncached kernel bit for bit over many steps with admissions and evictions; with the refresh
switched off the same test must see a difference.
"""

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from reap_swap.compat import moe_cache  # noqa: E402
from reap_swap.engine.device_cache.api import DeviceCaches, bind_slot_rows  # noqa: E402
from reap_swap.engine.device_cache.side import SlotRows  # noqa: E402

E, N, H, INTER, TOPK, BLK = 12, 4, 8, 4, 2, 2


def test_slot_rows_follow_slot_expert_and_keep_the_expert_rows():
    t = torch.arange(E * 3, dtype=torch.float32).reshape(E, 3)
    rows = SlotRows({"s": t}, E, N)
    ext = rows.ext["s"]
    assert ext.shape == (E + N, 3) and torch.equal(ext[:E], t)
    rows.refresh(torch.tensor([5, -1, 0, 11]))
    assert torch.equal(ext[E + 0], t[5]) and torch.equal(ext[E + 3], t[11]) and torch.equal(ext[E + 2], t[0])
    assert torch.equal(ext[E + 1], t[0])  # an empty slot: expert 0's row, read by no remapped id
    assert torch.equal(ext[:E], t)
    with pytest.raises(ValueError, match="leading dimension"):
        SlotRows({"bad": torch.zeros(E + 1, 2)}, E, N)


def _expand(scale, rows, cols):
    return scale.repeat_interleave(BLK, 0)[:rows].repeat_interleave(BLK, 1)[:, :cols]


def _kernel(x, w1, w2, tw, ids, qc, num_units):
    """Blockwise-dequantizing MoE (silu-and-mul): weights and scales both indexed by the given id."""
    assert int(ids.max()) < num_units
    out = torch.zeros(x.shape[0], H)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            a = w1[e] * _expand(qc._w1.scale[e], 2 * INTER, H)
            h = torch.nn.functional.silu(a[:INTER] @ x[t]) * (a[INTER:] @ x[t])
            b = w2[e] * _expand(qc._w2.scale[e], H, INTER)
            out[t] += tw[t, k] * (b @ h)
    return out


def _layer(extra_side=None):
    gen = torch.Generator().manual_seed(0)
    m = torch.nn.Module()
    w13 = torch.randint(-8, 8, (E, 2 * INTER, H), generator=gen).float()
    w2 = torch.randint(-8, 8, (E, H, INTER), generator=gen).float()
    s13 = torch.rand(E, INTER, H // BLK, generator=gen) + 0.5  # [E, 2I / BLK, H / BLK]
    s2 = torch.rand(E, H // BLK, INTER // BLK, generator=gen) + 0.5
    for name, t in (
        ("w13_weight", w13),
        ("w2_weight", w2),
        ("w13_weight_scale_inv", s13),
        ("w2_weight_scale_inv", s2),
    ):
        m.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    for name, t in (extra_side or {}).items():
        m.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    desc = {"zp": None, "bias": None, "alpha_or_gscale": None}
    qc = SimpleNamespace(_w1=SimpleNamespace(scale=m.w13_weight_scale_inv, **desc),
                         _w2=SimpleNamespace(scale=m.w2_weight_scale_inv, **desc))  # fmt: skip
    experts = type("TritonExperts", (), {"_lora_context": None})()
    experts.quant_config = qc
    prepare = type("MoEPrepareAndFinalizeNoDPEPModular", (), {})()

    def apply(hidden_states, w1, w2, topk_weights, topk_ids, global_num_experts, **_):
        return _kernel(
            hidden_states, w1, w2, topk_weights, topk_ids, experts.quant_config, global_num_experts
        )

    kernel = SimpleNamespace(fused_experts=experts, prepare_finalize=prepare, apply=apply)
    m.quant_method = type("Fp8MoEMethod", (), {"is_monolithic": False, "moe_kernel": kernel})()
    m.global_num_experts, m.expert_map = E, None
    m.activation, m.apply_router_weight_on_input = "silu", False
    return m


def test_places_are_the_kernels_weight_descriptors_and_unknown_side_tensors_are_refused():
    layer = _layer()
    places, unbound = moe_cache.slot_row_places(layer)
    assert sorted(places) == ["w13_weight_scale_inv", "w2_weight_scale_inv"] and unbound == []
    assert places["w13_weight_scale_inv"][0][1] == "scale"
    assert moe_cache.cache_refusal(layer) is None
    odd = _layer({"w13_extra": torch.zeros(E, 2)})  # per-expert, but not where the kernel reads
    reason = moe_cache.cache_refusal(odd)
    assert "w13_extra" in reason and "50562" in reason and "w13_weight_scale_inv" not in reason
    with pytest.raises(ValueError, match="w13_extra"):
        bind_slot_rows(odd, E, N)


def test_bind_points_descriptors_at_the_extended_rows_and_the_parameter_at_rows_below_e():
    layer = _layer()
    before = layer.w13_weight_scale_inv.detach().clone()
    rows = bind_slot_rows(layer, E, N)
    qc = layer.quant_method.moe_kernel.fused_experts.quant_config
    assert qc._w1.scale is rows.ext["w13_weight_scale_inv"] and qc._w1.scale.shape[0] == E + N
    assert qc._w2.scale is rows.ext["w2_weight_scale_inv"]
    assert layer.w13_weight_scale_inv.data_ptr() == rows.ext["w13_weight_scale_inv"].data_ptr()
    assert torch.equal(layer.w13_weight_scale_inv, before) and layer.w13_weight_scale_inv.shape[0] == E


def _engage(monkeypatch, layer, seed=()):
    """DeviceCaches.engage over a CPU range holding the layer's units (w13 then w2), as the engine
    re-homes them: returns the caches and the [E + N] weight views the kernel reads."""
    monkeypatch.setattr(moe_cache, "install_config_alias", lambda: "test")
    monkeypatch.setattr(moe_cache, "alias_units", lambda *a: None)
    n13, n2 = 2 * INTER * H, H * INTER
    unit = -(-(n13 + n2) * 4 // 8) * 8
    range_bytes = torch.zeros((E + N) * unit, dtype=torch.uint8)
    units = range_bytes.view(E + N, unit)
    w13 = units[:, : n13 * 4].view(torch.float32).view(E + N, 2 * INTER, H)
    w2 = units[:, n13 * 4 : (n13 + n2) * 4].view(torch.float32).view(E + N, H, INTER)
    w13[:E].copy_(layer.w13_weight)
    w2[:E].copy_(layer.w2_weight)
    caches = DeviceCaches()
    rng = SimpleNamespace(num_experts=E, num_slots=N, unit_bytes=unit)
    assert caches.engage(layer, 0, rng, range_bytes, (w13, w2), seed=seed)
    return caches


def _steps(layer, caches, refresh=True):
    """(steps whose output differs from the uncached kernel, steps that read a slot unit)."""
    gen = torch.Generator().manual_seed(1)
    stock_w13, stock_w2 = layer.w13_weight.detach().clone(), layer.w2_weight.detach().clone()
    stock_qc = SimpleNamespace(
        _w1=SimpleNamespace(scale=layer.w13_weight_scale_inv.detach().clone()),
        _w2=SimpleNamespace(scale=layer.w2_weight_scale_inv.detach().clone()),
    )
    if not refresh:
        caches.side[0].refresh = lambda slot_expert: None
    differ, slotted = 0, 0
    seen = []
    orig = layer.quant_method.moe_kernel.apply

    def spy(**kw):
        seen.append(int(kw["topk_ids"].max()) >= E)
        return orig(**kw)

    layer.quant_method.moe_kernel.apply = spy
    for _ in range(60):
        rows = int(torch.randint(1, 4, (1,), generator=gen))
        logits = torch.randn(rows, E, generator=gen) + torch.linspace(1.5, 0, E)
        tw, ids = torch.topk(torch.softmax(logits, -1), TOPK)
        x = torch.randn(rows, H, generator=gen)
        got = caches.forward(layer, 0, x, tw, ids, None, None, None)
        want = _kernel(x, stock_w13, stock_w2, tw, ids, stock_qc, E)
        differ += not torch.equal(got, want)
    slotted = sum(seen)
    return differ, slotted


def test_cached_block_quantized_layer_equals_the_uncached_kernel_bitwise(monkeypatch):
    layer = _layer()
    caches = _engage(monkeypatch, layer)
    assert caches.status()["layers"][0]["side_rows"] == ["w13_weight_scale_inv", "w2_weight_scale_inv"]
    differ, slotted = _steps(layer, caches)
    counts = caches.read_counters()[0]
    assert slotted > 20 and counts["admitted"] > 10 and counts["evicted"] > 5  # slots did work
    assert differ == 0


def test_without_the_refresh_slots_read_other_experts_scales(monkeypatch):
    """The control: PR #50562's bug (slot rows not following the slots) is visible to this test."""
    layer = _layer()
    caches = _engage(monkeypatch, layer)
    differ, slotted = _steps(layer, caches, refresh=False)
    assert slotted > 20 and differ > 0


def test_seeded_slots_read_their_experts_rows_from_the_first_step(monkeypatch):
    """--reap-cache-seed seeded: the startup fill puts experts into slots between steps; the first
    forward's refresh gives those slots their rows before the kernel reads them."""
    layer = _layer()
    caches = _engage(monkeypatch, layer, seed=[3, 7, 9, 11])
    assert caches.layers[0].cache.resident_experts()[0] == {3, 7, 9, 11}
    differ, slotted = _steps(layer, caches)
    assert slotted > 20 and differ == 0


def test_seeded_swaps_pinned_in_the_slots_keep_every_slot_row_right(monkeypatch):
    """--reap-cache-seed seeded with per-request swaps (device_cache_seeded.SeededPins) between
    steps: a pinned expert is read through its own id (rows below E), the tail's slots get their
    rows at the next step's refresh, so every step after each swap still equals the uncached kernel
    (run 29's online-FP8 seeded arm moved after its swaps; this rules out the rows' logic, on CPU)."""
    from test_device_cache_seeded import FakeRange  # its recorded remaps (a CPU range reads the masters)

    from reap_swap.engine.device_cache.seeded import SeededPins

    layer = _layer()
    caches = _engage(monkeypatch, layer, seed=[3, 7, 9, 11])
    rng = FakeRange()
    pins = SeededPins(caches, lambda layer_index: rng, lambda layer_index, slot: ("slot", layer_index, slot))
    for target in ([1, 2], [2, 5, 11, 0], [3, 7, 9, 11], []):
        pins.apply({0: target})
        cache = caches.layers[0].cache
        assert {int(e) for e in torch.nonzero(cache.pinned).flatten().tolist()} == set(target)
        assert set(rng.mapped) == set(target)  # each pinned expert's own unit points at its slot
        differ, slotted = _steps(layer, caches)
        assert differ == 0, target
        assert slotted > 0 or len(target) == N, target  # the tail still cached something
