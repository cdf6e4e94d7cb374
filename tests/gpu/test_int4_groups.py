"""INT4 W4A16 g128 in contiguous grouped units (issue 16: int4grp, then int4perm) through vLLM 0.26.0's
own kernels.

The layout of reap_swap.sizing.contiguous_groups: each re-homed tensor in its own page-aligned VMM range,
experts back to back exactly as stock allocates them (stride = slab, no padding), groups of b
experts = whole 2 MiB pages (Qwen3-30B-A3B shape: b = 8, w13 12 MiB + w2 6 MiB per group), some
groups host-backed and some in HBM.

Run 12 (H200, 2026-12-01): with the experts in a plan-chosen *physical order* (ids remapped logical
-> physical) gptq-/awq-marlin were NOT bitwise at m = 8, 64 in every residency state. The reading
(research.md int4perm): Marlin splits the concatenated (moe block, n tile, k tile) iterations
evenly over the SMs (csrc/moe/marlin_moe_wna16/marlin_template.h: `iters = div_ceil(k_tiles *
n_tiles * parallel, gridDim.x)`), so where an expert's K sum is cut between thread blocks depends on
the position of its blocks, which moe_align_block_size orders by expert id. This file therefore:
1. `test_marlin_bits_depend_on_expert_order_not_on_layout`: no reap-swap code at all -- stock
   tensors permuted with index_select, ids remapped. An *order-preserving* relabelling of the used
   experts must be bitwise (same block positions), an arbitrary one is expected to differ on
   Marlin at some m (it reproduces run 12 without the VMM); on moe_wna16's Triton path (m = 64,
   256: one program per (block, n tile), whole K) any order must be bitwise.
2. `test_int4_identity_groups_serve_bitwise_across_swaps`: the identity-order variant, what the
   engine binds INT4 in under --reap-group-size auto|2|4|8 (the default since the server e2e of
   run 16 served it identical to stock; this test passed in run 14): groups of consecutive ids,
   identity order, so the kernel sees stock's ids; must be bitwise to stock at m = 1, 8, 64, 256
   and 0 / 25 / 50 / 100 % resident and back, wherever stock is deterministic (moe_wna16_gemm, its CUDA kernel at m <= 8, sums K splits
   with bf16 atomicAdd: stock is first called 5 times; a nondeterministic m is an xfail naming it).
3. The CUDA graph captured with the (identity) remap replays across swaps.

E = 32, H = 2048, I = 768, top-8 (~2-3 min on the H200). Run:
    PYTHONPATH=/tmp/site:$PWD python3 -m pytest -q -rs tests/gpu/test_int4_groups.py 2>&1 | tee LOGDIR/int4_groups.log
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


def _routing(vk, m, seed, used=None):
    """x, topk weights, topk ids; `used`: route only among these experts (the rest get -inf-ish)."""
    g = _gen(seed)
    x = torch.randn(m, H, device="cuda", generator=g).to(torch.bfloat16)
    logits = torch.randn(m, E, device="cuda", generator=g)
    if used is not None:
        mask = torch.full((E,), -1e4, device="cuda")
        mask[list(used)] = 0.0
        logits = logits + mask
    tw, ti, _ = vk.fused_topk(x, logits, TOPK, renormalize=True)
    return x, tw, ti


def _grouped(fmt, order="identity"):
    """The grouped layer; order "identity" (the int4perm variant) or "plan" (run 12's permuted one)."""
    from reap_swap.engine.residency.grouped import standalone_grouped
    from reap_swap.sizing.contiguous_groups import contiguous_group_size, plan_contiguous_groups
    from reap_swap.sizing.groups import Permutation, physical_order

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
    if order == "identity":
        perm = Permutation.identity(E)
    else:
        perm = Permutation.from_order(physical_order(E, core, slices))
    st = standalone_grouped({0: weights}, {0: kept}, {0: perm}, {0: layout}, layout.num_groups)
    entry = st.layers[0]
    return st, entry, stock, SimpleNamespace(**entry.views, **kept), core


def _stock_is_deterministic(vk, fmt, stock, xi, tries=5) -> bool:
    first = run(vk, fmt, stock, *xi)
    return all(torch.equal(run(vk, fmt, stock, *xi), first) for _ in range(tries - 1))


def _permuted(stock, to_logical):
    """Stock's tensors with physical row p = logical expert to_logical[p] (plain index_select)."""
    index = torch.tensor(to_logical, dtype=torch.long, device="cuda")
    return SimpleNamespace(**{n: t.index_select(0, index).contiguous() for n, t in vars(stock).items()})


def _order_preserving(ti, seed):
    """A relabelling that keeps the used experts' relative order (same moe blocks, same positions)."""
    rng = random.Random(seed)
    used = sorted(set(ti.flatten().tolist()))
    spots = sorted(rng.sample(range(E), len(used)))
    rest = [p for p in range(E) if p not in spots]
    rng.shuffle(rest)
    to_physical = [0] * E
    unused = [e for e in range(E) if e not in used]
    for e, p in zip(used + unused, spots + rest, strict=True):
        to_physical[e] = p
    to_logical = [0] * E
    for e, p in enumerate(to_physical):
        to_logical[p] = e
    return to_physical, to_logical


def _relabel(ti, to_physical):
    m = torch.tensor(to_physical, dtype=ti.dtype, device=ti.device)
    return m[ti.long()]


@pytest.mark.parametrize("fmt", ["gptq-marlin", "awq-marlin", "moe_wna16"])
def test_marlin_bits_depend_on_expert_order_not_on_layout(vk, fmt):
    tensors, _ = make_int4(fmt)
    stock = SimpleNamespace(**tensors)
    arbitrary = list(range(E))
    random.Random(11).shuffle(arbitrary)  # to_logical of an arbitrary physical order
    arb_phys = [arbitrary.index(e) for e in range(E)]
    arb = _permuted(stock, arbitrary)
    same_order, other_order, nondet = [], [], []
    for m in (1, 8, 64, 256):
        # 12 of 32 experts used, so an order-preserving relabelling really moves ids (not identity)
        x, tw, ti = _routing(vk, m, seed=m, used=random.Random(m).sample(range(E), 12))
        if not _stock_is_deterministic(vk, fmt, stock, (x, tw, ti)):
            nondet.append(m)
            continue
        ref = run(vk, fmt, stock, x, tw, ti)
        to_phys, to_log = _order_preserving(ti, seed=m)
        assert to_phys != list(range(E))  # a real relabelling
        if not torch.equal(run(vk, fmt, _permuted(stock, to_log), x, tw, _relabel(ti, to_phys)), ref):
            same_order.append(m)
        if not torch.equal(run(vk, fmt, arb, x, tw, _relabel(ti, arb_phys)), ref):
            other_order.append(m)
    print(f"{fmt}: stock nondeterministic at m = {nondet}; order-preserving relabelling differs at "
          f"{same_order}; arbitrary order differs at {other_order}")  # fmt: skip
    if fmt == "moe_wna16":  # Triton gptq_awq kernel at m = 64, 256 (whole K per program): any order
        # m <= 8 runs moe_wna16_gemm (bf16 atomicAdd over K splits): printed above, not asserted
        assert not [m for m in same_order + other_order if m >= 64], f"Triton path: {other_order}"
        return
    # the hypothesis: the bits depend on the used experts' order only, not on ids or addresses
    assert not same_order, f"{fmt}: an order-preserving relabelling changed the bits at m = {same_order}"
    # run 12's finding, reproduced with plain torch (no VMM, no reap-swap layout)
    assert other_order, f"{fmt}: an arbitrary expert order was bitwise at every m: run 12 unexplained"


@pytest.mark.parametrize("fmt", ["gptq-marlin", "awq-marlin", "moe_wna16"])
def test_int4_identity_groups_serve_bitwise_across_swaps(vk, fmt):
    from reap_swap.engine.residency.grouped import apply_logical, release, remap_ids
    from reap_swap.sizing.contiguous_groups import identity_fill

    st, entry, stock, served, core = _grouped(fmt, "identity")
    try:
        lay, perm = entry.layout, entry.perm
        assert perm.is_identity and entry.id_map.tolist() == list(range(E))
        assert lay.group_size == 8 and lay.strides == lay.slab_bytes and lay.padding_overhead == 0
        for name, view in entry.views.items():
            assert view.is_contiguous() and view.data_ptr() % (2 * 2**20) == 0  # stock-like, page-aligned
            assert view.data_ptr() == entry.ranges[name].unit_address(0)
        inputs = {m: _routing(vk, m, seed=m) for m in (1, 8, 64, 256)}
        nondet = [m for m, xi in inputs.items() if not _stock_is_deterministic(vk, fmt, stock, xi)]
        refs = {m: run(vk, fmt, stock, *xi) for m, xi in inputs.items()}
        half = sorted(random.Random(1).sample(range(E), E // 2))
        fill = identity_fill(core, lay.group_size)  # the engine's load-time core fill, identity order
        mismatches = []
        for resident in ([], fill, half, list(range(E)), fill, []):
            out = apply_logical(st, {0: resident})
            groups = {e // lay.group_size for e in resident}
            assert st.table.resident().get(0, frozenset()) == groups
            assert out["bytes_copied"] == out["admitted_groups"] * lay.group_payload_bytes
            for m, (x, tw, ti) in inputs.items():
                ids = remap_ids(entry, ti)
                assert torch.equal(ids, ti)  # identity order: the kernel sees stock's ids
                if not torch.equal(run(vk, fmt, served, x, tw, ids), refs[m]):
                    mismatches.append((len(resident), m))
        det = [(r, m) for r, m in mismatches if m not in nondet]
        assert not det, f"{fmt}: identity order not bitwise where stock is deterministic (resident, m): {det}"
        if mismatches:
            pytest.xfail(
                f"{fmt}: stock itself is nondeterministic at m = {nondet} (bf16 atomicAdd): {mismatches}"
            )
    finally:
        release(st)


def test_marlin_cuda_graph_with_the_remap_replays_across_swaps(vk):
    from reap_swap.engine.residency.grouped import apply_logical, release, remap_ids

    fmt = "awq-marlin"
    st, entry, stock, served, core = _grouped(fmt, "identity")
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
