"""Grouped residency units (issue 16, Padding) through vLLM 0.26.0's own Triton `fused_experts`.

The layout of reap_swap.engine.residency.grouped: one VMM range per re-homed tensor, units = groups of b
physical experts, uniform expert stride; weights re-homed in a plan-chosen physical order, the
per-expert kept-whole tensors (FP8 block scales) permuted in place once, routing ids mapped
logical -> physical right before the unchanged kernel. Checked bitwise against the stock call on
the untouched tensors with logical ids, at 0 / 25 / 50 / 100 % resident and after swaps back, for
bf16 (b = 1 auto, and b = 2) and FP8 block 128x128 (b = 2 auto, and b = 4); a CUDA graph captured
once and replayed across swaps; and a negative control (physical weights read with logical ids
must differ, so the permutation is really applied).

Qwen3-30B-A3B expert shape (H=2048, I=768), 32 experts, top-8 (~1 min on the H200). Run:
    PYTHONPATH=/tmp/site:$PWD python3 -m pytest -q tests/gpu/test_grouped_engine.py
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from tests.gpu.test_quant_engine import E, _routing, make_tensors, run_experts  # noqa: E402


@pytest.fixture(scope="module")
def vk():  # vLLM 0.26.0's own kernel entry points (as in test_quant_engine)
    fm = pytest.importorskip("vllm.model_executor.layers.fused_moe")
    cfg = pytest.importorskip("vllm.model_executor.layers.fused_moe.config")
    act = pytest.importorskip("vllm.model_executor.layers.fused_moe.activation")
    return SimpleNamespace(fused_experts=fm.fused_experts, fused_topk=fm.fused_topk, cfg=cfg, act=act)


WEIGHTS = ("w13_weight", "w2_weight")


def _plan_perm(seed: int = 3):
    from reap_swap.sizing.groups import Permutation, physical_order

    ids = list(range(E))
    random.Random(seed).shuffle(ids)
    core, slices = ids[:6], [ids[6:10], ids[10:14], ids[14:20]]
    return Permutation.from_order(physical_order(E, core, slices)), core, slices


def _grouped(fmt: str, group: str):
    from reap_swap.engine.residency.grouped import standalone_grouped
    from reap_swap.sizing.groups import choose_group_size, plan_groups

    tensors = make_tensors(fmt)
    stock = SimpleNamespace(**{n: t.clone() for n, t in tensors.items()})
    weights = {n: tensors[n] for n in WEIGHTS}
    kept = {n: t for n, t in tensors.items() if n not in WEIGHTS}
    slabs = [(n, t[0].numel() * t.element_size()) for n, t in weights.items()]
    b, _ = choose_group_size(slabs, group)
    layout = plan_groups(slabs, E, b)
    perm, core, slices = _plan_perm()
    st = standalone_grouped({0: weights}, {0: kept}, {0: perm}, {0: layout}, layout.num_groups)
    entry = st.layers[0]
    served = SimpleNamespace(**entry.views, **kept)
    return st, entry, stock, served, (core, slices)


CASES = [("bf16", "auto", 1), ("bf16", "2", 2), ("fp8-block", "auto", 2), ("fp8-block", "4", 4)]


@pytest.mark.parametrize("fmt,group,b", CASES)
def test_grouped_units_serve_bitwise_across_swaps(vk, fmt, group, b):
    from reap_swap.engine.residency.grouped import apply_logical, release, remap_ids

    st, entry, stock, served, (core, slices) = _grouped(fmt, group)
    try:
        assert entry.layout.group_size == b
        perm = entry.perm
        for name, view in entry.views.items():  # weights re-homed in physical order
            for p in range(E):
                assert torch.equal(view[p], getattr(stock, name)[perm.to_logical[p]]), (name, p)
        for name in entry.kept:  # per-expert kept-whole tensors permuted the same way, in place
            want = getattr(stock, name).index_select(0, torch.tensor(perm.to_logical, device="cuda"))
            assert torch.equal(getattr(served, name), want), name
        assert (fmt == "fp8-block") == bool(entry.kept)
        inputs = [_routing(vk, m, seed=m) for m in (1, 8, 64)]
        refs = [run_experts(vk, fmt, stock, *xi) for xi in inputs]
        # negative control: physical weights read with logical ids give other outputs
        x, tw, ti = inputs[2]
        assert not torch.equal(run_experts(vk, fmt, served, x, tw, ti), refs[2])
        quarter = [*core, *slices[0]][: E // 4]  # 25 %: the plan's core + first slice
        half = sorted(random.Random(1).sample(range(E), E // 2))  # 50 %: a random half
        for resident in ([], quarter, half, list(range(E)), quarter, []):
            out = apply_logical(st, {0: resident})
            groups = {perm.to_physical[e] // b for e in resident}
            assert st.table.resident().get(0, frozenset()) == groups
            for rng in entry.ranges.values():
                assert sum(h is not None for h in rng.backing) == len(groups)
            assert out["bytes_copied"] == out["admitted_groups"] * entry.layout.group_payload_bytes
            assert out["hbm_bytes"] == len(groups) * entry.layout.group_bytes
            for (x, tw, ti), ref in zip(inputs, refs):
                got = run_experts(vk, fmt, served, x, tw, remap_ids(entry, ti))
                assert torch.equal(got, ref), (fmt, b, len(resident), x.shape)
        # the plan-ordered quarter costs whole groups only: ceil(n / b) of them
        apply_logical(st, {0: quarter})
        assert len(st.table.resident()[0]) == -(-len(quarter) // b)
    finally:
        release(st)


def test_cuda_graph_with_the_remap_replays_across_swaps(vk):
    from reap_swap.engine.residency.grouped import apply_logical, release, remap_ids

    fmt = "fp8-block"
    st, entry, stock, served, (core, slices) = _grouped(fmt, "auto")
    try:
        x, tw, ti = _routing(vk, 4, seed=7)
        ref = run_experts(vk, fmt, stock, x, tw, ti)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # Triton compiles outside the capture
            run_experts(vk, fmt, served, x, tw, remap_ids(entry, ti))
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run_experts(vk, fmt, served, x, tw, remap_ids(entry, ti))
        used = sorted(set(ti.flatten().tolist()))
        for resident in ([], used, list(range(E)), core, []):
            apply_logical(st, {0: resident})
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, ref), sorted(resident)
    finally:
        release(st)
