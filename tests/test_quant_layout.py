"""Binding decisions on synthetic MoE layers of every format, shaped as vLLM 0.26.0's MoE methods
register them after process_weights_after_loading (Qwen3-30B-A3B: E=128, H=2048, I=768)."""

from __future__ import annotations

import pytest

from reap_swap.sizing.quant.layout import (
    Decision,
    LayerSpec,
    ParamSpec,
    StrideMode,
    bind_layer,
    layer_spec_from_dict,
    role_of,
)
from reap_swap.sizing.quant.methods import stride_mode_for
from reap_swap.sizing.quant.padding import (
    GRANULE,
    MiB,
    group_bytes_per_expert,
    per_expert_bytes,
    private_bytes,
    qwen3_30b_formats,
    random_set_bytes,
    smallest_group,
    straddle_random_bytes,
    table_markdown,
)
from reap_swap.sizing.quant.scheme import scheme_from_config

E, H, N = 128, 2048, 768
P = "model.layers.0.mlp.experts.routed_experts."

FP8_BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
FP8_TENSOR = {"quant_method": "fp8", "activation_scheme": "static"}
CT_FP8_CHANNEL = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
        }
    },
}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
CT_W4A16 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "int",
                "strategy": "group",
                "group_size": 128,
                "symmetric": True,
            },
        }
    },
}
MXFP4 = {"quant_method": "mxfp4"}


def p(name, shape, elem, strides=None):
    return ParamSpec(P + name, tuple(shape), elem, strides=strides)


def layer(params, cfg, method, mode=StrideMode.STRIDED):
    return LayerSpec(tuple(params), E, H, N, cfg, method, mode)


def bf16_layer():
    return layer(
        [p("w13_weight", (E, 2 * N, H), 2), p("w2_weight", (E, H, N), 2)], {}, "UnquantizedFusedMoEMethod"
    )


def fp8_block_layer():
    return layer(
        [
            p("w13_weight", (E, 2 * N, H), 1),
            p("w2_weight", (E, H, N), 1),
            p("w13_weight_scale_inv", (E, 2 * N // 128, H // 128), 4),
            p("w2_weight_scale_inv", (E, H // 128, N // 128), 4),
        ],
        FP8_BLOCK,
        "Fp8MoEMethod",
    )


def fp8_channel_layer():
    return layer(
        [
            p("w13_weight", (E, 2 * N, H), 1),
            p("w2_weight", (E, H, N), 1),
            p("w13_weight_scale", (E, 2 * N, 1), 4),
            p("w2_weight_scale", (E, H, 1), 4),
        ],
        CT_FP8_CHANNEL,
        "CompressedTensorsW8A8Fp8MoEMethod",
    )


def fp8_tensor_layer():
    return layer(
        [
            p("w13_weight", (E, 2 * N, H), 1),
            p("w2_weight", (E, H, N), 1),
            p("w13_weight_scale", (E,), 4),  # max of the w1/w3 scales after loading
            p("w2_weight_scale", (E,), 4),
            p("w13_input_scale", (), 4),  # one scalar after process_fp8_input_tensor_strategy_moe
            p("w2_input_scale", (), 4),
        ],
        FP8_TENSOR,
        "Fp8MoEMethod",
    )


def marlin_int4_layer(cfg, method, names):
    """After {awq,gptq}_marlin_moe_repack: qweight [E, K/16, 2*N_out] int32 (4 bits/weight)."""
    qw, sc, zp = names
    params = [
        p(f"w13_{qw}", (E, H // 16, 2 * 2 * N), 4),
        p(f"w2_{qw}", (E, N // 16, 2 * H), 4),
        p(f"w13_{sc}", (E, H // 128, 2 * N), 2),
        p(f"w2_{sc}", (E, N // 128, H), 2),
        p("w13_g_idx", (E, 0), 4),
        p("w2_g_idx", (E, 0), 4),
        p("w13_g_idx_sort_indices", (E, 0), 4),
        p("w2_g_idx_sort_indices", (E, 0), 4),
    ]
    if zp:
        params += [p(f"w13_{zp}", (E, H // 128, 2 * N // 8), 4), p(f"w2_{zp}", (E, N // 128, H // 8), 4)]
    return layer(params, cfg, method, StrideMode.CONTIGUOUS)


def wna16_triton_layer():
    """MoeWNA16Method (--quantization moe_wna16): uint8 [E, 2N, K/2], scales [E, 2N, K/g]; its decode
    kernel (ops.moe_wna16_gemm) implies the expert stride, so it binds contiguously."""
    return layer(
        [
            p("w13_qweight", (E, 2 * N, H // 2), 1),
            p("w2_qweight", (E, H, N // 2), 1),
            p("w13_scales", (E, 2 * N, H // 128), 2),
            p("w2_scales", (E, H, N // 128), 2),
            p("w13_qzeros", (E, 2 * N // 2, H // 128), 1),
            p("w2_qzeros", (E, H // 2, N // 128), 1),
        ],
        AWQ,
        "MoeWNA16Method",
        StrideMode.CONTIGUOUS,
    )


def mxfp4_layer():
    return layer(
        [
            p("w13_weight", (E, 2 * N, H // 2), 1),
            p("w2_weight", (E, H, N // 2), 1),
            p("w13_weight_scale", (E, 2 * N, H // 32), 1),
            p("w2_weight_scale", (E, H, N // 32), 1),
            p("w13_bias", (E, 2 * N), 2),
            p("w2_bias", (E, H), 2),
        ],
        MXFP4,
        "GptOssMxfp4MoEMethod",
        StrideMode.CONTIGUOUS,
    )


def short(names):
    return sorted(n.rsplit(".", 1)[-1] for n in names)


@pytest.mark.parametrize(
    "spec, rehome, keep",
    [
        (bf16_layer(), ["w13_weight", "w2_weight"], []),
        (fp8_block_layer(), ["w13_weight", "w2_weight"], ["w13_weight_scale_inv", "w2_weight_scale_inv"]),
        (fp8_channel_layer(), ["w13_weight", "w2_weight"], ["w13_weight_scale", "w2_weight_scale"]),
        (
            fp8_tensor_layer(),
            ["w13_weight", "w2_weight"],
            ["w13_input_scale", "w13_weight_scale", "w2_input_scale", "w2_weight_scale"],
        ),
        (
            wna16_triton_layer(),
            ["w13_qweight", "w2_qweight"],
            ["w13_qzeros", "w13_scales", "w2_qzeros", "w2_scales"],
        ),
        (
            mxfp4_layer(),
            ["w13_weight", "w2_weight"],
            ["w13_bias", "w13_weight_scale", "w2_bias", "w2_weight_scale"],
        ),
    ],
)
def test_weights_rehomed_small_tensors_kept_whole(spec, rehome, keep):
    b = bind_layer(spec)
    assert b.ok, b.refusal
    assert short(b.names(Decision.REHOME)) == sorted(rehome)
    assert short(b.names(Decision.KEEP_WHOLE)) == sorted(keep)


@pytest.mark.parametrize(
    "cfg, method, names",
    [
        (AWQ, "AutoAWQMoEMethod", ("qweight", "scales", "qzeros")),
        (GPTQ, "AutoGPTQMoEMethod", ("qweight", "scales", None)),
        (CT_W4A16, "CompressedTensorsWNA16MarlinMoEMethod", ("weight_packed", "weight_scale", None)),
    ],
)
def test_marlin_int4_rehomed_contiguously(cfg, method, names):
    b = bind_layer(marlin_int4_layer(cfg, method, names))
    assert b.ok, b.refusal
    assert short(b.names(Decision.REHOME)) == sorted([f"w13_{names[0]}", f"w2_{names[0]}"])
    assert all("contiguously" in t.reason for t in b.tensors if t.decision is Decision.REHOME)
    kept = short(b.names(Decision.KEEP_WHOLE))
    assert f"w13_{names[1]}" in kept and "w13_g_idx" in kept and "w2_g_idx_sort_indices" in kept
    # 4 bits per weight survives the repack: 1.5 MiB of w13 per expert
    assert b.rehomed_expert_bytes == (2 * N * H + H * N) // 2


def test_rehomed_bytes_and_kept_bytes_fp8_block():
    b = bind_layer(fp8_block_layer())
    assert b.rehomed_expert_bytes == 3 * 2**20 + 3 * 2**19  # 4.5 MiB
    assert b.kept_bytes(E) == E * 4 * (12 * 16 + 16 * 6)


def test_refuses_scale_whose_shape_disagrees_with_block_config():
    spec = fp8_block_layer()
    bad = p("w13_weight_scale_inv", (E, 2 * N // 64, H // 64), 4)  # 64x64 blocks, config says 128
    spec = layer([*spec.params[:2], bad, spec.params[3]], FP8_BLOCK, "Fp8MoEMethod")
    b = bind_layer(spec)
    assert not b.ok
    assert list(b.refusals) == [P + "w13_weight_scale_inv"]
    assert "fp8/block config implies 96 or 192" in b.refusal


def test_refuses_packed_weight_with_wrong_pack_factor():
    spec = wna16_triton_layer()
    bad = p("w13_qweight", (E, 2 * N, H), 1)  # 8 bits per weight, config says 4
    b = bind_layer(layer([bad, *spec.params[1:]], AWQ, "MoeWNA16Method"))
    assert list(b.refusals) == [P + "w13_qweight"]


def test_refuses_weight_whose_leading_dim_is_not_num_experts():
    b = bind_layer(layer([p("w13_weight", (2 * N, E, H), 2), p("w2_weight", (E, H, N), 2)], {}, "X"))
    assert list(b.refusals) == [P + "w13_weight"]
    assert "leading dim 1536 is not num_experts 128 (expert dim at dim 1)" in b.refusal


def test_refuses_transposed_inner_layout():
    w13 = p("w13_weight", (E, 2 * N, H), 2, strides=(2 * N * H, 1, 2 * N))  # column-major rows
    b = bind_layer(layer([w13, p("w2_weight", (E, H, N), 2)], {}, "UnquantizedFusedMoEMethod"))
    assert list(b.refusals) == [P + "w13_weight"]
    assert "not row-major" in b.refusal


def test_refuses_expert_stride_not_multiple_of_16_bytes():
    w2 = p("w2_weight", (E, H, N), 2, strides=(H * N + 4, N, 1))  # 8 bytes of padding per expert
    b = bind_layer(layer([p("w13_weight", (E, 2 * N, H), 2), w2], {}, "UnquantizedFusedMoEMethod"))
    assert list(b.refusals) == [P + "w2_weight"]
    assert "not a multiple of 16" in b.refusal


def test_padded_expert_stride_is_accepted_for_strided_kernels():
    w2 = p("w2_weight", (E, H, N), 2, strides=(2 * 2**20, N, 1))  # today's engine: 4 MiB slot
    b = bind_layer(layer([p("w13_weight", (E, 2 * N, H), 2), w2], {}, "UnquantizedFusedMoEMethod"))
    assert b.ok, b.refusal


def test_opaque_kernel_refuses_every_weight_by_name():
    spec = mxfp4_layer()
    b = bind_layer(layer(spec.params, MXFP4, "GptOssMxfp4MoEMethod", StrideMode.OPAQUE))
    assert sorted(b.refusals) == [P + "w13_weight", P + "w2_weight"]
    assert "does not read this parameter by expert stride" in b.refusal


def test_unknown_large_per_expert_tensor_is_refused_small_one_kept():
    big = p("w13_mystery", (E, 1024, 1024), 1)
    small = p("w13_tiny_thing", (E, 4), 4)
    b = bind_layer(layer([*bf16_layer().params, big, small], {}, "UnquantizedFusedMoEMethod"))
    assert list(b.refusals) == [P + "w13_mystery"]
    assert P + "w13_tiny_thing" in b.names(Decision.KEEP_WHOLE)


def test_unknown_quant_method_is_refused():
    b = bind_layer(layer(bf16_layer().params, {"quant_method": "bitsandbytes"}, "X"))
    assert "<quant_config>" in b.refusals


def test_layer_without_weights_is_refused():
    b = bind_layer(layer([p("w13_weight_scale", (E,), 4)], FP8_TENSOR, "Fp8MoEMethod"))
    assert b.refusals == {"<layer>": "no per-expert weight to re-home"}


def test_roles_and_schemes():
    assert role_of(P + "w13_weight_scale_inv") == "scale"
    assert role_of(P + "w2_weight_packed") == "weight"
    assert role_of(P + "w13_weight_g_idx") == "g_idx"
    assert role_of(P + "w13_g_idx_sort_indices") == "g_idx"
    assert role_of(P + "w2_weight_zero_point") == "zero"
    assert role_of(P + "w13_weight_shape") == "shape"
    assert role_of("gate.weight") == "unknown"
    assert scheme_from_config(FP8_BLOCK).block == (128, 128)
    assert scheme_from_config(CT_W4A16).group_size == 128
    assert scheme_from_config(CT_FP8_CHANNEL).strategy == "channel"
    assert scheme_from_config(None).bits == 16


def test_stride_modes_of_the_vllm_026_methods():
    assert stride_mode_for("Fp8MoEMethod") is StrideMode.STRIDED
    assert stride_mode_for("AutoAWQMoEMethod", "MarlinExperts") is StrideMode.CONTIGUOUS
    # matmul_ogs takes the swizzled base's expert stride (compat/mxfp4.py)
    assert stride_mode_for("GptOssMxfp4MoEMethod", "OAITritonMxfp4ExpertsMonolithic") is StrideMode.STRIDED
    assert stride_mode_for("SomethingNew") is StrideMode.OPAQUE
    # moe_wna16's CUDA decode kernel computes expert_offset = size_n * size_k * expert_id
    assert stride_mode_for("MoeWNA16Method") is StrideMode.CONTIGUOUS


def test_layer_spec_round_trip_from_survey_json():
    d = {
        "num_experts": E,
        "hidden_size": H,
        "intermediate_size": N,
        "quant_config": FP8_BLOCK,
        "method": "Fp8MoEMethod",
        "stride_mode": "strided",
        "params": [
            {"name": q.name, "shape": list(q.shape), "elem_bytes": q.elem_bytes, "strides": None}
            for q in fp8_block_layer().params
        ],
    }
    assert bind_layer(layer_spec_from_dict(d)).as_dict() == bind_layer(fp8_block_layer()).as_dict()


# -- padding ----------------------------------------------------------------------------------
def fmt(name):
    return next(f for f in qwen3_30b_formats() if f.name.startswith(name))


def test_today_padding_matches_the_issue():
    assert private_bytes(fmt("bf16")) == 10 * MiB  # 9 -> 10 MiB, 11 %
    assert private_bytes(fmt("FP8 block")) == 6 * MiB  # 4.5 -> 6 MiB, 33 %
    assert private_bytes(fmt("INT4 g128")) == 4 * MiB  # 2.25 -> 4 MiB, 78 %, if a kernel took a stride
    assert per_expert_bytes(fmt("INT4 g128")) == 5.5 * MiB  # contiguous: a lone expert's pages
    assert per_expert_bytes(fmt("FP8 block")) == 6 * MiB


def test_group_layouts_bring_every_format_under_12_percent():
    for f in qwen3_30b_formats():
        b = smallest_group(f)
        assert b in (1, 2, 4), f.name
        assert float(group_bytes_per_expert(f, b)) <= f.ideal * 1.12, f.name
    assert smallest_group(fmt("FP8 block")) == 2
    assert group_bytes_per_expert(fmt("FP8 block"), 2) == 5 * MiB  # w13 stride 3 MiB, w2 2 MiB
    assert smallest_group(fmt("INT4 g128 AWQ")) == 4
    assert group_bytes_per_expert(fmt("INT4 g128 AWQ"), 4) == MiB * 5 // 2
    assert group_bytes_per_expert(fmt("FP8 block"), 4) == fmt("FP8 block").ideal  # exact, 0 %


def test_groups_of_scattered_experts_cost_more_than_private_units():
    f = fmt("FP8 block")
    assert random_set_bytes(f, 1, 0.5) == pytest.approx(private_bytes(f))
    assert random_set_bytes(f, 2, 0.5) == pytest.approx(7.5 * MiB)  # > 6 MiB private
    assert random_set_bytes(f, 2, 1.0) == pytest.approx(5 * MiB)


def test_straddle_costs_between_ideal_and_two_pages_per_isolated_expert():
    f = fmt("FP8 block")
    assert straddle_random_bytes(f, 1.0) == pytest.approx(f.ideal)
    assert f.ideal < straddle_random_bytes(f, 0.5) < private_bytes(f)
    assert straddle_random_bytes(f, 0.01) <= 2 * GRANULE * 2  # w13 and w2: at most 2 pages each


def test_table_has_every_format():
    md = table_markdown()
    assert md.count("\n") == len(qwen3_30b_formats()) + 1
    assert "| FP8 block 128x128 (Triton) | 4.50 |" in md


def test_contiguous_kernel_refuses_a_padded_expert_stride():
    """Marlin / moe_wna16_gemm compute expert e's address from the shape: a padded stride (the
    private-unit layout) would be misread, so it is refused -- for weights and scales alike."""
    spec = marlin_int4_layer(AWQ, "AutoAWQMoEMethod", ("qweight", "scales", "qzeros"))
    qw = spec.params[0]
    padded = ParamSpec(qw.name, qw.shape, 4, strides=(2 * 2**20 // 4, qw.shape[2], 1))  # 2 MiB slot
    b = bind_layer(
        LayerSpec((padded, *spec.params[1:]), E, H, N, AWQ, "AutoAWQMoEMethod", StrideMode.CONTIGUOUS)
    )
    assert list(b.refusals) == [P + "w13_qweight"]
    assert "would read the wrong rows" in b.refusal
    same = ParamSpec(qw.name, qw.shape, 4, strides=qw.row_major_strides)
    assert bind_layer(
        LayerSpec((same, *spec.params[1:]), E, H, N, AWQ, "AutoAWQMoEMethod", StrideMode.CONTIGUOUS)
    ).ok
