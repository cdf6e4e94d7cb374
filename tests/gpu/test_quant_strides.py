"""The binding rules against vLLM 0.26.0's own quantized MoE kernels, without the engine.

For each format the weights are copied into a larger buffer at the expert strides a layout would
give them (quant_padding.group_stride: b = 1 private padded units, b = 2 co-resident pairs) while
the scales stay the original whole tensors, and `fused_experts` must be bitwise equal to the same
call on ordinary contiguous weights. That is what re-homing relies on: the kernel reads expert e at
`base + e * stride(0)`, and kept-whole scales stay bound to expert e. The INT4 (moe_wna16) case
checks the opposite too: its decode kernel (ops.moe_wna16_gemm) implies the stride, so a padded
stride must *not* give the stock result -- the reason quant_methods marks it contiguous.

Qwen3-30B-A3B layer shape (E=128, H=2048, I=768, top-8). Run on the H200:
    PYTHONPATH=/tmp/site:$PWD python3 -m pytest -q tests/gpu/test_quant_strides.py
"""

from __future__ import annotations

import pytest

from reap_swap.sizing.quant.padding import group_stride

torch = pytest.importorskip("torch")

E, H, I, TOPK = 128, 2048, 768, 8


@pytest.fixture(scope="module")
def vllm_moe():
    fm = pytest.importorskip("vllm.model_executor.layers.fused_moe")
    cfg = pytest.importorskip("vllm.model_executor.layers.fused_moe.config")
    return fm.fused_experts, fm.fused_topk, cfg


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _fp8(shape, seed):
    w = torch.randn(*shape, device="cuda", generator=_gen(seed)) * 64
    return w.clamp(-448, 448).to(torch.float8_e4m3fn)


def _scales(shape, seed, dtype=torch.float32):
    return (torch.rand(*shape, device="cuda", generator=_gen(seed)) * 0.004 + 0.001).to(dtype)


def restride(w: torch.Tensor, stride_bytes: int, offset_bytes: int = 0) -> torch.Tensor:
    """w copied into a fresh zeroed buffer with expert stride `stride_bytes` (rows row-major)."""
    elem = w.element_size()
    assert stride_bytes % elem == 0 and stride_bytes >= w[0].numel() * elem
    buf = torch.zeros(offset_bytes + w.shape[0] * stride_bytes, dtype=torch.uint8, device="cuda")
    flat = buf[offset_bytes:].view(w.dtype)
    out = flat.as_strided(tuple(w.shape), (stride_bytes // elem, *w.stride()[1:]))
    out.copy_(w)
    return out


def _routing(fused_topk, m, seed):
    g = _gen(seed)
    x = torch.randn(m, H, device="cuda", generator=g).to(torch.bfloat16)
    logits = torch.randn(m, E, device="cuda", generator=g)
    tw, ti, _ = fused_topk(x, logits, TOPK, renormalize=True)
    return x, tw, ti


def _fp8_case(cfg, kind):
    w13, w2 = _fp8((E, 2 * I, H), 1), _fp8((E, H, I), 2)
    if kind == "block":
        s13, s2 = _scales((E, 2 * I // 128, H // 128), 3), _scales((E, H // 128, I // 128), 4)
        qc = cfg.fp8_w8a8_moe_quant_config(w1_scale=s13, w2_scale=s2, block_shape=[128, 128])
    elif kind == "channel":
        s13, s2 = _scales((E, 2 * I, 1), 3), _scales((E, H, 1), 4)
        qc = cfg.fp8_w8a8_moe_quant_config(
            w1_scale=s13, w2_scale=s2, per_act_token_quant=True, per_out_ch_quant=True
        )
    else:
        s13, s2 = _scales((E,), 3), _scales((E,), 4)
        qc = cfg.fp8_w8a8_moe_quant_config(w1_scale=s13, w2_scale=s2)
    return w13, w2, qc


@pytest.mark.parametrize("b", [1, 2])
@pytest.mark.parametrize("kind", ["block", "channel", "tensor"])
@pytest.mark.parametrize("m", [1, 8, 64])
def test_fp8_strided_weights_with_whole_scales_are_bitwise_stock(vllm_moe, kind, b, m):
    fused_experts, fused_topk, cfg = vllm_moe
    w13, w2, qc = _fp8_case(cfg, kind)
    s13 = int(group_stride(w13[0].numel(), b))  # b=1: 4 MiB; b=2: 3 MiB (contiguous)
    s2 = int(group_stride(w2[0].numel(), b))  # 2 MiB in both
    v13, v2 = restride(w13, s13), restride(w2, s2)
    x, tw, ti = _routing(fused_topk, m, seed=m)
    ref = fused_experts(x, w13, w2, tw, ti, quant_config=qc)
    out = fused_experts(x, v13, v2, tw, ti, quant_config=qc)
    assert torch.equal(ref, out)


def _int4_case(cfg):
    g = _gen(5)
    w13 = torch.randint(0, 256, (E, 2 * I, H // 2), dtype=torch.uint8, device="cuda", generator=g)
    w2 = torch.randint(0, 256, (E, H, I // 2), dtype=torch.uint8, device="cuda", generator=g)
    s13 = _scales((E, 2 * I, H // 128), 6, torch.bfloat16)
    s2 = _scales((E, H, I // 128), 7, torch.bfloat16)
    qc = cfg.int4_w4a16_moe_quant_config(w1_scale=s13, w2_scale=s2, block_shape=[0, 128])
    return w13, w2, qc


# Measured on the H200 (2026-12-01, vLLM 0.26.0, research.md run 8): at decode sizes the CUDA
# ops.moe_wna16_gemm gives close but not bitwise-equal outputs when the same weights start at an
# unaligned offset (its result depends on the base address); the Triton path (m=256) is bitwise.
# So an INT4 group layout starting mid-page is not "identical to stock": kept strict, so a vLLM
# that fixes it (or a wrong test) shows up.
_UNALIGNED_NOT_BITWISE = pytest.mark.xfail(
    strict=True, reason="moe_wna16_gemm (decode) is address-dependent: not bitwise at an unaligned offset"
)


@pytest.mark.parametrize(
    "m", [pytest.param(1, marks=_UNALIGNED_NOT_BITWISE), pytest.param(8, marks=_UNALIGNED_NOT_BITWISE), 256]
)
def test_int4_contiguous_at_an_unaligned_offset_is_bitwise_stock(vllm_moe, m):
    """The contiguous layout: stride = payload, the tensor starting mid-page (as a group does)."""
    fused_experts, fused_topk, cfg = vllm_moe
    w13, w2, qc = _int4_case(cfg)
    v13 = restride(w13, w13[0].numel(), offset_bytes=2**20)
    v2 = restride(w2, w2[0].numel(), offset_bytes=3 * 2**19)
    x, tw, ti = _routing(fused_topk, m, seed=m)
    assert torch.equal(
        fused_experts(x, w13, w2, tw, ti, quant_config=qc), fused_experts(x, v13, v2, tw, ti, quant_config=qc)
    )


def test_int4_padded_stride_is_misread_at_decode(vllm_moe):
    """ops.moe_wna16_gemm (tokens*top_k/E <= 6) ignores stride(0): a padded stride reads the wrong
    bytes. If this ever passes as equal, quant_methods' CONTIGUOUS for MoeWNA16Method is stale."""
    fused_experts, fused_topk, cfg = vllm_moe
    w13, w2, qc = _int4_case(cfg)
    v13, v2 = restride(w13, 2 * 2**20), restride(w2, 2**20)  # 1.5 -> 2 MiB, 0.75 -> 1 MiB
    x, tw, ti = _routing(fused_topk, 1, seed=1)
    ref = fused_experts(x, w13, w2, tw, ti, quant_config=qc)
    out = fused_experts(x, v13, v2, tw, ti, quant_config=qc)
    assert not torch.equal(ref, out)


@pytest.mark.parametrize("m", [256])
def test_int4_padded_stride_is_read_right_by_the_triton_path(vllm_moe, m):
    """Above the CUDA kernel's threshold the Triton wna16 kernel takes stride(0) and is exact."""
    fused_experts, fused_topk, cfg = vllm_moe
    w13, w2, qc = _int4_case(cfg)
    v13, v2 = restride(w13, 2 * 2**20), restride(w2, 2**20)
    x, tw, ti = _routing(fused_topk, m, seed=m)
    assert torch.equal(
        fused_experts(x, w13, w2, tw, ti, quant_config=qc), fused_experts(x, v13, v2, tw, ti, quant_config=qc)
    )
