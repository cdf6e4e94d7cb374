"""--reap-group-size wired through the engine on CPU (no GPU, no vLLM model): settings, the load-time
attach of fake FP8-block / bf16 layers through the real CudaEngine.attach_after_load and binding
rules, the grouped backend's swaps over a CPU store that really copies bytes, the logical ->
physical remap after counting in ReapRoutedExperts.forward_modular, and the status / wire shapes.

What is faked: the CUDA VMM (`vmm.MixedRange` / `DeviceSlotPool` are CPU byte buffers with the
same unit arithmetic: the views the kernel would read are real strided views into them) and the
copy engine (a store that copies a group's payload from the host range into the pool slot and
checks it). The MoE arithmetic is a float32 reference on CPU; equality is bitwise (torch.equal).
The VMM data path and vLLM's Triton kernel are tests/gpu/test_grouped_engine.py and
tests/gpu/test_grouped_server.py (H200)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from reap_swap.cache.slot_table import PoolCapacityError  # noqa: E402
from reap_swap.config import flags as reap_flags  # noqa: E402
from reap_swap.config import settings as settings_mod  # noqa: E402
from reap_swap.engine import vmm  # noqa: E402
from reap_swap.engine.residency import engine as engine_mod  # noqa: E402
from reap_swap.engine.residency import grouped, grouped_engine  # noqa: E402
from reap_swap.engine.residency.grouped_backend import GroupedResidency  # noqa: E402
from reap_swap.engine.residency.refusals import LayerRefusals  # noqa: E402
from reap_swap.engine.residency.state import EngineState  # noqa: E402
from reap_swap.engine.residency.swap import SwapStepFailed  # noqa: E402
from reap_swap.sizing.groups import GroupLayout, group_pool_slots, plan_groups  # noqa: E402

MIB = 2**20
G = 2 * MIB
E, H, I = 8, 2048, 768  # Qwen3-30B-A3B expert shape, 8 experts
FP8 = torch.float8_e4m3fn
BLOCK_CFG = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


# -- a CPU stand-in for the VMM -------------------------------------------------------------------
class FakeRange:
    """vmm.MixedRange on a CPU byte buffer: unit u at base + u * unit_bytes; backing per unit."""

    def __init__(self, num_units, unit_bytes, device=0):
        self.num_units, self.unit_bytes = num_units, unit_bytes
        self.buf = torch.zeros(num_units * unit_bytes, dtype=torch.uint8)
        self.base = self.buf.data_ptr()
        self.backing = [None] * num_units
        self.released = False

    @classmethod
    def create_host_backed(cls, num_units, unit_bytes, device):
        return cls(num_units, unit_bytes, device)

    def as_bytes(self):
        return self.buf

    def unit_address(self, unit):
        return self.base + unit * self.unit_bytes

    def release(self):
        self.released = True

    def map_masters(self):  # the engine maps the masters' second mapping at load (remapping ahead)
        self.masters_mapped = self.num_units
        return self.num_units


class FakePool(FakeRange):
    @classmethod
    def create(cls, num_slots, unit_bytes, device):
        return cls(num_slots, unit_bytes, device)

    @property
    def num_slots(self):
        return self.num_units

    @property
    def nbytes(self):
        return self.num_units * self.unit_bytes


class CpuGroupStore:
    """swap.ExpertStore over a GroupedState of FakeRanges: a copy moves the group's payload of
    every tensor from the host range into the pool slot, and map_slot checks the bytes landed."""

    def __init__(self, gs):
        self.gs = gs
        self.bytes_per_expert = next(iter(gs.layers.values())).layout.group_payload_bytes
        self.copied = 0

    def quiesce(self):
        pass

    def _spans(self, layer, group, slot):
        e = self.gs.layers[layer]
        for i, name in enumerate(e.layout.names):
            n, unit = e.layout.payload(i), e.layout.unit_bytes[i]
            yield e.ranges[name], self.gs.pools[name], group * unit, slot * unit, n

    def map_host(self, layer, group):
        for rng in self.gs.layers[layer].ranges.values():
            rng.backing[group] = None

    def start_copy(self, layer, group, slot):
        for rng, pool, src, dst, n in self._spans(layer, group, slot):
            pool.buf[dst : dst + n].copy_(rng.buf[src : src + n])
            self.copied += n
        return (layer, group, slot)

    def wait_copy(self, token):
        pass

    def map_slot(self, layer, group, slot):
        for rng, pool, src, dst, n in self._spans(layer, group, slot):
            assert torch.equal(pool.buf[dst : dst + n], rng.buf[src : src + n]), "slot bytes differ"
            rng.backing[group] = ("slot", slot)

    def publish(self):
        pass


@pytest.fixture
def cpu_vmm(monkeypatch):
    monkeypatch.setattr(vmm, "MixedRange", FakeRange)
    monkeypatch.setattr(vmm, "DeviceSlotPool", FakePool)
    monkeypatch.setattr(grouped, "GroupedStore", CpuGroupStore)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a, **k: (1 << 40, 1 << 40))  # pool_reserve
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a, **k: None)
    monkeypatch.setattr(engine_mod.vllm_moe, "release_cached_pinned_memory", lambda: None)
    monkeypatch.setattr(grouped_engine.vllm_moe, "release_cached_pinned_memory", lambda: None)
    # the private path's core fill goes through VmmStore (CUDA copies): recorded, not run, here
    monkeypatch.setattr(engine_mod, "swap_state", lambda st, target: st.__dict__.setdefault("filled", target))


# -- fake layers, plan, engine --------------------------------------------------------------------
class Fp8MoEMethod:  # the class name the binding rules read; a Triton kernel by class name
    is_monolithic = False
    moe_kernel = SimpleNamespace(fused_experts=type("TritonExperts", (), {})())

    def process_weights_after_loading(self, layer):
        pass


class UnquantizedFusedMoEMethod(Fp8MoEMethod):
    unquantized_backend = SimpleNamespace(name="TRITON")


def _module(index, tensors, method):
    m = torch.nn.Module()
    m.layer_name = f"model.layers.{index}.mlp.experts"
    m.expert_map, m.top_k, m.quant_method = None, 2, method
    m.local_num_experts, m.hidden_size, m.intermediate_size_per_partition = E, H, I
    for name, t in tensors.items():
        m.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    return m


def fp8_layer(index, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    tensors = {
        "w13_weight": r(E, 2 * I, H).mul(0.5).to(FP8),
        "w13_weight_scale_inv": r(E, 2 * I // 128, H // 128).abs().add(0.01),
        "w2_weight": r(E, H, I).mul(0.5).to(FP8),
        "w2_weight_scale_inv": r(E, H // 128, I // 128).abs().add(0.01),
    }
    return _module(index, tensors, Fp8MoEMethod())


def bf16_layer(index, seed, hidden=H):
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "w13_weight": torch.randn(E, 2 * I, hidden, generator=g).to(torch.bfloat16),
        "w2_weight": torch.randn(E, hidden, I, generator=g).to(torch.bfloat16),
    }
    m = _module(index, tensors, UnquantizedFusedMoEMethod())
    m.hidden_size = hidden
    return m


CORE = {0: [5, 2], 1: [7]}
SLICES = {0: [[1, 6], [3]], 1: [[0, 4]]}


def fake_plan(expert_slots=6, per_expert=3 * H * I):
    layers = {
        l: SimpleNamespace(
            core=CORE[l], num_experts=E, slices=[SimpleNamespace(experts=s) for s in SLICES[l]]
        )
        for l in (0, 1)
    }
    return SimpleNamespace(
        layers=layers,
        swappable_budget_bytes=expert_slots * per_expert,
        per_expert_bytes=per_expert,
        fill_order=lambda: ([], "none"),
    )


def cpu_engine(group_size, plan=None, quant=BLOCK_CFG, cache=None):
    plan = plan or fake_plan()
    eng = engine_mod.CudaEngine(plan, LayerRefusals(), cache=cache, group_size=group_size)
    state = EngineState(device=0, plan=plan, budget_bytes=plan.swappable_budget_bytes, granularity=G)
    eng.state = state
    eng._state_for = lambda layer: state

    def bind(m, granularity):  # the engine's _bind with CPU tensors counted as device memory
        names = engine_mod.vllm_moe.moe_kernel_names(m)
        b = engine_mod.bind_module(
            m, engine_mod.layer_sizes(m), quant, names, granularity, on_device=lambda t: True
        )
        return b.refusal or b

    eng._bind = bind
    return eng


def reference_moe(x, ids, weights, w13, w2, s13=None, s2=None):
    """float32 SiLU-and-mul MoE with 128x128 block scales when given (what the kernel computes)."""

    def dq(w, s):
        w = w.float()
        if s is None:
            return w
        return w * s.repeat_interleave(128, 0).repeat_interleave(128, 1)

    out = torch.zeros(x.shape[0], w2.shape[1])
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = dq(w13[e], None if s13 is None else s13[e]) @ x[t]
            gate, up = h.chunk(2)
            a = torch.nn.functional.silu(gate) * up
            out[t] += weights[t, k] * (dq(w2[e], None if s2 is None else s2[e]) @ a)
    return out


def served_moe(m, x, ids, weights):
    """What the unchanged kernel computes on the layer's (re-pointed) tensors, with the ids
    forward_modular hands it (physical, after the remap)."""
    phys = grouped.to_physical(m.reap_group_map, ids)
    return reference_moe(
        x, phys, weights, m.w13_weight, m.w2_weight, m.w13_weight_scale_inv, m.w2_weight_scale_inv
    )


def _routing(seed, tokens=6):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(tokens)]).to(torch.int32)
    weights = torch.rand(tokens, 2, generator=g)
    return torch.randn(tokens, H, generator=g), ids, weights


# -- settings --------------------------------------------------------------------------------------
def _resolve(flags=None, env=None):
    return reap_flags.resolve({"plan_file": "p.json", **(flags or {})}, env or {})


def test_group_size_setting_defaults_to_private_units_and_parses_env_and_flag():
    assert _resolve().settings.residency.group_size == "1"
    assert _resolve(env={"REAP_GROUP_SIZE": "auto"}).settings.residency.group_size == "auto"
    assert _resolve({"group_size": "2"}).settings.residency.group_size == "2"
    assert settings_mod.Settings(group_size=4).residency.group_size == "4"
    with pytest.raises(settings_mod.SettingsError, match="REAP_GROUP_SIZE"):
        _resolve(env={"REAP_GROUP_SIZE": "3"})
    ns, rest = reap_flags.split_argv(["--reap-group-size", "auto", "--model", "m"])
    assert ns.group_size == "auto" and rest == ["--model", "m"]
    cfg = _resolve({"group_size": "auto"}).settings.to_worker_config()
    assert settings_mod.Settings.from_worker_config(cfg).residency.group_size == "auto"


def test_group_size_refuses_the_device_cache_and_budget_growth_by_name():
    with pytest.raises(settings_mod.SettingsError, match="--reap-group-size 2 with --reap-cache-device on"):
        _resolve({"group_size": "2", "cache_device": "on"})
    with pytest.raises(settings_mod.SettingsError, match="REAP_GROUP_SIZE auto with --reap-budget auto"):
        _resolve({"budget": "auto"}, {"REAP_GROUP_SIZE": "auto"})
    assert _resolve({"group_size": "1", "cache_device": "on"}).settings.cache.device == "on"


# -- pool sizing in groups -------------------------------------------------------------------------
def test_grouped_pool_takes_no_more_hbm_than_the_private_pool_and_holds_the_plans_experts():
    fp8 = plan_groups((("w13_weight", 2 * I * H), ("w2_weight", H * I)), 128, 2)
    assert fp8.group_bytes == 10 * MIB
    # 100 private 6 MiB units = 600 MiB -> 60 groups of 2 (120 experts, 10 MiB each)
    assert group_pool_slots(100, 6 * MIB, fp8, 10_000) == 60
    assert group_pool_slots(100, 6 * MIB, fp8, 40) == 40  # capped: every group of every layer
    assert group_pool_slots(0, 6 * MIB, fp8, 40) == 0
    bf16 = plan_groups((("w13_weight", 4 * I * H), ("w2_weight", 2 * H * I)), 128, 4)
    # bf16 b=4: 36 MiB groups; 10 units of 10 MiB = 100 MiB -> 2 groups, but 10 experts need 3
    assert group_pool_slots(10, 10 * MIB, bf16, 10_000) == 3


# -- the attach ------------------------------------------------------------------------------------
def test_fp8_layers_attach_in_groups_of_two_and_compute_what_stock_computes(cpu_vmm):
    eng = cpu_engine("auto")
    layers = {l: fp8_layer(l, seed=10 + l) for l in (0, 1)}
    originals = {l: {n: t.detach().clone() for n, t in m.named_parameters()} for l, m in layers.items()}
    for l, m in layers.items():
        eng.attach_after_load(m, l)
    st = eng.state
    assert eng.refusals.reasons == {} and st.layers == {} and st.pool is None  # no private pool
    gs = st.grouped
    assert sorted(gs.layers) == [0, 1]
    # remapping ahead (the default) reads the masters' second mapping: made at load, per tensor range
    assert all(
        getattr(r, "masters_mapped", 0) == r.num_units for g in gs.layers.values() for r in g.ranges.values()
    )
    lay0 = gs.layers[0].layout
    assert (lay0.group_size, lay0.strides, lay0.unit_bytes) == (2, (3 * MIB, 2 * MIB), (6 * MIB, 4 * MIB))
    # pool: 6 expert slots of 6 MiB = 36 MiB -> 3 groups of 10 MiB
    assert gs.table.num_slots == 3 and {n: p.unit_bytes for n, p in gs.pools.items()} == {
        "w13_weight": 6 * MIB,
        "w2_weight": 4 * MIB,
    }
    assert st.layouts[0]["layout"] == "grouped" and st.layouts[0]["group_size"] == 2
    assert "auto" in st.layouts[0]["why"] and st.layouts[0]["permuted"]
    for l, m in layers.items():
        entry = gs.layers[l]
        perm = entry.perm
        # parameters are the views into the ranges, in physical order
        assert m.w13_weight.data_ptr() == entry.ranges["w13_weight"].base
        assert m.w2_weight.data_ptr() == entry.ranges["w2_weight"].base
        assert m.w13_weight.stride(0) == 3 * MIB and m.w2_weight.stride(0) == 2 * MIB
        assert engine_mod.vllm_moe.is_uva_offloaded(m.w13_weight)
        for p, e in enumerate(perm.to_logical):
            for name in ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv"):
                assert torch.equal(
                    getattr(m, name)[p].view(torch.uint8), originals[l][name][e].view(torch.uint8)
                )
        assert set(entry.kept) == {"w13_weight_scale_inv", "w2_weight_scale_inv"}
        assert m.reap_group_map.tolist() == list(perm.to_physical) and m._reap_vmm
        # the core is resident, in whole groups (layer 1's core 7 has a passenger)
        assert {perm.to_logical[p] for g in gs.table.resident()[l] for p in entry.layout.members(g)} >= set(
            CORE[l]
        )
    assert gs.table.resident() == {0: frozenset({0}), 1: frozenset({0})}
    assert gs.swaps == 0  # the load-time core fill is not a swap
    backend = GroupedResidency.over(st, CpuGroupStore(gs))
    x, ids, w = _routing(0)
    for l, m in layers.items():
        o = originals[l]
        ref = reference_moe(
            x, ids, w, o["w13_weight"], o["w2_weight"], o["w13_weight_scale_inv"], o["w2_weight_scale_inv"]
        )
        assert torch.equal(served_moe(m, x, ids, w), ref)
    # a swap to core + slice 1 on layer 0: groups {5,2} and {1,6}
    out = backend.apply({0: [5, 2, 1, 6], 1: [7]})
    assert (out["admitted"], out["evicted"], out["reused"]) == (1, 0, 2)
    assert (
        out["bytes_copied"] == lay0.group_payload_bytes == int(9.5 * MIB)
    )  # (b-1)*stride + slab, per tensor
    assert out["grouped"] == {
        "hbm_bytes": 3 * 10 * MIB,
        "wanted_experts": 5,
        "resident_experts": 6,
        "groups_resident": 3,
    }
    res = backend.resident()
    assert res[0] == {5, 2, 1, 6} and 7 in res[1] and len(res[1]) == 2
    assert backend.apply(res)["bytes_copied"] == 0  # resident() re-applied is a no-op
    for l, m in layers.items():  # the same outputs whatever is resident
        o = originals[l]
        ref = reference_moe(
            x, ids, w, o["w13_weight"], o["w2_weight"], o["w13_weight_scale_inv"], o["w2_weight_scale_inv"]
        )
        assert torch.equal(served_moe(m, x, ids, w), ref)


def test_capacity_is_in_groups_checked_before_anything_moves_and_failures_roll_back(cpu_vmm):
    from reap_swap.engine.residency.fault import FaultInjectingBackend

    eng = cpu_engine("2")
    for l in (0, 1):
        eng.attach_after_load(fp8_layer(l, seed=l), l)
    gs = eng.state.grouped
    store = CpuGroupStore(gs)
    backend = GroupedResidency.over(eng.state, store)
    before = gs.table.resident()
    with pytest.raises(PoolCapacityError):  # 4 groups wanted, 3 group slots
        backend.apply({0: [5, 2, 1, 6, 3], 1: [7]})
    assert gs.table.resident() == before and store.copied == 0
    with pytest.raises(PoolCapacityError):
        backend.apply({0: [5, 2, 1, 6, 3], 1: [7]}, dry_run=True)
    dry = backend.apply({0: [5, 2, 1, 6], 1: [7]}, dry_run=True)
    assert dry["admitted"] == 1 and dry["bytes_copied"] == 0 and gs.table.resident() == before
    faulty = FaultInjectingBackend(backend, rank=0)
    faulty.arm(after_admissions=1)
    with pytest.raises(SwapStepFailed) as err:  # two admissions: the second map_slot fails
        faulty.apply({0: [1, 6, 3], 1: [7]})
    assert err.value.rolled_back and gs.table.resident() == before
    assert backend.store is store  # the seam put the store back


def test_bf16_auto_keeps_private_units_with_the_reason_in_status(cpu_vmm):
    plan = fake_plan(per_expert=3 * H * I * 2)
    eng = cpu_engine("auto", plan=plan, quant={})
    m = bf16_layer(0, seed=1)
    eng.attach_after_load(m, 0)
    st = eng.state
    assert eng.refusals.reasons == {} and st.grouped is None and sorted(st.layers) == [0]
    assert st.layouts[0]["layout"] == "private" and st.layouts[0]["group_size"] == 1
    assert "private units" in st.layouts[0]["why"]
    assert not hasattr(m, "reap_group_map") and m.w13_weight.stride(0) == 10 * MIB // 2


def test_default_group_size_one_never_enters_the_grouped_path(cpu_vmm, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("grouped_engine.attach called with the default setting")

    monkeypatch.setattr(grouped_engine, "attach", boom)
    eng = cpu_engine("1", plan=fake_plan(per_expert=3 * H * I * 2), quant={})
    m = bf16_layer(0, seed=1)
    eng.attach_after_load(m, 0)
    assert eng.state.layouts == {} and eng.state.grouped is None and sorted(eng.state.layers) == [0]


def test_a_layer_that_cannot_join_the_grouped_pool_is_refused_by_name(cpu_vmm):
    plan = fake_plan(per_expert=3 * H * I * 2)
    eng = cpu_engine("2", plan=plan, quant={})
    eng.attach_after_load(bf16_layer(0, seed=1), 0)
    other = bf16_layer(1, seed=2, hidden=1024)  # other expert shape: other group units
    eng.attach_after_load(other, 1)
    reason = eng.refusals.reasons["model.layers.1.mlp.experts"]
    assert "mixed layouts are not pooled" in reason and "--reap-group-size 2" in reason
    assert sorted(eng.state.grouped.layers) == [0] and not hasattr(other, "reap_group_map")


def test_decide_falls_back_to_private_units_with_the_device_cache_and_after_private_layers():
    st = SimpleNamespace(layers={}, granularity=G)
    bound = SimpleNamespace(
        rehome={"w13_weight": torch.zeros(2, 4, dtype=FP8), "w2_weight": torch.zeros(2, 2, dtype=FP8)}
    )
    assert grouped_engine.decide(SimpleNamespace(group_size="2", cache=object()), st, bound) == (
        1,
        grouped_engine.CACHE_ON,
    )
    st.layers = {0: object()}
    assert grouped_engine.decide(SimpleNamespace(group_size="2", cache=None), st, bound) == (
        1,
        grouped_engine.PRIVATE_FIRST,
    )


def test_status_reports_layout_b_why_groups_and_hbm_and_reaches_reap_status(cpu_vmm):
    from reap_swap.engine import wire
    from reap_swap.server.swap_report import brief, engine_summary

    eng = cpu_engine("auto")
    for l in (0, 1):
        eng.attach_after_load(fp8_layer(l, seed=l), l)
    backend = GroupedResidency.over(eng.state, CpuGroupStore(eng.state.grouped))
    s = backend.status()
    assert s["layout"] == "grouped" and s["group_size"] == 2 and s["pool_slots"] == 3
    assert s["pool_hbm_bytes"] == 3 * 10 * MIB and s["hbm_used_bytes"] == 2 * 10 * MIB
    assert s["capacity_experts"] == 6 and s["bytes_per_expert"] == 5 * MIB
    assert s["kept_whole_hbm_bytes"] == 2 * E * (12 * 16 + 16 * 6) * 4
    lay = s["layouts"]["1"]
    assert lay["layout"] == "grouped" and lay["strides"] == {"w13_weight": 3 * MIB, "w2_weight": 2 * MIB}
    assert (lay["resident_groups"], lay["resident_experts"], lay["hbm_bytes"]) == (1, 2, 10 * MIB)
    facts = engine_summary(s)
    assert facts["layouts"]["0"]["group_size"] == 2 and facts["layout"] == "grouped"
    result = backend.apply({0: [5, 2, 1, 6], 1: [7]})
    reply = wire.ApplyReply(rank=0, signature="s", resident_experts=8, dry_run=False, **result)
    assert brief(reply)["grouped"]["hbm_bytes"] == 30 * MIB


# -- the remap in forward_modular --------------------------------------------------------------------
def test_forward_modular_counts_logical_ids_and_hands_the_kernel_physical_ids(monkeypatch):
    experts = pytest.importorskip("reap_swap.engine.routed_experts")
    seen = {}
    monkeypatch.setattr(
        experts.counters, "record", lambda m, ids, w, **k: seen.setdefault("counted", ids.clone())
    )

    def stock(self, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        seen["kernel"] = topk_ids.clone()
        return x

    monkeypatch.setattr(experts.RoutedExperts, "forward_modular", stock)
    m = torch.nn.Module.__new__(experts.ReapRoutedExperts)
    torch.nn.Module.__init__(m)
    m.layer_name, m.reap_count_kernel = "model.layers.0.mlp.experts", None
    ids = torch.tensor([[6, 1], [0, 7]], dtype=torch.int32)
    w = torch.ones(2, 2)
    m.forward_modular(torch.zeros(2, 4), w, ids)  # no map: stock ids
    assert torch.equal(seen["kernel"], ids)
    seen.clear()
    to_physical = [3, 5, 0, 1, 7, 2, 4, 6]
    m.reap_group_map = torch.tensor(to_physical, dtype=torch.int32)
    m.forward_modular(torch.zeros(2, 4), w, ids)
    assert torch.equal(seen["counted"], ids)  # counters, /router_misses, forensics: logical
    assert seen["kernel"].tolist() == [[4, 5], [3, 6]] and seen["kernel"].dtype == ids.dtype


def test_group_layout_is_the_type_the_engine_stores():
    assert isinstance(plan_groups((("w13_weight", 4096), ("w2_weight", 4096)), 4, 2, G), GroupLayout)
