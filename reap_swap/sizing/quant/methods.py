"""Which MoE method and kernel vLLM 0.26.0 runs for each quantized format on an H200 (SM90), and
how that kernel finds expert e in a weight tensor -- the fact the residency engine's layout rests on.

Read from vLLM 0.26.0's source (the wheel in the gpu-kit; oracles in
`model_executor/layers/fused_moe/oracle/{fp8,int_wna16,mxfp4}.py`), to be confirmed on the H200 by
`research/gpu/gpu_quant_survey.py`. Pure data; `stride_mode_for` is what the engine and the survey ask.
"""

from __future__ import annotations

from dataclasses import dataclass

from reap_swap.sizing.quant.layout import StrideMode


@dataclass(frozen=True)
class MethodKernel:
    method: str  # quant method class name (type(layer.quant_method).__name__)
    experts: str  # the FusedMoEExperts class the oracle picks on SM90
    kernel: str  # the kernel function that reads the expert weights
    stride_mode: StrideMode
    moe_backend: str  # the --moe-backend value that selects it ("auto": the default picks it)
    note: str


# vLLM 0.26.0 on SM90, TP=1, no EP. Keyed by (method class, experts class).
METHOD_KERNELS: tuple[MethodKernel, ...] = (
    MethodKernel(
        "UnquantizedFusedMoEMethod",
        "TritonExperts",
        "fused_moe_kernel (invoke_fused_moe_triton_kernel)",
        StrideMode.STRIDED,
        "triton",
        "bf16: B.stride(0) is passed to the kernel; what the engine does today",
    ),
    MethodKernel(
        "Fp8MoEMethod",
        "TritonExperts",
        "fused_moe_kernel with use_fp8_w8a8 (block_shape [128,128] or per-tensor)",
        StrideMode.STRIDED,
        "triton",
        "block FP8: the oracle puts TRITON first on SM90 for TP; weights unchanged by "
        "convert_to_fp8_moe_kernel_format; scales read at b_scale_ptr + e*stride_bse",
    ),
    MethodKernel(
        "Fp8PerTensorOnlineMoEMethod",
        "TritonExperts",
        "fused_moe_kernel with use_fp8_w8a8, per-tensor",
        StrideMode.STRIDED,
        "triton",
        "vLLM's online --quantization fp8 of a bf16 checkpoint: bf16 loaded, quantized per expert "
        "in process_weights_after_loading (scales [E]); the engine re-homes the fp8 result",
    ),
    MethodKernel(
        "CompressedTensorsW8A8Fp8MoEMethod",
        "TritonExperts",
        "fused_moe_kernel with use_fp8_w8a8 (per_act_token / per_out_ch for channel)",
        StrideMode.STRIDED,
        "triton",
        "CT FP8 tensor/channel/block; with --moe-backend triton the oracle takes TRITON",
    ),
    MethodKernel(
        "MoeWNA16Method",
        "(none: calls fused_experts directly)",
        "dispatch_fused_moe_kernel: ops.moe_wna16_gemm (CUDA) when tokens*top_k/E <= 6, else "
        "fused_moe_kernel_gptq_awq (Triton)",
        StrideMode.CONTIGUOUS,
        "n/a (--quantization moe_wna16)",
        "AWQ / GPTQ (desc_act off) with --quantization moe_wna16: uint8 [E, 2N, K/2], no repack. "
        "The Triton kernel takes B.stride(0), but the CUDA kernel that serves decode computes "
        "expert_offset = size_n * size_k * expert_id for weights, scales and zeros: contiguous",
    ),
    MethodKernel(
        "AutoAWQMoEMethod",
        "MarlinExperts",
        "fused_marlin_moe -> ops.moe_wna16_marlin_gemm",
        StrideMode.CONTIGUOUS,
        "auto or marlin (triton raises: not a WNA16 backend)",
        "awq_marlin_moe_repack to [E, K/16, 2N*bits/2] int32; the kernel asserts w.is_contiguous() "
        "and computes B_expert_off = expert_id * prob_n * prob_k / (pack_factor * 4)",
    ),
    MethodKernel(
        "AutoGPTQMoEMethod",
        "MarlinExperts",
        "fused_marlin_moe -> ops.moe_wna16_marlin_gemm",
        StrideMode.CONTIGUOUS,
        "auto or marlin (triton raises)",
        "gptq_marlin_moe_repack; g_idx / sort indices become [E, 0] without act-order",
    ),
    MethodKernel(
        "CompressedTensorsWNA16MarlinMoEMethod",
        "MarlinExperts",
        "fused_marlin_moe -> ops.moe_wna16_marlin_gemm",
        StrideMode.CONTIGUOUS,
        "auto or marlin (triton raises)",
        "pack-quantized int4; chosen whenever check_moe_marlin_supports_layer holds on CUDA",
    ),
    MethodKernel(
        "CompressedTensorsWNA16MoEMethod",
        "(fused_experts, int4_w4a16)",
        "ops.moe_wna16_gemm / fused_moe_kernel_gptq_awq, as MoeWNA16Method",
        StrideMode.CONTIGUOUS,
        "n/a (only when Marlin does not support the layer)",
        "not reached for Qwen3-30B-A3B shapes on CUDA; contiguous for the same reason as MoeWNA16Method",
    ),
    MethodKernel(
        "GptOssMxfp4MoEMethod",
        "OAITritonMxfp4ExpertsMonolithic",
        "triton_kernels matmul_ogs (routing inside, HopperMXValueLayout swizzle)",
        StrideMode.STRIDED,
        "triton",
        "GPT-OSS MXFP4 (GptOssMxfp4Config overrides mxfp4 for gpt_oss models): process_weights_after_loading deletes w13_weight/w2_weight and keeps "
        "triton_kernels Tensors plus PrecisionConfig scales on the method; monolithic routing. "
        "matmul_ogs reads each expert at base + e * storage stride (W += expt_id * stride_w_e), so "
        "the swizzled bases re-home as strided tensors (compat/mxfp4.py; behind REAPSWAP_MXFP4)",
    ),
    MethodKernel(
        "GptOssMxfp4MoEMethod",
        "MarlinExperts",
        "fused_marlin_moe (FE2M1f weights)",
        StrideMode.CONTIGUOUS,
        "marlin",
        "MXFP4 through Marlin: contiguous like INT4 Marlin (not measured)",
    ),
)


def lookup(method: str, experts: str | None = None) -> MethodKernel | None:
    for mk in METHOD_KERNELS:
        if mk.method == method and (experts is None or mk.experts == experts):
            return mk
    return None


def stride_mode_for(method: str, experts: str | None = None) -> StrideMode:
    """The stride mode of a (method, experts class) pair; unknown pairs are OPAQUE (refused)."""
    mk = lookup(method, experts)
    return mk.stride_mode if mk is not None else StrideMode.OPAQUE
