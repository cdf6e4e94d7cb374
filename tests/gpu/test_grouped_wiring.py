"""--reap-group-size through the real CudaEngine on the H200 (vLLM 0.26.0's Triton fused_experts).

The stand-in layers of tests/gpu/test_quant_engine.py (what the engine reads from a vLLM layer
after process_weights_after_loading), two layers of 32 experts, attached through
`CudaEngine(group_size=...)` `hook_layer` -> post-load -> `grouped_engine.attach`, served through
`GroupedResidency(engine)` (the worker's backend, with its pointer checks). Unlike
test_quant_engine, the FP8 quant config is built ONCE before the attach and held (as vLLM's
FusedMoEQuantConfig holds the scale tensors): the in-place permutation of the kept-whole scales
must reach it. The forward maps ids as ReapRoutedExperts.forward_modular does (`to_physical` of
`layer.reap_group_map`) and calls the layer's quant method. Checked bitwise against the stock call
on the untouched tensors with logical ids at 0 / 25 (plan core + first slice) / 50 (random) /
100 % and back at 0 %; bytes copied = admitted groups x group payload; HBM-backed units per
range = resident groups; selfcheck; a fault mid-swap rolls back to the previous groups; a CUDA
graph captured once (remap inside) replayed across swaps.

~1-2 min. Run:
    PYTHONPATH=/tmp/site:$PWD python3 -m pytest -q tests/gpu/test_grouped_wiring.py 2>&1 | tee LOGDIR/grouped_wiring.log
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from tests.gpu.test_quant_engine import FORMATS, E, H, _routing, make_layer, quant_config  # noqa: E402

CORE, SLICE = [3, 17, 29, 8, 11], [30, 1, 22, 5, 14, 27]  # odd sizes: boundary groups with passengers


def _plan(layers, per_expert):
    rest = [e for e in range(E) if e not in CORE + SLICE]
    random.Random(1).shuffle(rest)
    slices = [SLICE, rest[:13], rest[13:]]
    lp = SimpleNamespace(core=CORE, num_experts=E, slices=[SimpleNamespace(experts=s) for s in slices])
    return SimpleNamespace(
        layers={l: lp for l in layers},
        swappable_budget_bytes=len(layers) * E * per_expert,  # every expert fits
        per_expert_bytes=per_expert,
        fill_order=lambda: ([], "none"),
    )


def _held_config_layer(vk, fmt, index):
    """A stand-in layer whose quant config is built once and held (as vLLM does)."""
    layer = make_layer(vk, fmt, index)
    held = quant_config(vk, fmt, layer)
    act = vk.act.MoEActivation.SILU
    layer.quant_method.apply = lambda layer, x, topk_weights, topk_ids, **_: vk.fused_experts(
        x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, activation=act, quant_config=held
    )
    return layer


def _forward(layer, x, tw, ti):  # what ReapRoutedExperts.forward_modular hands the kernel
    from reap_swap.engine.residency.grouped import to_physical

    ids = to_physical(layer.reap_group_map, ti) if getattr(layer, "reap_group_map", None) is not None else ti
    return layer.quant_method.apply(layer=layer, x=x, topk_weights=tw, topk_ids=ids)


@pytest.fixture(scope="module")
def vk():
    fm = pytest.importorskip("vllm.model_executor.layers.fused_moe")
    cfg = pytest.importorskip("vllm.model_executor.layers.fused_moe.config")
    act = pytest.importorskip("vllm.model_executor.layers.fused_moe.activation")
    return SimpleNamespace(fused_experts=fm.fused_experts, fused_topk=fm.fused_topk, cfg=cfg, act=act)


def _engine(vk, fmt, group_size):
    from reap_swap.engine.residency.engine import CudaEngine
    from reap_swap.engine.residency.refusals import LayerRefusals

    layers = {l: _held_config_layer(vk, fmt, l) for l in (0, 1)}
    stock = {
        l: SimpleNamespace(**{n: p.detach().clone() for n, p in m.named_parameters()})
        for l, m in layers.items()
    }
    per_expert = 3 * H * 768 * (2 if fmt == "bf16" else 1)
    engine = CudaEngine(_plan(list(layers), per_expert), LayerRefusals(), group_size=group_size)
    for l, m in layers.items():
        engine.hook_layer(m, l, quant_config=FORMATS[fmt][1])
        m.quant_method.process_weights_after_loading(m)
    return engine, layers, stock


@pytest.mark.parametrize(
    ("fmt", "group_size", "b"), [("fp8-block", "auto", 2), ("fp8-block", "4", 4), ("bf16", "2", 2)]
)
def test_grouped_engine_serves_bitwise_across_swaps(vk, fmt, group_size, b):
    from reap_swap.engine.residency import swap
    from reap_swap.engine.residency.grouped_backend import GroupedResidency
    from tests.gpu.test_quant_engine import run_experts

    engine, layers, stock = _engine(vk, fmt, group_size)
    try:
        assert not engine.refusals.reasons, engine.refusals.reasons
        gs = engine.state.grouped
        assert sorted(gs.layers) == [0, 1] and engine.state.layers == {}
        backend = GroupedResidency(engine)  # the worker's constructor: pointer checks
        status = backend.status()
        assert status["layout"] == "grouped" and status["group_size"] == b, status
        if swap.reads_masters(swap.publish_mode(None, gs)):  # the masters' second mapping, made at load
            assert all(
                r.mirrored == r.host_masters() > 0 for g in gs.layers.values() for r in g.ranges.values()
            )
        inputs = [_routing(vk, m, seed=m) for m in (1, 8, 64)]
        refs = {l: [run_experts(vk, fmt, stock[l], *xi) for xi in inputs] for l in layers}
        rnd = random.Random(5).sample(range(E), E // 2)
        for label, want in (("0", []), ("25", CORE + SLICE), ("50", rnd), ("100", range(E)), ("0-after", [])):
            out = backend.apply({0: want, 1: CORE})
            entry = gs.layers[0]
            groups = gs.table.resident().get(0, frozenset())
            for rng in entry.ranges.values():
                assert sum(x is not None for x in rng.backing) == len(groups), label
            assert out["bytes_copied"] == out["admitted"] * entry.layout.group_payload_bytes, label
            assert set(want) <= backend.resident()[0]
            for l, m in layers.items():
                for xi, ref in zip(inputs, refs[l]):
                    assert torch.equal(_forward(m, *xi), ref), (fmt, group_size, label, l, xi[0].shape)
        check = backend.selfcheck(iters=2)
        assert all(v["params_in_range"] for v in check["layers"].values()), check
    finally:
        engine.release()


def test_negative_control_and_fault_rollback_and_graph_replay(vk):
    from reap_swap.engine.residency.fault import FaultInjectingBackend
    from reap_swap.engine.residency.grouped_backend import GroupedResidency
    from reap_swap.engine.residency.swap import SwapStepFailed
    from tests.gpu.test_quant_engine import run_experts

    engine, layers, stock = _engine(vk, "fp8-block", "auto")
    try:
        backend = GroupedResidency(engine)
        m = layers[0]
        x, tw, ti = _routing(vk, 8, seed=8)
        ref = run_experts(vk, "fp8-block", stock[0], x, tw, ti)
        no_remap = m.quant_method.apply(layer=m, x=x, topk_weights=tw, topk_ids=ti)
        assert not torch.equal(no_remap, ref)  # the permutation is really applied
        before = engine.state.grouped.table.resident()
        faulty = FaultInjectingBackend(backend, rank=0)
        faulty.arm(after_admissions=1)
        with pytest.raises(SwapStepFailed) as err:
            faulty.apply({0: list(range(E)), 1: CORE})
        assert err.value.rolled_back and engine.state.grouped.table.resident() == before
        assert torch.equal(_forward(m, x, tw, ti), ref)
        static = [x.clone(), tw.clone(), ti.clone()]
        _forward(m, *static)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _forward(m, *static)
        for want in ([], CORE + SLICE, list(range(E)), []):
            backend.apply({0: want, 1: CORE})
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, ref), want
    finally:
        engine.release()
