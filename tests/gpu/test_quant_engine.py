"""The CUDA engine over quantized and biased MoE layers, through vLLM 0.26.0's own Triton kernel.

Each stand-in layer carries what the engine reads from a real vLLM layer after
process_weights_after_loading (the quant method's class name, `moe_kernel.fused_experts` of class
TritonExperts, local_num_experts / hidden_size / intermediate_size_per_partition, moe_config.in_dtype)
and the tensors of the format, shaped as the H200 survey (research.md run 8) found them. Its
`apply` calls vLLM's `fused_experts` on the layer's *current* parameters with a quant config built
from the layer's kept-whole scales / biases, so the engine's binding is what the kernel reads.
Formats: bf16, GPT-OSS bf16 (w13_bias / w2_bias, swigluoai), FP8 block 128x128 (weight_scale_inv),
FP8 per-tensor (weight and input scales), online fp8 (scales [E]), compressed-tensors FP8 channel.
Checked bitwise against the same call on the untouched tensors: at 0 / 25 / 50 / 100 % resident, after
swaps back to 0 %, and a CUDA-graph-captured forward replayed across a swap. Also: AWQ-Marlin-shaped
and MXFP4-monolithic layers are refused by name and keep their tensors.

Qwen3-30B-A3B expert shape (H=2048, I=768), 32 experts, top-8 (~1-2 min on the H200). Run:
    PYTHONPATH=/tmp/site:$PWD python3 -m pytest -q tests/gpu/test_quant_engine.py
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

E, H, I, TOPK = 32, 2048, 768, 8
FP8 = torch.float8_e4m3fn
BLOCK_CFG = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
CT_FP8 = {
    "quant_method": "compressed-tensors",
    "config_groups": {"g": {"weights": {"type": "float", "num_bits": 8, "strategy": "channel"}}},
}
# format -> (method class name, quant config the binder reads)
FORMATS = {
    "bf16": ("UnquantizedFusedMoEMethod", {}),
    "gptoss-bf16": ("UnquantizedFusedMoEMethod", {}),
    "fp8-block": ("Fp8MoEMethod", BLOCK_CFG),
    "fp8-tensor": ("Fp8MoEMethod", {"quant_method": "fp8", "activation_scheme": "static"}),
    "fp8-online": ("Fp8PerTensorOnlineMoEMethod", {"quant_method": "fp8"}),
    "ct-fp8": ("CompressedTensorsW8A8Fp8MoEMethod", CT_FP8),
}


@pytest.fixture(scope="module")
def vk():
    fm = pytest.importorskip("vllm.model_executor.layers.fused_moe")
    cfg = pytest.importorskip("vllm.model_executor.layers.fused_moe.config")
    act = pytest.importorskip("vllm.model_executor.layers.fused_moe.activation")
    return SimpleNamespace(fused_experts=fm.fused_experts, fused_topk=fm.fused_topk, cfg=cfg, act=act)


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


# the size goes as one tuple: `torch.rand(*(), ...)` would pass no size at all (a TypeError on
# torch 2.11 for the 0-dim input scales), while `torch.rand((), ...)` is a 0-dim tensor
def _fp8(shape, seed):
    return (torch.randn(tuple(shape), device="cuda", generator=_gen(seed)) * 64).clamp(-448, 448).to(FP8)


def _scales(shape, seed):
    return torch.rand(tuple(shape), device="cuda", generator=_gen(seed)) * 0.004 + 0.001


def _bf16(shape, seed, scale=0.02):
    return (torch.randn(tuple(shape), device="cuda", generator=_gen(seed)) * scale).to(torch.bfloat16)


def make_tensors(fmt: str) -> dict[str, torch.Tensor]:
    if fmt in ("bf16", "gptoss-bf16"):
        t = {"w13_weight": _bf16((E, 2 * I, H), 1), "w2_weight": _bf16((E, H, I), 2)}
        if fmt == "gptoss-bf16":
            t.update(w13_bias=_bf16((E, 2 * I), 3, 0.1), w2_bias=_bf16((E, H), 4, 0.1))
        return t
    t = {"w13_weight": _fp8((E, 2 * I, H), 1), "w2_weight": _fp8((E, H, I), 2)}
    if fmt == "fp8-block":
        t.update(w13_weight_scale_inv=_scales((E, 2 * I // 128, H // 128), 3))
        t.update(w2_weight_scale_inv=_scales((E, H // 128, I // 128), 4))
    elif fmt == "ct-fp8":
        t.update(w13_weight_scale=_scales((E, 2 * I, 1), 3), w2_weight_scale=_scales((E, H, 1), 4))
    else:
        t.update(w13_weight_scale=_scales((E,), 3), w2_weight_scale=_scales((E,), 4))
        if fmt == "fp8-tensor":
            t.update(w13_input_scale=_scales((), 5) * 4, w2_input_scale=_scales((), 6) * 4)
    return t


def quant_config(vk, fmt: str, t) -> object:
    """The FusedMoEQuantConfig vLLM builds for the format, from the (kept-whole) tensors `t`."""
    cfg = vk.cfg
    if fmt == "bf16":
        return None
    if fmt == "gptoss-bf16":
        return cfg.biased_moe_quant_config(t.w13_bias, t.w2_bias)
    if fmt == "fp8-block":
        return cfg.fp8_w8a8_moe_quant_config(
            w1_scale=t.w13_weight_scale_inv, w2_scale=t.w2_weight_scale_inv, block_shape=[128, 128]
        )
    if fmt == "ct-fp8":
        return cfg.fp8_w8a8_moe_quant_config(
            w1_scale=t.w13_weight_scale,
            w2_scale=t.w2_weight_scale,
            per_act_token_quant=True,
            per_out_ch_quant=True,
        )
    extra = {}
    if fmt == "fp8-tensor":
        extra = dict(a1_scale=t.w13_input_scale, a2_scale=t.w2_input_scale)
    return cfg.fp8_w8a8_moe_quant_config(w1_scale=t.w13_weight_scale, w2_scale=t.w2_weight_scale, **extra)


def run_experts(vk, fmt, t, x, tw, ti):
    act = vk.act.MoEActivation.SWIGLUOAI if fmt == "gptoss-bf16" else vk.act.MoEActivation.SILU
    return vk.fused_experts(
        x, t.w13_weight, t.w2_weight, tw, ti, activation=act, quant_config=quant_config(vk, fmt, t)
    )


def make_layer(vk, fmt: str, index: int, tensors=None) -> torch.nn.Module:
    method_name = FORMATS[fmt][0] if fmt in FORMATS else fmt
    experts = type("TritonExperts", (), {})()
    method = type(method_name, (), {})()
    method.is_monolithic = False
    method.unquantized_backend = SimpleNamespace(name="TRITON")
    method.moe_kernel = SimpleNamespace(fused_experts=experts)
    method.process_weights_after_loading = lambda layer: None
    method.apply = lambda layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input: run_experts(
        vk, fmt, layer, x, topk_weights, topk_ids
    )
    m = torch.nn.Module()
    m.layer_name = f"model.layers.{index}.mlp.experts"
    m.expert_map, m.top_k, m.quant_method = None, TOPK, method
    m.local_num_experts, m.hidden_size, m.intermediate_size_per_partition = E, H, I
    m.moe_config = SimpleNamespace(in_dtype=torch.bfloat16)
    for name, t in (tensors or make_tensors(fmt)).items():
        m.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    return m


def _plan(layers, budget_experts, per_expert):
    return SimpleNamespace(
        layers={l: SimpleNamespace(core=[], num_experts=E) for l in layers},
        swappable_budget_bytes=budget_experts * per_expert,
        per_expert_bytes=per_expert,
    )


def _engine(vk, fmt, budget_experts=E):
    from reap_swap.engine.residency.engine import CudaEngine
    from reap_swap.engine.residency.refusals import LayerRefusals

    layer = make_layer(vk, fmt, 0)
    stock = {n: p.detach().clone() for n, p in layer.named_parameters()}
    engine = CudaEngine(_plan([0], budget_experts, 1), LayerRefusals())
    engine.hook_layer(layer, 0, quant_config=FORMATS[fmt][1])
    layer.quant_method.process_weights_after_loading(layer)
    return engine, layer, SimpleNamespace(**stock)


def _routing(vk, m, seed):
    g = _gen(seed)
    x = torch.randn(m, H, device="cuda", generator=g).to(torch.bfloat16)
    tw, ti, _ = vk.fused_topk(x, torch.randn(m, E, device="cuda", generator=g), TOPK, renormalize=True)
    return x, tw, ti


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_engine_binds_and_serves_bitwise_across_swaps(vk, fmt):
    from reap_swap.engine.residency.cuda_backend import CudaResidency, misplaced_tensors

    engine, layer, stock = _engine(vk, fmt)
    try:
        assert not engine.refusals.reasons, engine.refusals.reasons
        st = engine.state
        entry = st.layers[0]
        assert misplaced_tensors(entry) == [] and entry.layout.names == ("w13_weight", "w2_weight")
        kept = {n: p for n, p in layer.named_parameters() if n not in entry.layout.names}
        for name, p in kept.items():  # kept whole: untouched, where vLLM put them
            assert torch.equal(p, getattr(stock, name)), name
        assert entry.kept_bytes == sum(p.numel() * p.element_size() for p in kept.values())
        backend = CudaResidency(engine)
        assert backend.status()["kept_whole_hbm_bytes"] == entry.kept_bytes
        inputs = [_routing(vk, m, seed=m) for m in (1, 8, 64)]
        refs = [run_experts(vk, fmt, stock, *xi) for xi in inputs]
        for frac in (0.0, 0.25, 0.5, 1.0, 0.5, 0.0):
            resident = set(range(0, E, 2)) if frac == 0.5 else set(range(int(E * frac)))  # 50 %: evens
            out = backend.apply({0: resident})
            assert sum(b is not None for b in entry.rng.backing) == len(resident)
            if out["admitted"]:
                assert out["bytes_copied"] == out["admitted"] * entry.layout.payload_bytes
            for xi, ref in zip(inputs, refs):
                got = vllm_apply(layer, *xi)
                assert torch.equal(got, ref), (fmt, frac, xi[0].shape)
    finally:
        engine.release()


def vllm_apply(layer, x, tw, ti):
    from reap_swap.compat import moe as vllm_moe

    return vllm_moe.run_routed_experts(layer, x, tw, ti)


@pytest.mark.parametrize("fmt", ["fp8-block", "gptoss-bf16"])
def test_cuda_graph_replayed_across_a_swap_is_bitwise(vk, fmt):
    from reap_swap.engine.residency.cuda_backend import CudaResidency

    engine, layer, stock = _engine(vk, fmt)
    try:
        backend = CudaResidency(engine)
        x, tw, ti = _routing(vk, 4, seed=7)
        ref = run_experts(vk, fmt, stock, x, tw, ti)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up (Triton compiles) outside the capture
            vllm_apply(layer, x, tw, ti)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = vllm_apply(layer, x, tw, ti)
        for resident in (set(), set(ti.flatten().tolist()), set(range(E)), set(range(0, E, 3)), set()):
            backend.apply({0: resident})
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, ref), (fmt, sorted(resident))
    finally:
        engine.release()


def test_contiguous_and_monolithic_layers_are_refused_by_name(vk):
    from reap_swap.engine.residency.engine import CudaEngine
    from reap_swap.engine.residency.refusals import LayerRefusals

    engine = CudaEngine(_plan([0, 1], E, 1), LayerRefusals())
    awq = {
        "w13_qweight": torch.zeros(E, H // 16, 2 * I * 2, dtype=torch.int32, device="cuda"),
        "w13_scales": torch.ones(E, H // 128, 2 * I, dtype=torch.float16, device="cuda"),
        "w13_qzeros": torch.zeros(E, H // 128, 2 * I // 8, dtype=torch.int32, device="cuda"),
        "w2_qweight": torch.zeros(E, I // 16, H * 2, dtype=torch.int32, device="cuda"),
        "w2_scales": torch.ones(E, I // 128, H, dtype=torch.float16, device="cuda"),
        "w2_qzeros": torch.zeros(E, I // 128, H // 8, dtype=torch.int32, device="cuda"),
    }
    marlin = make_layer(vk, "AutoAWQMoEMethod", 0, awq)
    marlin.quant_method.moe_kernel = SimpleNamespace(fused_experts=type("MarlinExperts", (), {})())
    marlin.w13_weight, marlin.w2_weight = marlin.w13_qweight, marlin.w2_qweight
    mono = make_layer(vk, "GptOssMxfp4MoEMethod", 1, {"w13_bias": torch.zeros(E, 2 * I, device="cuda")})
    mono.quant_method.is_monolithic = True
    mono.w13_weight = torch.zeros(E, 4, device="cuda")
    try:
        engine.hook_layer(marlin, 0, quant_config={"quant_method": "awq", "bits": 4, "group_size": 128})
        engine.hook_layer(mono, 1, quant_config={"quant_method": "mxfp4"})
        for m in (marlin, mono):
            m.quant_method.process_weights_after_loading(m)
        reasons = engine.refusals.reasons
        assert "MarlinExperts implies the expert stride" in reasons["model.layers.0.mlp.experts"]
        assert "monolithic MoE kernel" in reasons["model.layers.1.mlp.experts"]
        assert engine.state is None or not engine.state.layers
        assert marlin.w13_weight.data_ptr() == marlin.w13_qweight.data_ptr()  # untouched
    finally:
        engine.release()
