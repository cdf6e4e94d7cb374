"""The residency engine against vLLM's own Triton MoE kernel: bitwise equality and graph safety.

Shapes are a Qwen3-30B-A3B layer (E=128, H=2048, I=768, top-8, bf16). Run on the H200:
    PYTHONPATH=/tmp/site python3 -m pytest -q tests/gpu
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.gpu.standalone import standalone_bf16_layer  # noqa: E402

E, H, I, TOPK = 128, 2048, 768, 8


@pytest.fixture(scope="module")
def kernel():
    fm = pytest.importorskip("vllm.model_executor.layers.fused_moe")
    return fm.fused_experts, fm.fused_topk


@pytest.fixture(scope="module")
def layer():
    yield from standalone_bf16_layer(0, E, H, I)


def _routing(kernel, m, seed):
    _, fused_topk = kernel
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, H, device="cuda", generator=gen).to(torch.bfloat16)
    logits = torch.randn(m, E, device="cuda", generator=gen)
    tw, ti, _ = fused_topk(x, logits, TOPK, renormalize=True)
    return x, tw, ti


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.25, 0.0])
@pytest.mark.parametrize("m", [1, 8, 64])
def test_bitwise_equal_at_every_residency(kernel, layer, fraction, m):
    from reap_swap.engine.residency.state import swap_state

    fused_experts, _ = kernel
    st, (w13, w2), (v13, v2) = layer
    k = int(E * fraction)
    resident = torch.randperm(E, generator=torch.Generator().manual_seed(k))[:k].tolist()
    swap_state(st, {0: resident})
    assert st.table.resident().get(0, frozenset()) == frozenset(resident)
    x, tw, ti = _routing(kernel, m, seed=m)
    ref = fused_experts(x, w13, w2, tw, ti)
    out = fused_experts(x, v13, v2, tw, ti)
    assert torch.equal(ref, out)


def test_swap_moves_bytes_and_data_lands(layer):
    from reap_swap.engine.residency.state import swap_state

    st, (w13, w2), (v13, v2) = layer
    swap_state(st, {0: []})
    result = swap_state(st, {0: list(range(16))})
    assert result.bytes_copied == 16 * st.layers[0].expert_bytes
    assert len(result.plan.admit) == 16
    assert torch.equal(v13[:16], w13[:16]) and torch.equal(v2[:16], w2[:16])
    # evicting copies nothing and the host master still holds the same bytes
    result = swap_state(st, {0: list(range(8))})
    assert result.bytes_copied == 0 and len(result.plan.evict) == 8
    assert torch.equal(v13, w13) and torch.equal(v2, w2)


def test_cuda_graph_survives_swaps(kernel, layer):
    from reap_swap.engine.residency.state import swap_state

    fused_experts, _ = kernel
    st, (w13, w2), (v13, v2) = layer
    x, tw, ti = _routing(kernel, 8, seed=123)
    ref = fused_experts(x, w13, w2, tw, ti)
    swap_state(st, {0: list(range(0, E, 2))})
    fused_experts(x, v13, v2, tw, ti)  # warm up (Triton compile) outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, v13, v2, tw, ti)
    for target in ([], list(range(E)), ti.flatten().unique().tolist(), list(range(1, E, 2))):
        swap_state(st, {0: target})
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref), f"graph replay wrong after swap to {len(target)} experts"


def test_capacity_refused_before_anything_moves(layer):
    from reap_swap.cache.slot_table import PoolCapacityError
    from reap_swap.engine.residency.state import swap_state

    st, _, _ = layer
    swap_state(st, {0: [1, 2, 3]})
    st.table.num_slots, saved = 2, st.table.num_slots
    try:
        with pytest.raises(PoolCapacityError):
            swap_state(st, {0: [4, 5, 6]})
        assert st.table.resident()[0] == frozenset({1, 2, 3})
    finally:
        st.table.num_slots = saved


def test_rehome_survives_vllm_uva_reoffload():
    """The post-load hook runs inside vLLM's device_loading_context; on exit that context re-offloads
    UVA parameters it thinks were replaced. The re-homed parameters must still read the engine's
    range afterwards (found on the H200: without the fix every expert was read from a fresh
    pinned copy, whatever the residency)."""
    from types import SimpleNamespace

    loader_utils = pytest.importorskip("vllm.model_executor.model_loader.utils")
    from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor

    from reap_swap.engine.residency.cuda_backend import CudaResidency
    from reap_swap.engine.residency.engine import CudaEngine
    from reap_swap.engine.residency.refusals import LayerRefusals

    class UnquantizedFusedMoEMethod:  # stand-in carrying the name and backend the engine accepts
        is_monolithic = False
        unquantized_backend = SimpleNamespace(name="TRITON")

        def process_weights_after_loading(self, layer):
            pass

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer_name = "model.layers.0.mlp.experts"
            self.expert_map = None
            self.quant_method = UnquantizedFusedMoEMethod()
            for name, shape in (("w13_weight", (E, 2 * I, H)), ("w2_weight", (E, H, I))):
                host = (torch.randn(*shape) * 0.02).to(torch.bfloat16).pin_memory()
                p = torch.nn.Parameter(get_accelerator_view_from_cpu_tensor(host), requires_grad=False)
                p._vllm_is_uva_offloaded = True
                self.register_parameter(name, p)

    layer = Layer()
    reference = layer.w13_weight.detach().clone()
    engine = CudaEngine(None, LayerRefusals())  # one per worker process, owned by its runtime
    engine.hook_layer(layer, 0)
    with loader_utils.device_loading_context(layer, torch.device("cuda")):
        layer.quant_method.process_weights_after_loading(layer)
    assert not engine.refusals.reasons
    entry = engine.state.layers[0]
    assert layer.w13_weight.data_ptr() == entry.rng.base
    assert torch.equal(layer.w13_weight, reference)
    CudaResidency(engine)  # refuses (RuntimeError) if any parameter left its range
    engine.release()  # what worker shutdown does (runtime.close): the pool and ranges are freed
    assert engine.state is None


def test_injected_mid_swap_failure_restores_the_previous_set(kernel, layer):
    """The fault seam behind reap_arm_swap_fault on the real engine (the worker's backend wrapper
    over CudaResidency and the VMM store): the swap fails after one admission was published,
    apply_swap's rollback runs, and the kernel reads the previous set's bytes (bitwise) from the
    same addresses."""
    from reap_swap.engine.residency.cuda_backend import CudaResidency
    from reap_swap.engine.residency.fault import FaultInjectingBackend
    from reap_swap.engine.residency.state import swap_state
    from reap_swap.engine.residency.swap import SwapStepFailed
    from reap_swap.engine.residency.vmm_store import VmmStore

    fused_experts, _ = kernel
    st, (w13, w2), (v13, v2) = layer
    swap_state(st, {0: list(range(32))})
    before = st.table.resident()
    backend = FaultInjectingBackend(CudaResidency.over(st, VmmStore(st)), rank=0)
    backend.arm(after_admissions=1)
    with pytest.raises(SwapStepFailed) as failed:
        backend.apply({0: list(range(16, 64))})
    assert failed.value.rolled_back
    assert st.table.resident() == before
    assert sum(b is not None for b in st.layers[0].rng.backing) == 32
    x, tw, ti = _routing(kernel, 8, seed=7)
    assert torch.equal(fused_experts(x, v13, v2, tw, ti), fused_experts(x, w13, w2, tw, ti))
