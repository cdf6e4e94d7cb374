"""INT4 W4A16 g128 in contiguous grouped units (issue 16, int4grp) through vLLM 0.26.0's own kernels.

The layout of reap_swap.contiguous_groups: each re-homed tensor in its own page-aligned VMM range,
experts back to back exactly as stock allocates them (stride = slab, no padding), groups of b
experts = whole 2 MiB pages (Qwen3-30B-A3B shape: b = 8, w13 12 MiB + w2 6 MiB per group), some
groups host-backed and some in HBM; weights in a plan-chosen physical order, scales / zero points
permuted in place, routing ids remapped logical -> physical before the unchanged kernel. Compared
bitwise with the stock call on the ordinary tensors and logical ids, at m = 1, 8, 64, 256 and at
0 / 25 / 50 / 100 % resident and back:
- Marlin (`fused_marlin_moe` -> ops.moe_wna16_marlin_gemm, `use_atomic_add=False`): GPTQ-style
  uint4b8 without zeros, and AWQ-style uint4 with zero points, Marlin-format tensors (random bits
  are valid packed int4: the kernel does not care how they were repacked);
- moe_wna16 (`fused_experts(..., int4_w4a16)`: ops.moe_wna16_gemm at m = 1, 8 (tokens*top_k/E <= 6),
  Triton fused_moe_kernel_gptq_awq at 64, 256). moe_wna16_gemm sums its K splits with bf16
  `atomicAdd` into the zeroed output (csrc/moe/moe_wna16.cu), so stock itself may differ run to
  run: the test first calls stock 5 times; if those differ the case is an xfail naming that (no
  layout can be bitwise to a nondeterministic stock), else it must be bitwise.
A negative control (physical weights read with logical ids) must differ.

E = 32, H = 2048, I = 768, top-8 (~1-2 min on the H200). Run:
    PYTHONPATH=/tmp/site:$PWD python3 -m pytest -q tests/gpu/test_int4_groups.py 2>&1 | tee LOGDIR/int4_groups.log
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("CUDA required", allow_module_level=True)

E, H, I, TOPK = 32, 2048, 768, 8


@pytest.fixture(scope="module")
def vk():
    fm = pytest.importorskip("vllm.model_executor.layers.fused_moe")
    cfg = pytest.importorskip("vllm.model_executor.layers.fused_moe.config")
    marlin = pytest.importorskip("vllm.model_executor.layers.fused_moe.experts.marlin_moe")
    st = pytest.importorskip("vllm.scalar_type")
    return SimpleNamespace(
        fused_experts=fm.fused_experts, fused_topk=fm.fused_topk, cfg=cfg,
        fused_marlin_moe=marlin.fused_marlin_moe, scalar_types=st.scalar_types,
    )  # fmt: skip


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _i32(shape, seed):
    return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, device="cuda", generator=_gen(seed))


def _scales(shape, seed):
    return (torch.rand(shape, device="cuda", generator=_gen(seed)) * 0.004 + 0.001).to(torch.bfloat16)


def make_int4(fmt: str) -> tuple[dict, tuple[str, str]]:
    """(tensors, re-homed names) in the layout vLLM 0.26.0 leaves after process_weights_after_loading."""
    if fmt == "moe_wna16":  # MoeWNA16Method: no repack, uint8 [E, N, K/2], scales [E, N, K/128]
        g = _gen(5)
        t = {
            "w13_qweight": torch.randint(
                0, 256, (E, 2 * I, H // 2), dtype=torch.uint8, device="cuda", generator=g
            ),
            "w2_qweight": torch.randint(
                0, 256, (E, H, I // 2), dtype=torch.uint8, device="cuda", generator=g
            ),
            "w13_scales": _scales((E, 2 * I, H // 128), 6),
            "w2_scales": _scales((E, H, I // 128), 7),
        }
        return t, ("w13_qweight", "w2_qweight")
    # Marlin (gptq_marlin_moe_repack / awq_marlin_moe_repack output): [E, K/16, 2N] int32
    t = {
        "w13_qweight": _i32((E, H // 16, 2 * 2 * I), 1),
        "w2_qweight": _i32((E, I // 16, 2 * H), 2),
        "w13_scales": _scales((E, H // 128, 2 * I), 3),
        "w2_scales": _scales((E, I // 128, H), 4),
    }
    if fmt == "awq-marlin":  # moe_awq_to_marlin_zero_points: [E, K/128, N/8] int32
        t.update(w13_qzeros=_i32((E, H // 128, 2 * I // 8), 8), w2_qzeros=_i32((E, I // 128, H // 8), 9))
    return t, ("w13_qweight", "w2_qweight")


def run(vk, fmt, t, x, tw, ti):
    if fmt == "moe_wna16":
        qc = vk.cfg.int4_w4a16_moe_quant_config(
            w1_scale=t.w13_scales, w2_scale=t.w2_scales, block_shape=[0, 128]
        )
        return vk.fused_experts(x, t.w13_qweight, t.w2_qweight, tw, ti, quant_config=qc)
    zp = fmt == "awq-marlin"
    qtype = vk.scalar_types.uint4 if zp else vk.scalar_types.uint4b8
    return vk.fused_marlin_moe(
        x, t.w13_qweight, t.w2_qweight, None, None, t.w13_scales, t.w2_scales, tw, ti, qtype.id,
        global_num_experts=E, w1_zeros=t.w13_qzeros if zp else None, w2_zeros=t.w2_qzeros if zp else None,
    )  # fmt: skip


def _routing(vk, m, seed):
    g = _gen(seed)
    x = torch.randn(m, H, device="cuda", generator=g).to(torch.bfloat16)
    tw, ti, _ = vk.fused_topk(x, torch.randn(m, E, device="cuda", generator=g), TOPK, renormalize=True)
    return x, tw, ti


def _grouped(fmt):
    from reap_swap.contiguous_groups import contiguous_group_size, plan_contiguous_groups
    from reap_swap.group_layout import Permutation, physical_order
    from reap_swap.residency.grouped import standalone_grouped

    tensors, names = make_int4(fmt)
    stock = SimpleNamespace(**{n: t.clone() for n, t in tensors.items()})
    weights = {n: tensors[n] for n in names}
    kept = {n: t for n, t in tensors.items() if n not in names}
    slabs = [(n, t[0].numel() * t.element_size()) for n, t in weights.items()]
    b, _ = contiguous_group_size(slabs, E)
    layout = plan_contiguous_groups(slabs, E, b)
    ids = list(range(E))
    random.Random(3).shuffle(ids)
    core, slices = ids[:8], [ids[8:16], ids[16:24]]
    perm = Permutation.from_order(physical_order(E, core, slices))
    st = standalone_grouped({0: weights}, {0: kept}, {0: perm}, {0: layout}, layout.num_groups)
    entry = st.layers[0]
    return st, entry, stock, SimpleNamespace(**entry.views, **kept), core


def _stock_is_deterministic(vk, fmt, stock, xi, tries=5) -> bool:
    first = run(vk, fmt, stock, *xi)
    return all(torch.equal(run(vk, fmt, stock, *xi), first) for _ in range(tries - 1))


@pytest.mark.parametrize("fmt", ["gptq-marlin", "awq-marlin", "moe_wna16"])
def test_int4_contiguous_groups_serve_bitwise_across_swaps(vk, fmt):
    from reap_swap.residency.grouped import apply_logical, release, remap_ids

    st, entry, stock, served, core = _grouped(fmt)
    try:
        lay, perm = entry.layout, entry.perm
        assert lay.group_size == 8 and lay.strides == lay.slab_bytes and lay.padding_overhead == 0
        for name, view in entry.views.items():
            assert view.is_contiguous() and view.data_ptr() % (2 * 2**20) == 0  # stock-like, page-aligned
            assert view.data_ptr() == entry.ranges[name].unit_address(0)
        inputs = {m: _routing(vk, m, seed=m) for m in (1, 8, 64, 256)}
        nondet = [m for m, xi in inputs.items() if not _stock_is_deterministic(vk, fmt, stock, xi)]
        refs = {m: run(vk, fmt, stock, *xi) for m, xi in inputs.items()}
        x, tw, ti = inputs[64]
        assert not torch.equal(run(vk, fmt, served, x, tw, ti), refs[64])  # negative control: no remap
        half = sorted(random.Random(1).sample(range(E), E // 2))
        mismatches = []
        for resident in ([], core, half, list(range(E)), core, []):
            out = apply_logical(st, {0: resident})
            groups = {perm.to_physical[e] // lay.group_size for e in resident}
            assert st.table.resident().get(0, frozenset()) == groups
            assert out["bytes_copied"] == out["admitted_groups"] * lay.group_payload_bytes
            for m, (x, tw, ti) in inputs.items():
                if not torch.equal(run(vk, fmt, served, x, tw, remap_ids(entry, ti)), refs[m]):
                    mismatches.append((len(resident), m))
        det = [(r, m) for r, m in mismatches if m not in nondet]
        assert not det, f"{fmt}: not bitwise where stock is deterministic (resident, m): {det}"
        if mismatches:
            pytest.xfail(
                f"{fmt}: stock itself is nondeterministic at m = {nondet} (bf16 atomicAdd): {mismatches}"
            )
    finally:
        release(st)


def test_marlin_cuda_graph_with_the_remap_replays_across_swaps(vk):
    from reap_swap.residency.grouped import apply_logical, release, remap_ids

    fmt = "awq-marlin"
    st, entry, stock, served, core = _grouped(fmt)
    try:
        x, tw, ti = _routing(vk, 4, seed=7)
        ref = run(vk, fmt, stock, x, tw, ti)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run(vk, fmt, served, x, tw, remap_ids(entry, ti))
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run(vk, fmt, served, x, tw, remap_ids(entry, ti))
        for resident in ([], sorted(set(ti.flatten().tolist())), list(range(E)), core, []):
            apply_logical(st, {0: resident})
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, ref), sorted(resident)
    finally:
        release(st)
