"""The engine's binding path on CPU: fake MoE layers shaped as vLLM 0.26.0 leaves each format after
process_weights_after_loading (the shapes/dtypes/strides of the H200 survey, run 8, with fewer
experts), through `residency.binding.bind_module` (tensors -> LayerSpec -> bind_layer -> unit
layout) and `residency.unit_layout.plan_unit`. No GPU: `on_device` is substituted."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from reap_swap.engine.residency.binding import LayerSizes, bind_module, layer_tensors  # noqa: E402
from reap_swap.sizing.unit_layout import SLAB_ALIGN, plan_unit  # noqa: E402

MIB = 2**20
G = 2 * MIB
E, H, I = 2, 2048, 768  # Qwen3-30B-A3B expert shape, 2 experts (the survey had 128)
SIZES = LayerSizes(E, H, I)
FP8 = torch.float8_e4m3fn
BLOCK_CFG = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
CT_FP8 = {
    "quant_method": "compressed-tensors",
    "config_groups": {"g": {"weights": {"type": "float", "num_bits": 8, "strategy": "channel"}}},
}


def fake_layer(tensors: dict, plain: tuple[str, ...] = ()) -> torch.nn.Module:
    m = torch.nn.Module()
    for name, t in tensors.items():
        if name in plain:
            setattr(m, name, t)
        else:
            m.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    return m


def bind(layer, cfg, method, experts="TritonExperts", **kw):
    return bind_module(layer, SIZES, cfg, (method, experts), G, on_device=lambda t: True, **kw)


def z(*shape, dtype=torch.bfloat16):
    return torch.zeros(*shape, dtype=dtype)


def test_bf16_is_todays_two_tensor_unit():
    b = bind(
        fake_layer({"w13_weight": z(E, 2 * I, H), "w2_weight": z(E, H, I)}), {}, "UnquantizedFusedMoEMethod"
    )
    assert b.refusal is None and list(b.rehome) == ["w13_weight", "w2_weight"] and not b.kept
    assert b.layout.offsets == (0, 6 * MIB) and b.layout.payload_bytes == 9 * MIB
    assert b.layout.unit_bytes == 10 * MIB and abs(b.layout.padding_overhead - 1 / 9) < 1e-9


def test_gpt_oss_bf16_biases_are_kept_whole_and_counted():
    layer = fake_layer(
        {"w13_weight": z(E, 2 * I, H), "w2_weight": z(E, H, I), "w13_bias": z(E, 2 * I), "w2_bias": z(E, H)}
    )
    b = bind(layer, {}, "UnquantizedFusedMoEMethod")
    assert b.refusal is None and sorted(b.kept) == ["w13_bias", "w2_bias"]
    assert b.kept_bytes == E * (2 * I + H) * 2 and b.layout.names == ("w13_weight", "w2_weight")


def test_fp8_block_rehomes_weights_keeps_scale_inv():
    layer = fake_layer(
        {
            "w13_weight": z(E, 2 * I, H, dtype=FP8),
            "w13_weight_scale_inv": z(E, 2 * I // 128, H // 128, dtype=torch.float32),
            "w2_weight": z(E, H, I, dtype=FP8),
            "w2_weight_scale_inv": z(E, H // 128, I // 128, dtype=torch.float32),
        }
    )
    b = bind(layer, BLOCK_CFG, "Fp8MoEMethod")
    assert b.refusal is None and sorted(b.kept) == ["w13_weight_scale_inv", "w2_weight_scale_inv"]
    assert b.layout.offsets == (0, 3 * MIB) and b.layout.unit_bytes == 6 * MIB  # 4.5 -> 6 MiB


def test_fp8_tensor_input_scales_and_online_fp8():
    tensors = {
        "w13_weight": z(E, 2 * I, H, dtype=FP8),
        "w13_weight_scale": z(E, dtype=torch.float32),
        "w13_input_scale": z((), dtype=torch.float32),
        "w2_weight": z(E, H, I, dtype=FP8),
        "w2_weight_scale": z(E, dtype=torch.float32),
        "w2_input_scale": z((), dtype=torch.float32),
    }
    b = bind(fake_layer(tensors), {"quant_method": "fp8", "activation_scheme": "static"}, "Fp8MoEMethod")
    assert b.refusal is None and len(b.kept) == 4
    online = {k: v for k, v in tensors.items() if "input" not in k}
    b = bind(fake_layer(online), {"quant_method": "fp8"}, "Fp8PerTensorOnlineMoEMethod")
    assert b.refusal is None and b.layout.unit_bytes == 6 * MIB


def test_ct_fp8_channel():
    layer = fake_layer(
        {
            "w13_weight": z(E, 2 * I, H, dtype=FP8),
            "w13_weight_scale": z(E, 2 * I, 1, dtype=torch.float32),
            "w2_weight": z(E, H, I, dtype=FP8),
            "w2_weight_scale": z(E, H, 1, dtype=torch.float32),
        }
    )
    b = bind(layer, CT_FP8, "CompressedTensorsW8A8Fp8MoEMethod")
    assert b.refusal is None and b.kept_bytes == E * (2 * I + H) * 4


def test_fp8_on_a_kernel_not_known_to_take_strides_is_refused_by_name():
    layer = fake_layer({"w13_weight": z(E, 2 * I, H, dtype=FP8), "w2_weight": z(E, H, I, dtype=FP8)})
    b = bind(layer, {"quant_method": "fp8"}, "Fp8MoEMethod", experts="CutlassExpertsFp8")
    assert "w13_weight:" in b.refusal and "does not read this parameter by expert stride" in b.refusal


def _awq_marlin():
    qw13 = z(E, H // 16, 2 * I * 2, dtype=torch.int32)
    qw2 = z(E, I // 16, H * 2, dtype=torch.int32)
    layer = fake_layer(
        {
            "w13_qweight": qw13,
            "w13_scales": z(E, H // 128, 2 * I, dtype=torch.float16),
            "w13_qzeros": z(E, H // 128, 2 * I // 8, dtype=torch.int32),
            "w2_qweight": qw2,
            "w2_scales": z(E, I // 128, H, dtype=torch.float16),
            "w2_qzeros": z(E, I // 128, H // 8, dtype=torch.int32),
        }
    )
    layer.w13_weight = layer.w13_qweight  # vLLM's alias after awq_marlin_moe_repack
    layer.w2_weight = layer.w2_qweight
    return layer


def test_marlin_aliases_are_found_and_the_contiguous_kernel_is_refused_by_name():
    layer = _awq_marlin()
    tensors, aliases, opaque = layer_tensors(layer)
    assert aliases == {"w13_weight": "w13_qweight", "w2_weight": "w2_qweight"} and not opaque
    b = bind(
        layer, {"quant_method": "awq", "bits": 4, "group_size": 128}, "AutoAWQMoEMethod", "MarlinExperts"
    )
    assert b.layout is None and "<layout>: MarlinExperts implies the expert stride" in b.refusal


def test_moe_wna16_is_refused_as_contiguous():
    layer = fake_layer(
        {
            "w13_qweight": z(E, 2 * I, H // 2, dtype=torch.uint8),
            "w13_scales": z(E, 2 * I, H // 128, dtype=torch.float16),
            "w13_qzeros": z(E, I, H // 128, dtype=torch.uint8),
            "w2_qweight": z(E, H, I // 2, dtype=torch.uint8),
            "w2_scales": z(E, H, I // 128, dtype=torch.float16),
            "w2_qzeros": z(E, H // 2, I // 128, dtype=torch.uint8),
        }
    )
    b = bind(layer, {"quant_method": "awq", "bits": 4, "group_size": 128}, "MoeWNA16Method", None)
    assert b.layout is None and "<layout>" in b.refusal


def test_refusals_name_the_tensor():
    base = {"w13_weight": z(E, 2 * I, H), "w2_weight": z(E, H, I), "w13_bias": z(E, 2 * I)}
    # a kept-whole tensor that vLLM's UVA offloader put in host memory
    b = bind(fake_layer(base), {}, "UnquantizedFusedMoEMethod", is_host=lambda t: t.dim() == 2)
    assert b.refusal.startswith("w13_bias: kept whole but in host memory")
    # a re-homed tensor off the device
    b = bind_module(fake_layer(base), SIZES, {}, ("UnquantizedFusedMoEMethod", "TritonExperts"), G)
    assert "w13_weight: on cpu, not CUDA" in b.refusal
    # float32 unquantized: the engine's dtype check
    f32 = fake_layer({"w13_weight": z(E, 2 * I, H, dtype=torch.float32), "w2_weight": z(E, H, I)})
    assert (
        bind(f32, {}, "UnquantizedFusedMoEMethod").refusal
        == "dtype torch.float32 not supported (bf16/fp16 only)"
    )
    # a shaped non-tensor attribute (triton_kernels wrapper) and a transposed weight
    opaque = fake_layer({"w13_weight": z(E, 2 * I, H), "w2_weight": z(E, I, H).transpose(1, 2)})
    opaque.w13_precision = SimpleNamespace(shape=(E, 4))
    b = bind(opaque, {}, "UnquantizedFusedMoEMethod")
    assert "w13_precision: not a torch tensor (SimpleNamespace)" in b.refusal
    assert "w2_weight: inner strides" in b.refusal and b.layout is None


def test_alias_with_a_different_view_is_refused():
    layer = fake_layer({"w13_weight": z(E, 2 * I, H), "w2_weight": z(E, H, I)})
    layer.w13_flat = layer.w13_weight.data.view(E, -1)
    _, aliases, opaque = layer_tensors(layer)
    assert not aliases and opaque == {"w13_flat": "a different view of w13_weight's storage"}


def test_plan_unit_offsets_are_aligned_and_padded():
    lay = plan_unit([("a", 1000), ("b", 5000), ("c", 1)], G)
    assert lay.offsets == (0, SLAB_ALIGN, 3 * SLAB_ALIGN) and lay.payload_bytes == 3 * SLAB_ALIGN + 1
    assert lay.unit_bytes == G and lay.expert_bytes == 6001 and lay.offset_of("b") == SLAB_ALIGN
    assert plan_unit([("w13", 3 * MIB), ("w2", 3 * MIB // 2)], G).unit_bytes == 6 * MIB
    for bad in ([], [("a", 0)], [("a", 1), ("a", 2)]):
        with pytest.raises(ValueError):
            plan_unit(bad, G)
    with pytest.raises(ValueError):
        plan_unit([("a", 1)], 3000)


def test_compat_refuses_monolithic_and_non_triton_unquantized(monkeypatch):
    from reap_swap.compat import moe, mxfp4

    class GptOssMxfp4MoEMethod:
        is_monolithic = True
        moe_kernel = SimpleNamespace(fused_experts=type("OAITritonMxfp4ExpertsMonolithic", (), {})())

    layer = SimpleNamespace(quant_method=GptOssMxfp4MoEMethod())
    monkeypatch.delenv(mxfp4.GATE_ENV, raising=False)
    assert moe.unsupported_moe_method(layer) == (
        "MXFP4 on OAITritonMxfp4ExpertsMonolithic: binding implemented but not yet verified on a GPU "
        "(REAPSWAP_MXFP4=1 turns it on; docs/models.md)"
    )
    monkeypatch.setenv(mxfp4.GATE_ENV, "1")
    assert moe.unsupported_moe_method(layer) is None  # compat.mxfp4.unwrap and the rules decide
    assert moe.moe_kernel_names(layer) == ("GptOssMxfp4MoEMethod", "OAITritonMxfp4ExpertsMonolithic")

    class GptOssMxfp4MoEMethodOnTrtLlm:
        is_monolithic = True
        moe_kernel = SimpleNamespace(fused_experts=type("TrtLlmMxfp4ExpertsMonolithic", (), {})())

    assert moe.unsupported_moe_method(SimpleNamespace(quant_method=GptOssMxfp4MoEMethodOnTrtLlm())) == (
        "monolithic MoE kernel (TrtLlmMxfp4ExpertsMonolithic) routes inside the kernel"
    )

    class UnquantizedFusedMoEMethod:
        is_monolithic = False
        unquantized_backend = SimpleNamespace(name="FLASHINFER_CUTLASS")

    assert "not vLLM's Triton kernel" in moe.unsupported_moe_method(
        SimpleNamespace(quant_method=UnquantizedFusedMoEMethod())
    )

    class Fp8MoEMethod:
        is_monolithic = False

    assert moe.unsupported_moe_method(SimpleNamespace(quant_method=Fp8MoEMethod())) is None
    assert moe.moe_layer_sizes(SimpleNamespace()) is None
    assert moe.moe_layer_sizes(
        SimpleNamespace(local_num_experts=4, hidden_size=8, intermediate_size_per_partition=2)
    ) == (4, 8, 2)


def test_empty_g_idx_tensors_are_kept_whole_and_the_refusal_names_the_real_reason():
    """Run 9a, AWQ on MarlinExperts: vLLM leaves [E, 0] g_idx / sort-index tensors without
    act-order. Zero bytes are kept whole (nothing to bind); the layer is still refused, for the
    contiguous kernel, and the reason says so rather than blaming the empty tensors."""
    layer = _awq_marlin()
    for name in ("w13_g_idx_sort_indices", "w2_g_idx_sort_indices", "w13_g_idx", "w2_g_idx"):
        layer.register_parameter(name, torch.nn.Parameter(z(E, 0, dtype=torch.int32), requires_grad=False))
    b = bind(
        layer, {"quant_method": "awq", "bits": 4, "group_size": 128}, "AutoAWQMoEMethod", "MarlinExperts"
    )
    assert b.refusal.startswith("<layout>: MarlinExperts implies the expert stride"), b.refusal
    assert "g_idx" not in b.refusal
    kept = {t.name: t for t in b.binding.tensors if t.name.endswith("g_idx_sort_indices")}
    assert all(t.decision.value == "keep_whole" and t.expert_bytes == 0 for t in kept.values()), kept


def test_mxfp4_through_marlin_stays_refused_even_with_contiguous_groups():
    """INT4's contiguous groups (int4grp) are CPU-tested; MXFP4 via --moe-backend marlin has the same
    contiguous stride but was never checked, so it keeps vLLM's stock path with its reason."""
    layer = fake_layer(
        {
            "w13_weight": z(E, 2 * I, H // 2, dtype=torch.uint8),
            "w13_weight_scale": z(E, 2 * I, H // 32, dtype=torch.uint8),
            "w2_weight": z(E, H, I // 2, dtype=torch.uint8),
            "w2_weight_scale": z(E, H, I // 32, dtype=torch.uint8),
        }
    )
    b = bind(layer, {"quant_method": "mxfp4"}, "GptOssMxfp4MoEMethod", "MarlinExperts", contiguous_ok=True)
    assert b.layout is None and "MXFP4 through Marlin is not verified" in b.refusal, b.refusal
