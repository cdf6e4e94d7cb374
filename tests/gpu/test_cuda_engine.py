"""The worker's CUDA path without vLLM: CudaEngine re-homes a stand-in MoE layer through the post-load
hook, CudaResidency serves swaps over it, the fault wrapper fails one mid-swap and the rollback
restores the bytes, refusals are recorded, and release() frees the pool (what worker shutdown does).

The stand-in carries what compat.moe checks (an `UnquantizedFusedMoEMethod` on the TRITON
backend) and computes `apply` with plain torch over the re-homed views, so what the kernel would
read is checked bitwise. vLLM's own kernel over the same engine: test_vmm_residency.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

E, H, I, TOPK = 16, 1024, 512, 4  # one expert = 3 MiB in bf16: a 4 MiB unit (33 % padding, accepted)


class UnquantizedFusedMoEMethod:  # stand-in carrying the name and backend the engine accepts
    is_monolithic = False
    unquantized_backend = SimpleNamespace(name="TRITON")

    def process_weights_after_loading(self, layer):
        pass

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for k in range(topk_ids.shape[1]):
                e = int(topk_ids[t, k])
                gate, up = (layer.w13_weight[e] @ x[t]).chunk(2)
                out[t] += topk_weights[t, k] * (layer.w2_weight[e] @ (torch.nn.functional.silu(gate) * up))
        return out


class Layer(torch.nn.Module):
    def __init__(self, index: int, dtype=torch.bfloat16):
        super().__init__()
        self.layer_name = f"model.layers.{index}.mlp.experts"
        self.expert_map = None
        self.top_k = TOPK
        self.quant_method = UnquantizedFusedMoEMethod()
        gen = torch.Generator(device="cuda").manual_seed(index)
        for name, shape in (("w13_weight", (E, 2 * I, H)), ("w2_weight", (E, H, I))):
            w = (torch.randn(*shape, device="cuda", generator=gen) * 0.02).to(dtype)
            self.register_parameter(name, torch.nn.Parameter(w, requires_grad=False))


def _plan(layers, core, budget_experts):
    unit = (2 * I * H + H * I) * 2
    return SimpleNamespace(
        layers={l: SimpleNamespace(core=core, num_experts=E) for l in layers},
        swappable_budget_bytes=budget_experts * unit,
        per_expert_bytes=unit,
    )


@pytest.fixture
def engine_and_layers():
    from reap_swap.engine.residency.engine import CudaEngine
    from reap_swap.engine.residency.refusals import LayerRefusals

    engine = CudaEngine(_plan([0, 1], core=[0, 1], budget_experts=12), LayerRefusals())
    layers = [Layer(0), Layer(1), Layer(2), Layer(3, dtype=torch.float32)]
    masters = [(m.w13_weight.detach().clone(), m.w2_weight.detach().clone()) for m in layers]
    for index, m in enumerate(layers):
        engine.hook_layer(m, index)
        m.quant_method.process_weights_after_loading(m)  # what vLLM's loader calls
    yield engine, layers, masters
    engine.release()


def test_layers_are_rehomed_or_refused_at_load(engine_and_layers):
    from reap_swap.compat import moe as vllm_moe

    engine, layers, masters = engine_and_layers
    st = engine.state
    assert sorted(st.layers) == [0, 1] and st.table.num_slots == 12
    assert engine.refusals.reasons == {
        "model.layers.2.mlp.experts": "layer 2 is not in the plan",
        "model.layers.3.mlp.experts": "dtype torch.float32 not supported (bf16/fp16 only)",
    }
    assert engine.refusals.on_hbm == {2: True, 3: True}
    for m, (w13, w2) in zip(layers[:2], masters):
        assert m.w13_weight.data_ptr() == st.layers[int(m.layer_name.split(".")[2])].rng.base
        assert vllm_moe.is_uva_offloaded(m.w13_weight)  # else vLLM's loader would re-offload it
        assert torch.equal(m.w13_weight, w13) and torch.equal(m.w2_weight, w2)
    assert st.table.resident() == {0: frozenset({0, 1}), 1: frozenset({0, 1})}  # the core, at load


def test_backend_swaps_self_checks_and_reports(engine_and_layers):
    from reap_swap.engine.residency.cuda_backend import CudaResidency

    engine, layers, masters = engine_and_layers
    backend = CudaResidency(engine)
    out = backend.apply({0: {0, 1, 2, 3, 4}, 1: {0, 1}, 2: set(range(E))})
    assert out["admitted"] == 3 and out["ignored_layers"] == [2] and out["bytes_copied"] > 0
    resident = backend.resident()
    assert resident[0] == frozenset(range(5)) and resident[1] == frozenset({0, 1})
    assert resident[2] == resident[3] == frozenset()  # refused and not in the plan: nothing counted
    for m, (w13, w2) in zip(layers[:2], masters):
        assert torch.equal(m.w13_weight, w13) and torch.equal(m.w2_weight, w2)
    check = backend.selfcheck(iters=2)
    assert check["layers"]["0"] == {"params_in_range": True, "hbm_units": 5, "table_resident": 5}
    assert check["layer0_hbm_us"] > 0 and check["layer0_host_us"] > 0
    status = backend.status()
    assert (
        status["mode"] == "cuda" and status["layers_rehomed"] == [0, 1] and len(status["refused_layers"]) == 2
    )


def test_fault_wrapper_fails_mid_swap_and_the_bytes_are_the_previous_sets(engine_and_layers):
    from reap_swap.engine.residency.cuda_backend import CudaResidency
    from reap_swap.engine.residency.fault import FaultInjectingBackend
    from reap_swap.engine.residency.swap import SwapStepFailed

    engine, layers, masters = engine_and_layers
    backend = FaultInjectingBackend(CudaResidency(engine), rank=0)
    backend.apply({0: set(range(6)), 1: {0, 1}})
    before = backend.st.table.resident()
    fault = backend.arm(after_admissions=2)
    with pytest.raises(SwapStepFailed) as failed:
        backend.apply({0: {0, 1}, 1: set(range(10))})
    assert fault.fired and failed.value.rolled_back and backend.st.table.resident() == before
    m, (w13, w2) = layers[1], masters[1]
    assert sum(b is not None for b in backend.st.layers[1].rng.backing) == 2
    assert torch.equal(m.w13_weight, w13) and torch.equal(m.w2_weight, w2)
    x = torch.randn(2, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.tensor([[0, 3, 5, 9], [1, 2, 4, 8]], device="cuda", dtype=torch.int32)
    w = torch.full((2, TOPK), 0.25, device="cuda")
    ref = UnquantizedFusedMoEMethod().apply(
        SimpleNamespace(w13_weight=w13, w2_weight=w2), x, w, ids, None, None
    )
    assert torch.equal(m.quant_method.apply(m, x, w, ids, None, None), ref)
    assert backend.apply({0: {0, 1}, 1: set(range(10))})["admitted"] == 8  # one-shot: now it works


def test_runtime_close_releases_the_pool():
    pytest.importorskip("pydantic")  # reap_swap.config.settings (absent from the bare H200 image)
    from reap_swap.config.settings import Settings
    from reap_swap.engine.residency.engine import CudaEngine
    from reap_swap.engine.residency.refusals import LayerRefusals
    from reap_swap.engine.runtime import WorkerRuntime

    runtime = WorkerRuntime(config={}, settings=Settings(), plan=_plan([0], core=[0], budget_experts=4))
    runtime.engine = CudaEngine(runtime.plan, LayerRefusals())
    layer = Layer(0)
    runtime.engine.hook_layer(layer, 0)
    layer.quant_method.process_weights_after_loading(layer)
    free_before = torch.cuda.mem_get_info()[0]
    runtime.close()
    assert runtime.engine.state is None
    assert torch.cuda.mem_get_info()[0] >= free_before + 4 * 4 * 2**20  # the 4 slots of 4 MiB came back


@pytest.mark.parametrize("publish", [-2, 8])  # -2: swap.PUBLISH_AHEAD (the default since run 24)
def test_a_layer_without_a_core_gets_its_masters_second_mapping_at_load(publish):
    """Remapping ahead reads the masters at a second mapping; a layer whose plan core is empty
    made it only in its first request-time swap (run 24: that swap took 211 ms more). Now the
    load makes it, with the masters' bytes there; without remapping ahead nothing is mapped."""
    from reap_swap.engine.residency.cuda_backend import CudaResidency
    from reap_swap.engine.residency.engine import CudaEngine
    from reap_swap.engine.residency.refusals import LayerRefusals
    from reap_swap.engine.vmm import _ArrayInterface

    engine = CudaEngine(_plan([0], core=[], budget_experts=4), LayerRefusals(), publish_every=publish)
    layer = Layer(0)
    w13, w2 = layer.w13_weight.detach().clone(), layer.w2_weight.detach().clone()
    engine.hook_layer(layer, 0)
    layer.quant_method.process_weights_after_loading(layer)
    try:
        rng = engine.state.layers[0].rng
        assert not engine.state.table.resident().get(0)  # the table lists only layers with residents
        assert rng.mirrored == (E if publish == -2 else 0)
        if publish == -2:
            mirror = torch.as_tensor(_ArrayInterface(rng.mirror_base, rng.nbytes), device="cuda")
            assert torch.equal(mirror, rng.as_bytes())  # every master's bytes at the second mapping
        out = CudaResidency(engine).apply({0: {0, 1, 2, 3}})
        assert out["admitted"] == 4 and rng.mirrored == (E if publish == -2 else 0)
        assert torch.equal(layer.w13_weight, w13) and torch.equal(layer.w2_weight, w2)
    finally:
        engine.release()
