"""The device cache over experts with per-expert side tensors on CUDA: vLLM's Triton fused-MoE kernel
reads weight scales and biases by the id it is given, so after the remap slot s must carry the
rows of the expert it holds (residency/device_cache_side.SlotRows; vLLM PR #50562 kept FP8 scales
indexed by expert). Bitwise equal to the uncached kernel with admissions, evictions and
read-through, eager and under a captured graph replayed with new inputs, for block (128 x 128) and
per-tensor FP8 weight scales and for bf16 experts with biases (GPT-OSS's layout); with the slot-row
refresh switched off the same steps must differ (the test sees the bug). One-line run:

    PYTHONPATH=$PWD python -m pytest -q tests/gpu/test_device_cache_quant.py 2>&1 | tee $LOGDIR/cache_quant.log
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.gpu.standalone import replay_against_stock, skewed_routing  # noqa: E402

E, N, H, INTER, TOPK = 16, 6, 1024, 512, 2
BLOCK = [128, 128]


@pytest.fixture(scope="module")
def fm():
    return pytest.importorskip("vllm.model_executor.layers.fused_moe")


def _side(gen, kind):
    """The two per-expert side tensors of each kind: FP8 weight scales, or bf16 biases."""
    if kind == "block":
        s13 = torch.rand(E, 2 * INTER // BLOCK[0], H // BLOCK[1], generator=gen) / 64 + 1 / 256
        s2 = torch.rand(E, H // BLOCK[0], INTER // BLOCK[1], generator=gen) / 64 + 1 / 256
    elif kind == "tensor":  # one scale per expert and weight, as Fp8MoEMethod leaves them after loading
        s13 = torch.rand(E, generator=gen) / 64 + 1 / 256
        s2 = torch.rand(E, generator=gen) / 64 + 1 / 256
    else:  # biases [E, 2I] and [E, H]
        s13 = (torch.randn(E, 2 * INTER, generator=gen) / 8).to(torch.bfloat16)
        s2 = (torch.randn(E, H, generator=gen) / 8).to(torch.bfloat16)
    return s13.cuda(), s2.cuda()


@pytest.fixture(scope="module", params=["block", "tensor", "bias"])
def layer(request):
    from reap_swap.engine import vmm
    from reap_swap.engine.device_cache.range import rehome_with_slots
    from reap_swap.sizing.unit_layout import plan_unit

    gen = torch.Generator(device="cpu").manual_seed(0)
    kind = request.param
    if kind == "bias":
        w13 = (torch.randn(E, 2 * INTER, H, generator=gen) / 32).to(torch.bfloat16).cuda()
        w2 = (torch.randn(E, H, INTER, generator=gen) / 32).to(torch.bfloat16).cuda()
    else:
        w13 = (torch.randn(E, 2 * INTER, H, generator=gen) * 8).to(torch.float8_e4m3fn).cuda()
        w2 = (torch.randn(E, H, INTER, generator=gen) * 8).to(torch.float8_e4m3fn).cuda()
    s13, s2 = _side(gen, kind)
    slabs = [
        ("w13_weight", w13[0].numel() * w13.element_size()),
        ("w2_weight", w2[0].numel() * w2.element_size()),
    ]
    unit = plan_unit(slabs, vmm.ensure_available(0)).unit_bytes
    rng, range_bytes, _views, ext = rehome_with_slots(w13, w2, unit, N, 0)
    yield {"kind": kind, "w13": w13, "w2": w2, "s13": s13, "s2": s2, "unit": unit,
           "bytes": range_bytes, "ext": ext}  # fmt: skip
    rng.release()


def _qc(layer, s13, s2):
    from vllm.model_executor.layers.fused_moe.config import biased_moe_quant_config, fp8_w8a8_moe_quant_config

    if layer["kind"] == "bias":
        return biased_moe_quant_config(s13, s2)
    return fp8_w8a8_moe_quant_config(w1_scale=s13, w2_scale=s2, block_shape=_block(layer))


def _block(layer):
    return BLOCK if layer["kind"] == "block" else None


def _setup(layer, refresh=True):
    from reap_swap.engine.device_cache.copy import unit_view
    from reap_swap.engine.device_cache.layer import DeviceCache, LayerStep
    from reap_swap.engine.device_cache.side import SlotRows

    step = LayerStep(DeviceCache(E, N, "cuda"), unit_view(layer["bytes"], E + N, layer["unit"]))
    rows = SlotRows({"w13": layer["s13"], "w2": layer["s2"]}, E, N)
    qc = _qc(layer, rows.ext["w13"], rows.ext["w2"])

    def ids_of(ti, valid=None):
        ids = step(ti, valid)
        if refresh:
            rows.refresh(step.cache.slot_expert)
        return ids

    return step, rows, qc, ids_of


def _stock(fm, layer, x, tw, ti):
    return fm.fused_experts(
        x, layer["w13"], layer["w2"], tw, ti, quant_config=_qc(layer, layer["s13"], layer["s2"])
    )


def _cached(fm, layer, x, tw, ids, qc):
    """Stock's config for the [E, ...] shapes (what compat.moe_cache's alias does when serving)."""
    import vllm.model_executor.layers.fused_moe.fused_moe as fmm

    dtype = None if layer["kind"] == "bias" else "fp8_w8a8"
    cfg = fmm.try_get_optimal_moe_config(
        layer["w13"].size(), layer["w2"].size(), TOPK, dtype, x.shape[0], block_shape=_block(layer)
    )
    with fm.override_config(cfg):
        return fm.fused_experts(x, *layer["ext"], tw, ids, global_num_experts=E + N, quant_config=qc)


def _routing(gen, rows):
    return skewed_routing(gen, rows, E, H, TOPK)


def _run_eager(fm, layer, refresh):
    gen = torch.Generator().manual_seed(1)
    step, rows, qc, ids_of = _setup(layer, refresh)
    bad = []
    for t in range(80):
        n = (1, 1, 2, 4, 1, 8, 64)[t % 7]  # 64 rows: wider than the slots -> read-through
        x, tw, ti = _routing(gen, n)
        ref = _stock(fm, layer, x, tw, ti)
        out = _cached(fm, layer, x, tw, ids_of(ti), qc)
        if not torch.equal(out, ref):
            bad.append((t, float((out.float() - ref.float()).abs().max())))
    return step, rows, bad


def test_a_cached_equals_stock_bitwise_eager(fm, layer):
    step, rows, bad = _run_eager(fm, layer, refresh=True)
    assert not bad, f"{layer['kind']}: steps differ {bad[:5]}"
    r = step.cache.read_counters()
    assert r["admitted"] > N and r["evicted"] > 0 and r["expert_hits"] > 0, r
    assert r["read_through_steps"] > 0 and r["bypassed"] > 0, r
    for s, e in enumerate(step.cache.slot_expert.tolist()):  # bytes and scale rows of every slot
        assert e < 0 or torch.equal(step.units[E + s], step.units[e])
        assert e < 0 or torch.equal(rows.ext["w13"][E + s], layer["s13"][e])


def test_b_without_slot_rows_the_slots_read_other_rows(fm, layer):
    _, _, bad = _run_eager(fm, layer, refresh=False)
    assert len(bad) > 10, f"{layer['kind']}: the stale scale rows went unseen ({len(bad)} steps)"


def test_c_cached_equals_stock_under_a_captured_graph(fm, layer):
    gen = torch.Generator().manual_seed(2)
    step, rows, qc, ids_of = _setup(layer)
    replay_against_stock(
        step,
        lambda: _routing(gen, 8),
        lambda x, tw, ti, valid: _cached(fm, layer, x, tw, ti, qc),
        lambda x, tw, ti, valid: _cached(fm, layer, x, tw, ids_of(ti, valid), qc),
        lambda x, tw, ti, valid: _stock(fm, layer, x, tw, ti),
        f"{layer['kind']}: ",
    )
