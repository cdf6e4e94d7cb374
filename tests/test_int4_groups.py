"""Contiguous grouped units for INT4 W4A16 (Marlin / moe_wna16), on CPU: the pure choice of b, the
binding (weights move with their group, scales / zeros / g_idx stay whole and are permuted), and
the wiring through the real CudaEngine.attach_after_load over the CPU stand-in of the VMM of
tests/test_group_wiring.py. The layer shapes are vLLM 0.26.0's after process_weights_after_loading
(AWQ -> Marlin: awq_marlin_moe_repack / gptq_marlin_moe_repack output [E, K/16, 2N] int32; the
moe_wna16 method keeps uint8 [E, N, K/2]). The MoE arithmetic here is a float32 dequantizing
reference (the layout is what is under test; vLLM's kernels are tests/gpu/test_int4_groups.py).
Identity-order groups are what INT4 binds in under --reap-group-size auto|2|4|8 (served identical to
stock on the H200, run 16); the former opt-in flag / variable is retired: accepted, ignored, warned."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from reap_swap.sizing.contiguous_groups import (
    ContiguousLayoutError,
    check_contiguous_group,
    contiguous_group_size,
    identity_fill,
    plan_contiguous_groups,
)

torch = pytest.importorskip("torch")

import test_group_wiring as gw  # noqa: E402
from test_group_wiring import cpu_vmm  # noqa: E402,F401  (the CPU stand-in of the VMM)

MIB, G = 2**20, 2 * 2**20
E, H, I = 8, 2048, 768
AWQ_CFG = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
GPTQ_CFG = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
pytestmark = pytest.mark.usefixtures("cpu_vmm")  # the CPU stand-in of the VMM (harmless for pure tests)
W13, W2 = 2 * I * H // 2, H * I // 2  # packed int4 bytes per expert: 1.5 MiB, 0.75 MiB


# -- the pure choice of b --------------------------------------------------------------------------
def test_qwen3_30b_int4_groups_of_eight_are_whole_pages_with_no_padding():
    slabs = (("w13_qweight", W13), ("w2_qweight", W2))
    b, why = contiguous_group_size(slabs, 128)
    assert (b, why.startswith("auto")) == (8, True)
    lay = plan_contiguous_groups(slabs, 128, b)
    assert lay.strides == (W13, W2) == lay.slab_bytes  # stride = slab: what the kernel implies
    assert lay.unit_bytes == (12 * MIB, 6 * MIB) and lay.padding_overhead == 0
    assert lay.group_payload_bytes == lay.group_bytes == 18 * MIB  # a swap copies whole pages
    # Qwen3.5-35B-A3B's I = 512: 1 MiB + 0.5 MiB -> b = 4
    assert contiguous_group_size((("a", 2**20), ("b", 2**19)), 256)[0] == 4


def test_explicit_sizes_are_checked_never_rounded_and_refusals_name_the_tensor():
    slabs = (("w13_qweight", W13), ("w2_qweight", W2))
    assert contiguous_group_size(slabs, 128, "8")[0] == 8
    with pytest.raises(ContiguousLayoutError, match=r"w2_qweight .*whole pages"):
        contiguous_group_size(slabs, 128, "4")  # w13 4 x 1.5 = 6 MiB fits, w2 3 MiB does not
    with pytest.raises(ContiguousLayoutError, match="not whole groups of 8"):
        contiguous_group_size(slabs, 60, "8")
    with pytest.raises(ContiguousLayoutError, match="no contiguous group of <= 16"):
        contiguous_group_size((("w13_qweight", 3 * 2**16 + 16),), 128)
    with pytest.raises(ContiguousLayoutError, match="expected one of"):
        contiguous_group_size(slabs, 128, "3")
    assert check_contiguous_group(slabs, 128, 32) == "group size 32 outside 1..16"
    with pytest.raises(ContiguousLayoutError):
        plan_contiguous_groups(slabs, 128, 2)


# -- fake INT4 layers as vLLM 0.26.0 leaves them --------------------------------------------------
class AutoAWQMoEMethod:  # Marlin: the class names the binding rules read
    is_monolithic = False
    moe_kernel = SimpleNamespace(fused_experts=type("MarlinExperts", (), {})())

    def process_weights_after_loading(self, layer):
        pass


class MoeWNA16Method(AutoAWQMoEMethod):
    moe_kernel = None  # MoeWNA16Method calls fused_experts itself (no FusedMoEKernel)


def awq_marlin_layer(index, seed):
    """After awq_marlin_moe_repack: qweight [E, K/16, 2N] int32 (w13_weight an alias), scales
    [E, K/128, N] bf16, qzeros [E, K/128, N/8] int32, g_idx / sort indices [E, 0] int32."""
    g = torch.Generator().manual_seed(seed)
    ri = lambda *s: torch.randint(-(2**31), 2**31 - 1, s, generator=g, dtype=torch.int32)  # noqa: E731
    rs = lambda *s: torch.rand(*s, generator=g).add(0.01).to(torch.bfloat16)  # noqa: E731
    t = {
        "w13_qweight": ri(E, H // 16, 2 * 2 * I),
        "w2_qweight": ri(E, I // 16, 2 * H),
        "w13_scales": rs(E, H // 128, 2 * I),
        "w2_scales": rs(E, I // 128, H),
        "w13_qzeros": ri(E, H // 128, 2 * I // 8),
        "w2_qzeros": ri(E, I // 128, H // 8),
        "w13_g_idx": torch.empty(E, 0, dtype=torch.int32),
        "w2_g_idx": torch.empty(E, 0, dtype=torch.int32),
        "w13_g_idx_sort_indices": torch.empty(E, 0, dtype=torch.int32),
        "w2_g_idx_sort_indices": torch.empty(E, 0, dtype=torch.int32),
    }
    m = gw._module(index, t, AutoAWQMoEMethod())
    m.w13_weight, m.w2_weight = m.w13_qweight, m.w2_qweight  # auto_awq.py's aliases
    return m


def wna16_layer(index, seed, n=I):
    """MoeWNA16Method (no repack): qweight uint8 [E, 2N, K/2], scales bf16 [E, 2N, K/128]."""
    g = torch.Generator().manual_seed(seed)
    t = {
        "w13_qweight": torch.randint(0, 256, (E, 2 * n, H // 2), generator=g, dtype=torch.uint8),
        "w2_qweight": torch.randint(0, 256, (E, H, n // 2), generator=g, dtype=torch.uint8),
        "w13_scales": torch.rand(E, 2 * n, H // 128, generator=g).to(torch.bfloat16),
        "w2_scales": torch.rand(E, H, n // 128, generator=g).to(torch.bfloat16),
    }
    for key in ("w13_g_idx", "w2_g_idx", "w13_qzeros", "w2_qzeros"):  # GPTQ sym: moe_wna16.py's unused
        t[key] = torch.empty((0,), dtype=torch.int32)
    m = gw._module(index, t, MoeWNA16Method())
    m.intermediate_size_per_partition = n
    return m


def int4_engine(group_size, quant, plan=None):
    """gw.cpu_engine whose _bind passes contiguous_ok as CudaEngine._bind does (group size not 1)."""
    eng = gw.cpu_engine(group_size, plan=plan, quant=quant)

    def bind(m, granularity):
        names = gw.engine_mod.vllm_moe.moe_kernel_names(m)
        b = gw.engine_mod.bind_module(
            m, gw.engine_mod.layer_sizes(m), quant, names, granularity, on_device=lambda t: True,
            contiguous_ok=eng.group_size != "1",
        )  # fmt: skip
        return b.refusal or b

    eng._bind = bind
    return eng


def int4_reference(m, x, ids, weights, phys=True):
    """float32 MoE over uint8-packed int4 (low nibble first, zero 8) with g128 scales, reading
    expert e's bytes at e * slab from the tensor's storage -- what moe_wna16_gemm's
    `expert_offset = size_n * size_k * expert_id` does."""
    ids = gw.grouped.to_physical(m.reap_group_map, ids) if phys else ids

    def dq(w, s, e):
        flat = w.reshape(-1)  # the kernel ignores stride(0): base + e * slab
        slab = w[0].numel()
        b = flat[e * slab : (e + 1) * slab].view(w.shape[1:])
        q = torch.stack([b & 0xF, b >> 4], -1).reshape(b.shape[0], -1).float() - 8
        return q * s[e].float().repeat_interleave(128, 1)

    out = torch.zeros(x.shape[0], H)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up = (dq(m.w13_qweight, m.w13_scales, e) @ x[t]).chunk(2)
            out[t] += weights[t, k] * (
                dq(m.w2_qweight, m.w2_scales, e) @ (torch.nn.functional.silu(gate) * up)
            )
    return out


def test_default_group_size_refuses_contiguous_kernels_by_name():
    eng = int4_engine("1", AWQ_CFG)
    eng.attach_after_load(awq_marlin_layer(0, 1), 0)
    why = eng.refusals.reasons["model.layers.0.mlp.experts"]
    assert "<layout>: MarlinExperts implies the expert stride" in why and "--reap-group-size auto" in why


def test_auto_binds_int4_layers_in_identity_groups_by_default_citing_run_16():
    """No opt-in any more: a plain --reap-group-size auto engine binds Marlin and moe_wna16 layers
    in identity-order groups of 8 (run 16: served identical to stock), the stock ids kept."""
    for quant, make in ((AWQ_CFG, awq_marlin_layer), (GPTQ_CFG, wna16_layer)):
        eng = int4_engine("auto", quant, plan=gw.fake_plan(expert_slots=16, per_expert=W13 + W2))
        assert not hasattr(eng, "unverified_int4_groups")  # the engine has no such switch
        m = make(0, 1)
        before = {n: t.detach().clone() for n, t in m.named_parameters()}
        eng.attach_after_load(m, 0)
        assert eng.refusals.reasons == {}
        entry = eng.state.grouped.layers[0]
        assert entry.layout.group_size == 8 and entry.perm.is_identity
        assert m.reap_group_map.tolist() == list(range(E))  # the kernel sees stock's ids
        row = eng.state.layouts[0]
        assert row["group_size"] == 8 and not row["permuted"]
        assert (
            "identity order" in row["why"]
            and "served identical to stock" in row["why"]
            and "unverified" not in row["why"]
        )
        for n, t in m.named_parameters():  # same bytes at the same expert rows as stock
            assert torch.equal(t, before[n]), n


def test_the_retired_opt_in_flag_is_accepted_ignored_warned_and_kept_from_vllm(caplog):
    from reap_swap.config.flags import RETIRED, resolve, split_argv
    from reap_swap.config.settings import Settings

    flag = "--reap-unverified-int4-groups"
    assert "identical to stock" in RETIRED[flag] and "no longer needed" in RETIRED[flag]
    assert "unverified_int4_groups" not in Settings.model_fields
    argv = ["org/m", "--reap-plan", "p.json", flag, "--reap-group-size", "auto", "--port", "8000"]
    with caplog.at_level(logging.WARNING, logger="reap_swap.config.settings"):
        ns, vllm_argv = split_argv(argv)
    assert vllm_argv == ["org/m", "--port", "8000"]  # vLLM never sees the retired flag
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and flag in r.getMessage()]
    assert len(warned) == 1 and "default under --reap-group-size auto|2|4|8" in warned[0].getMessage()
    assert "no longer needed" in warned[0].getMessage()
    settings = resolve(ns, {}).settings
    assert (
        settings.residency.group_size == "auto"
        and settings == resolve({"plan_file": "p.json", "group_size": "auto"}, {}).settings
    )
    assert "unverified_int4_groups" not in settings.to_worker_config()
    # with the default group size 1 it is ignored too (it used to be refused as a no-op there)
    assert resolve(split_argv(["--reap-plan", "p.json", flag])[0], {}).settings.residency.group_size == "1"


@pytest.mark.parametrize("value", ["1", "0", ""])
def test_the_retired_opt_in_variable_is_accepted_ignored_and_warned(caplog, value):
    from reap_swap.config.flags import resolve

    env = "REAP_SWAP_UNVERIFIED_INT4_GROUPS"
    with caplog.at_level(logging.WARNING, logger="reap_swap.config.settings"):
        r = resolve({}, {"REAP_PLAN_FILE": "p.json", "REAP_GROUP_SIZE": "auto", env: value})  # no raise
    assert r.settings == resolve({}, {"REAP_PLAN_FILE": "p.json", "REAP_GROUP_SIZE": "auto"}).settings
    warned = [rec for rec in caplog.records if rec.levelno == logging.WARNING and env in rec.getMessage()]
    assert len(warned) == 1 and "identity-order INT4 groups are the default" in warned[0].getMessage()
    assert "unverified_int4_groups" not in r.sources  # no setting behind it


def test_identity_fill_keeps_the_best_covered_groups_within_the_packed_hbm():
    assert identity_fill([], 8) == []
    assert identity_fill([3, 1, 2], 8) == [1, 2, 3]  # one group: ceil(3 / 8)
    # 4 wanted over 3 groups of 4, room for ceil(4/4) = 1: group 1 holds two of them
    assert identity_fill([0, 5, 6, 9], 4) == [5, 6]
    assert identity_fill([0, 5, 6, 9], 4, max_groups=2) == [0, 5, 6]  # tie 0 vs 9: lower group
    assert identity_fill([0, 5, 6, 9], 4, max_groups=9) == [0, 5, 6, 9]
    assert identity_fill([0, 9], 4, max_groups=0) == []
    with pytest.raises(ValueError):
        identity_fill([1], 0)


def test_opted_in_awq_marlin_layers_attach_in_identity_order_scales_zeros_untouched():
    # 16 experts' budget at the INT4 price: 3 groups of 18 MiB (each layer's core needs one)
    eng = int4_engine("auto", AWQ_CFG, plan=gw.fake_plan(expert_slots=16, per_expert=W13 + W2))
    layers = {l: awq_marlin_layer(l, 20 + l) for l in (0, 1)}
    originals = {l: {n: t.detach().clone() for n, t in m.named_parameters()} for l, m in layers.items()}
    for l, m in layers.items():
        eng.attach_after_load(m, l)
    assert eng.refusals.reasons == {}
    gs = eng.state.grouped
    lay = gs.layers[0].layout
    assert (lay.group_size, lay.names) == (8, ("w13_qweight", "w2_qweight"))
    assert lay.strides == lay.slab_bytes == (W13, W2) and lay.unit_bytes == (12 * MIB, 6 * MIB)
    assert eng.state.layouts[0]["padding_overhead"] == 0
    for l, m in layers.items():
        entry = gs.layers[l]
        assert m.w13_qweight.is_contiguous() and m.w2_qweight.is_contiguous()  # fused_marlin_moe asserts it
        assert m.w13_weight is m.w13_qweight or m.w13_weight.data_ptr() == m.w13_qweight.data_ptr()
        assert m.w13_qweight.data_ptr() == entry.ranges["w13_qweight"].base  # page-aligned base
        assert entry.perm.is_identity and not eng.state.layouts[l]["permuted"]  # stock ids (int4perm)
        assert m.reap_group_map.tolist() == list(range(E)) and "identity order" in entry.why
        for p, e in enumerate(entry.perm.to_logical):
            for name in ("w13_qweight", "w2_qweight", "w13_scales", "w2_scales", "w13_qzeros", "w2_qzeros"):
                assert torch.equal(getattr(m, name)[p], originals[l][name][e]), (name, p, e)
        assert m.w13_g_idx.shape == (E, 0)


def test_moe_wna16_layer_in_one_group_computes_what_stock_computes_across_swaps():
    eng = int4_engine("auto", GPTQ_CFG, plan=gw.fake_plan(expert_slots=16, per_expert=W13 + W2))
    m = wna16_layer(0, 3)
    stock = wna16_layer(0, 3)
    stock.reap_group_map = torch.arange(E, dtype=torch.int32)
    eng.attach_after_load(m, 0)
    assert eng.refusals.reasons == {} and eng.state.grouped.layers[0].layout.group_size == 8
    backend = gw.GroupedResidency.over(eng.state, gw.CpuGroupStore(eng.state.grouped))
    x, ids, w = gw._routing(4, tokens=3)
    ref = int4_reference(stock, x, ids, w)
    assert torch.equal(int4_reference(m, x, ids, w), ref)
    out = backend.apply({0: []})
    assert out["evicted"] == 1 and not eng.state.grouped.table.resident().get(0)
    assert torch.equal(int4_reference(m, x, ids, w), ref)  # host-backed: same bytes, same result
    out = backend.apply({0: [3]})
    assert (out["admitted"], out["bytes_copied"]) == (1, 18 * MIB)  # the whole group, whole pages
    assert torch.equal(int4_reference(m, x, ids, w), ref)
    assert eng.state.grouped.layers[0].perm.is_identity  # identity order: the ids are stock's
    assert torch.equal(int4_reference(m, x, ids, w, phys=False), ref)


def test_misfit_shapes_and_the_device_cache_are_refused_by_name_never_private_units():
    eng = int4_engine("4", AWQ_CFG)
    eng.attach_after_load(awq_marlin_layer(0, 1), 0)
    why = eng.refusals.reasons["model.layers.0.mlp.experts"]
    assert "--reap-group-size 4" in why and "w2_qweight" in why and "whole pages" in why
    eng = int4_engine("auto", GPTQ_CFG)
    eng.cache = object()  # --reap-cache-device on
    eng.attach_after_load(wna16_layer(1, 1), 1)
    assert "contiguous groups only" in eng.refusals.reasons["model.layers.1.mlp.experts"]


def test_the_launcher_binds_int4_only_in_groups_by_default_and_keeps_vllms_marlin_backend():
    from reap_swap.sizing.quant.budget import served_quant_of

    for cfg, cli in ((AWQ_CFG, None), (GPTQ_CFG, None), (GPTQ_CFG, "moe_wna16")):
        stock = served_quant_of(cfg, cli)  # group size 1: refused as before, stock path
        assert stock.engine_refusal and not stock.launcher_may_offload
        assert "--reap-group-size auto" in stock.engine_refusal  # the refusal names the way out
        assert served_quant_of(cfg, cli, "1") == stock
        for group_size in ("auto", "2", "4", "8"):  # no opt-in: grouped is the default
            grouped = served_quant_of(cfg, cli, group_size)
            assert grouped.engine_refusal is None and grouped.launcher_may_offload
            assert not grouped.triton and grouped.uva_refusal is None  # Marlin stays; UVA offload
            assert grouped.offload_params == ("w13_qweight", "w2_qweight")  # the names INT4 registers
    assert "gptq_marlin" in served_quant_of(GPTQ_CFG, "gptq_marlin", "auto").engine_refusal  # unchecked
    assert served_quant_of({"quant_method": "mxfp4"}, None, "auto").engine_refusal  # not INT4: refused
    assert served_quant_of({"quant_method": "fp8", "weight_block_size": [128, 128]}, None, "auto").triton


def test_identity_order_core_fill_keeps_the_best_covered_group_within_the_packed_hbm():
    """16 experts, groups of 8, core {1, 9, 10}: a permuted layout packs the core into one group;
    in identity order the load-time fill keeps the group holding 9 and 10 (group 1), never two."""
    n = 16
    g = torch.Generator().manual_seed(4)
    t = {
        "w13_qweight": torch.randint(0, 256, (n, 2 * I, H // 2), generator=g, dtype=torch.uint8),
        "w2_qweight": torch.randint(0, 256, (n, H, I // 2), generator=g, dtype=torch.uint8),
        "w13_scales": torch.rand(n, 2 * I, H // 128, generator=g).to(torch.bfloat16),
        "w2_scales": torch.rand(n, H, I // 128, generator=g).to(torch.bfloat16),
    }
    m = gw._module(0, t, MoeWNA16Method())
    m.local_num_experts = n
    plan = SimpleNamespace(
        layers={0: SimpleNamespace(core=[1, 9, 10], num_experts=n, slices=[SimpleNamespace(experts=[2, 3])])},
        swappable_budget_bytes=8 * (W13 + W2),
        per_expert_bytes=W13 + W2,
        fill_order=lambda: ([], "none"),
    )
    eng = int4_engine("auto", GPTQ_CFG, plan=plan)
    eng.attach_after_load(m, 0)
    assert eng.refusals.reasons == {}
    gs = eng.state.grouped
    assert gs.layers[0].perm.is_identity and gs.layers[0].layout.group_size == 8
    assert gs.table.resident() == {0: frozenset({1})}  # experts 8..15: holds 9 and 10
    for p in range(n):  # identity order: physical row p is expert p, bytes as stock
        assert torch.equal(m.w13_qweight[p], t["w13_qweight"][p]) and torch.equal(
            m.w2_scales[p], t["w2_scales"][p]
        )


class AutoGPTQMoEMethod(AutoAWQMoEMethod):  # GPTQ through Marlin (vLLM 0.26 auto_gptq.py)
    pass


def gptq_sym_marlin_layer(index, seed):
    """Sym GPTQ after gptq_marlin_moe_repack: no zero points reach the kernel, and auto_gptq.py:581-603
    leaves w13/w2_qzeros as registered, dtype params_dtype (bf16): half the bytes int32 zeros take."""
    m = awq_marlin_layer(index, seed)
    m.quant_method = AutoGPTQMoEMethod()
    for name, n_out, k_in in (("w13_qzeros", 2 * I, H), ("w2_qzeros", H, I)):
        bf16 = torch.zeros(E, k_in // 128, n_out // 8, dtype=torch.bfloat16)
        setattr(m, name, torch.nn.Parameter(bf16, requires_grad=False))
    return m


def test_sym_gptq_placeholder_zeros_are_kept_whole_not_refused_run_12_gptq_case():
    """Run 12's gptq case: 'w2_qzeros: 3072 bytes per expert, the int/group config implies 6144'."""
    from reap_swap.sizing.quant.scheme import scheme_from_config

    assert not scheme_from_config(GPTQ_CFG).zero_point and scheme_from_config(AWQ_CFG).zero_point
    assert scheme_from_config({**GPTQ_CFG, "sym": False}).zero_point
    eng = int4_engine("auto", GPTQ_CFG, plan=gw.fake_plan(expert_slots=16, per_expert=W13 + W2))
    eng.attach_after_load(gptq_sym_marlin_layer(0, 2), 0)
    assert eng.refusals.reasons == {}
    assert {"w13_qzeros", "w2_qzeros"} <= set(eng.state.grouped.layers[0].kept)
    # the same bf16 placeholders under AWQ (zero points used) are still refused by size
    eng = int4_engine("auto", AWQ_CFG, plan=gw.fake_plan(expert_slots=16, per_expert=W13 + W2))
    eng.attach_after_load(gptq_sym_marlin_layer(1, 2), 1)
    assert "w2_qzeros: 3072 bytes per expert" in eng.refusals.reasons["model.layers.1.mlp.experts"]
