"""--reap-budget auto | GiB: the pure split arithmetic, the ranked fill order, the settings, the
slot table's growth and the API process's probe/grow handshake (no torch, no vLLM, no GPU)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from reap_swap.cache.slot_table import PoolCapacityError, SlotTable
from reap_swap.config.flags import resolve
from reap_swap.config.settings import SettingsError
from reap_swap.engine.refusal import BudgetRefused
from reap_swap.plan.document import validate_plan_document
from reap_swap.planner.build import PlannerConfig, build_plan
from reap_swap.server.budget import fill_budget
from reap_swap.sizing.memory_split import (
    GIB,
    BudgetError,
    fallback_fill_order,
    inactive_note,
    kv_bytes_for,
    kv_layout,
    kv_refusal,
    kv_target,
    launch_check,
    parse_budget,
    plan_growth,
    ranked_fill,
    split_line,
)
from tests.test_planner import observations, routed, shape_for, stats_from_routing

MIB = 2**20


def test_parse_budget():
    assert parse_budget("auto") == "auto" and parse_budget("PLAN") == "plan"
    assert parse_budget("12.5") == 12.5 and parse_budget("8GiB") == 8.0
    for bad in ("-1", "0", "nan", "inf", "lots"):
        with pytest.raises(ValueError):
            parse_budget(bad)


def test_settings_flags_and_env():
    s = resolve({"plan_file": "p.json", "budget": "auto", "kv_tokens": 4096}, {}).settings
    assert s.budget.pool == "auto" and s.budget.kv_tokens == 4096 and s.budget.request() == "auto"
    s = resolve({"plan_file": "p.json"}, {"REAP_BUDGET": "20", "REAP_KV_TOKENS": "100"}).settings
    assert s.budget.request() == 20.0 and s.budget.kv_tokens == 100
    assert resolve({"plan_file": "p.json"}, {}).settings.budget.pool == "plan"
    with pytest.raises(SettingsError, match="--reap-budget"):
        resolve({"plan_file": "p.json", "budget": "huge"}, {})
    with pytest.raises(SettingsError, match="REAP_KV_TOKENS"):
        resolve({"plan_file": "p.json"}, {"REAP_KV_TOKENS": "0"})


QWEN3_30B = {"num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128}


def test_kv_layout_gqa_mla_and_refusals():
    gqa = kv_layout(QWEN3_30B, 2)
    assert gqa.bytes_per_token == 48 * 2 * 4 * 128 * 2  # 96 KiB per token
    assert kv_layout(QWEN3_30B, 2, tp_size=2).bytes_per_token == gqa.bytes_per_token // 2
    assert kv_layout(QWEN3_30B, 2, tp_size=8).bytes_per_token == 48 * 2 * 1 * 128 * 2  # replicated head
    no_head_dim = {"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 512}
    assert kv_layout(no_head_dim, 2).bytes_per_token == 2 * 2 * 8 * 64 * 2
    mla = kv_layout({"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64}, 2, tp_size=8)
    assert (mla.kind, mla.bytes_per_token) == ("mla", 61 * 576 * 2)
    with pytest.raises(BudgetError, match="hybrid"):
        kv_layout({**QWEN3_30B, "layer_types": ["linear_attention", "full_attention"]}, 2)
    with pytest.raises(BudgetError, match="sliding"):
        kv_layout({**QWEN3_30B, "sliding_window": 4096}, 2)
    assert kv_layout({**QWEN3_30B, "sliding_window": 4096, "use_sliding_window": False}, 2) == gqa


def test_kv_bytes_and_target():
    layout = kv_layout(QWEN3_30B, 2)
    assert kv_bytes_for(layout, 4096, 8, 16) == 8 * 4096 * layout.bytes_per_token
    # whole blocks of a multiple of 256 tokens: vLLM 0.26 picks the backend's block (16..256) after load
    assert kv_bytes_for(layout, 100, 2, 16) == 2 * 256 * layout.bytes_per_token
    assert kv_bytes_for(layout, 300, 1, 512) == 512 * layout.bytes_per_token
    assert kv_target(4096, 8, None) == (4096, 8)
    assert kv_target(4096, 8, 65536) == (65536, 1)
    with pytest.raises(BudgetError, match="below --max-model-len"):
        kv_target(4096, 8, 1000)


def growth(**kw):
    args = dict(
        total_bytes=140 * GIB, free_bytes=100 * GIB, utilization=0.85, activation_bytes=2 * GIB,
        unit_bytes=18 * MIB, slots_before=100, max_slots=48 * 128, budget="auto", margin_bytes=512 * MIB,
    )  # fmt: skip
    return plan_growth(**{**args, **kw})


def test_auto_takes_the_headroom_in_whole_slots():
    g = growth()
    headroom = int(140 * GIB * 0.85) - 40 * GIB - 2 * GIB - 512 * MIB
    assert g.headroom_bytes == headroom and g.extra_slots == min(headroom // (18 * MIB), 48 * 128 - 100)
    assert g.slots_after * 18 * MIB <= headroom + 100 * 18 * MIB


def test_auto_stops_at_all_experts():
    g = growth(max_slots=300)
    assert g.extra_slots == 200 and g.slots_after == 300


def test_gib_cap_caps_and_a_cap_beyond_memory_is_refused():
    g = growth(budget=10.0)
    assert g.slots_after == int(10 * GIB) // (18 * MIB)
    with pytest.raises(BudgetError, match="only .* fit"):
        growth(budget=200.0)
    with pytest.raises(BudgetError, match="below the plan's pool"):
        growth(budget=1.0)


def test_no_room_under_the_cap_is_refused_with_numbers():
    with pytest.raises(BudgetError, match=r"over the memory cap: 130\.00 GiB in use"):
        growth(free_bytes=10 * GIB)
    assert (
        growth(
            utilization=0.3, free_bytes=98 * GIB + 10 * MIB, activation_bytes=0, margin_bytes=0
        ).extra_slots
        == 0
    )


def test_split_line_names_every_part():
    line = split_line(
        growth(max_slots=300), weights_bytes=3 * GIB, kv_bytes=4 * GIB, resident=300, experts=300
    )
    assert line.startswith("reap-swap memory split: weights 3.00 GiB, pool 5.27 GiB (300 slots")
    for part in ("300/300 experts resident", "KV 4.00 GiB", "activations 2.00 GiB", "cap 119.00 of 140.00"):
        assert part in line


def test_fallback_order_round_robin_slices_first():
    order = fallback_fill_order({0: {0}, 1: {1}}, {0: [3, 2], 1: []}, {0: 4, 1: 3})
    assert order == [(0, 3), (1, 0), (0, 2), (1, 2), (0, 1)]


def test_ranked_fill_keeps_the_base_and_takes_the_prefix():
    order = [(0, 3), (1, 0), (5, 1), (0, 2), (1, 2)]
    fill = ranked_fill(order, {0: {0}, 1: {1}}, 4, layers=[0, 1])
    assert fill == {0: frozenset({0, 3}), 1: frozenset({0, 1})}
    assert ranked_fill(order, {0: {0}}, 1, layers=[0, 1]) == {0: frozenset({0})}


def test_launch_check_and_cpu_behaviour():
    assert launch_check(1.0, 2 * GIB, None).startswith("--reap-budget 1.0 GiB is below the plan's budget")
    assert launch_check(4.0, 2 * GIB, None) is None and launch_check("auto", 2 * GIB, None) is None
    cpu = "vLLM's CPU build keeps every expert in host memory"
    assert launch_check(1.0, 2 * GIB, cpu) is None  # inactive on the CPU build, not refused
    assert "inactive" in inactive_note("auto", cpu) and cpu in inactive_note("auto", cpu)
    assert inactive_note("plan", cpu) is None and inactive_note("auto", None) is None


def test_slot_table_grows_with_free_slots():
    t = SlotTable(2)
    with pytest.raises(PoolCapacityError):
        t.plan({0: [0, 1, 2]})
    t.grow(2)
    plan = t.plan({0: [0, 1, 2]})
    assert [s.slot for s in plan.admit] == [0, 1, 2] and t.num_slots == 4


def _plan_doc(ratio: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    layers = {i: stats_from_routing(routed(rng, 300, 16, 2, 1.5), 16, rng, key=str(i)) for i in range(3)}
    shape = shape_for(3, 16, 2)
    return build_plan(
        [observations(layers)], shape, PlannerConfig(budget_ratio=ratio, core_fraction=1.0), "m"
    ), shape


def test_planner_fill_order_is_the_greedy_core_of_larger_budgets():
    small, shape = _plan_doc(0.25)
    big, _ = _plan_doc(0.5)
    order = [tuple(x) for x in small["fillOrder"]]
    core = {(int(k[6:]), e) for k, l in small["perLayer"].items() for e in l["coreExperts"]}
    assert len(order) + len(core) == 3 * 16 and not core & set(order)
    big_core = {(int(k[6:]), e) for k, l in big["perLayer"].items() for e in l["coreExperts"]}
    assert core | set(order[: len(big_core) - len(core)]) == big_core
    report = validate_plan_document(small, shape)
    assert report.ok, report.errors


def test_plan_fill_order_with_and_without_the_field(tmp_path):
    from reap_swap.plan.document import load_plan

    doc, shape = _plan_doc(0.25)
    path = tmp_path / "p.json"
    path.write_text(__import__("json").dumps(doc))
    ranked, source = load_plan(str(path), shape).fill_order()
    assert source == "plan fillOrder" and ranked == [tuple(x) for x in doc["fillOrder"]]
    doc.pop("fillOrder")
    path.write_text(__import__("json").dumps(doc))
    plan = load_plan(str(path), shape)
    fallback, source = plan.fill_order()
    assert source.startswith("fallback") and len(fallback) == 3 * 16 - sum(
        len(l.core) for l in plan.layers.values()
    )


def test_fill_order_drops_bad_entries_and_completes_with_fallback(tmp_path):
    from reap_swap.plan.document import load_plan

    doc, shape = _plan_doc(0.25)
    core0 = doc["perLayer"]["layer_0"]["coreExperts"][0]
    good = next(x for x in doc["fillOrder"] if x[0] == 1)
    doc["fillOrder"] = [[9, 0], [0, core0], good, good]
    path = tmp_path / "p.json"
    path.write_text(__import__("json").dumps(doc))
    ranked, _ = load_plan(str(path), shape).fill_order()
    assert ranked[0] == tuple(good) and len(ranked) == len(set(ranked)) == 3 * 16 - sum(
        len(l["coreExperts"]) for l in doc["perLayer"].values()
    )


def _fake_rpc(probes, grown):
    calls = []

    async def rpc(method, **kwargs):
        calls.append((method, kwargs))
        return probes if not kwargs else [dict(g, extra_slots=kwargs["extra_slots"]) for g in grown]

    return rpc, calls


def test_fill_budget_grows_every_rank_by_the_smallest_probe():
    rpc, calls = _fake_rpc(
        [{"rank": 0, "active": True, "extra_slots": 7}, {"rank": 1, "active": True, "extra_slots": 5}],
        [{"rank": 0, "line": "split"}, {"rank": 1, "line": "split"}],
    )
    report = asyncio.run(fill_budget(rpc))
    assert calls[1] == ("reap_fill_budget", {"extra_slots": 5}) and report["extra_slots"] == 5


def test_fill_budget_refuses_and_reports_inactive():
    rpc, _ = _fake_rpc([{"rank": 0, "active": True, "error": "over the memory cap: 9 GiB"}], [])
    with pytest.raises(BudgetRefused, match="rank 0: over the memory cap"):
        asyncio.run(fill_budget(rpc))
    rpc, calls = _fake_rpc([{"rank": 0, "active": False, "reason": "--reap-budget auto is inactive"}], [])
    assert asyncio.run(fill_budget(rpc)) == {"active": False, "reason": "--reap-budget auto is inactive"}
    assert len(calls) == 1


def test_kv_refusal_names_the_numbers_and_a_kv_tokens_that_fits():
    gi = GIB
    fits = kv_refusal(kv_bytes=10 * gi, pool_bytes=20 * gi, total=140 * gi, free=100 * gi, utilization=0.9,
                      source="t", bytes_per_token=2**20, max_model_len=4096)  # fmt: skip
    assert fits is None  # 126 cap - 40 in use = 86 GiB left >= 30
    why = kv_refusal(kv_bytes=100 * gi, pool_bytes=20 * gi, total=140 * gi, free=100 * gi, utilization=0.9,
                     source="4096 tokens x 1024 seqs", bytes_per_token=2**20, max_model_len=4096)  # fmt: skip
    # (86 - 20) GiB / 1 MiB per token = 67584 tokens, a multiple of 256
    assert "needs 100.00 GiB" in why and "pool 20.00 GiB" in why and "86.00 GiB is left" in why
    assert "--reap-kv-tokens 67584" in why and "4096 tokens x 1024 seqs" in why
    none = kv_refusal(kv_bytes=100 * gi, pool_bytes=85 * gi, total=140 * gi, free=100 * gi, utilization=0.9,
                      source="t", bytes_per_token=2**20, max_model_len=4096)  # fmt: skip
    assert "--reap-kv-tokens" not in none and "lower --max-model-len" in none


def test_a_workers_refusal_reaches_the_launcher_as_one_line(tmp_path, monkeypatch, capsys):
    from reap_swap.engine import refusal as budget_startup
    from reap_swap.server import launcher as server

    monkeypatch.setenv(budget_startup.REFUSAL_ENV, "")  # restored after the test (main arms it)
    env: dict = {}
    path = budget_startup.arm_refusal_file(tmp_path, env)
    assert budget_startup.read_refusal(path) is None
    budget_startup.record_refusal("KV target needs 9 GiB\nmore", env)
    budget_startup.record_refusal("second rank", env)
    assert budget_startup.read_refusal(path) == "KV target needs 9 GiB more"
    budget_startup.record_refusal("nothing armed", {})  # no launcher: no file, no error

    class Cmd:  # what vLLM's engine start does when a worker raised: a RuntimeError of its own
        def cmd(self, args):
            budget_startup.record_refusal("rank 0: over the memory cap: 1 GiB")
            raise RuntimeError("Engine core initialization failed. See root cause above.")

    monkeypatch.setattr(server, "prepare", lambda argv: (None, Cmd()))
    monkeypatch.setattr(server.tempfile, "gettempdir", lambda: str(tmp_path))
    assert server.main(["m"]) == 1
    err = capsys.readouterr().err
    assert err.strip().endswith("startup refused: rank 0: over the memory cap: 1 GiB")
    assert not list(tmp_path.glob("reap-swap-refusal-*"))  # cleaned up

    class Other:
        def cmd(self, args):
            raise RuntimeError("not a budget refusal")

    monkeypatch.setattr(server, "prepare", lambda argv: (None, Other()))
    with pytest.raises(RuntimeError, match="not a budget refusal"):
        server.main(["m"])

    class Api:
        def cmd(self, args):
            raise budget_startup.BudgetRefused("rank 1: --reap-budget 9.0 GiB needs 3 more slots")

    monkeypatch.setattr(server, "prepare", lambda argv: (None, Api()))
    assert server.main(["m"]) == 1 and "needs 3 more slots" in capsys.readouterr().err


def test_kv_refusal_does_not_count_experts_the_engine_moves_off_hbm():
    """Model Runner V2 of vLLM 0.26.0 creates no weight offloader (compat/runner.py): at the first
    attach every expert is still in HBM, and the engine frees them before vLLM sizes the KV cache."""
    gi = GIB
    args = dict(kv_bytes=40 * gi, pool_bytes=30 * gi, total=140 * gi, free=60 * gi, utilization=0.9,
                source="t", bytes_per_token=2**20, max_model_len=4096)  # fmt: skip
    why = kv_refusal(**args)  # 126 cap - 80 in use = 46 GiB left < 70
    assert "80.00 GiB in use at load)" in why
    assert kv_refusal(**args, leaving=27 * gi) is None  # 53 in use: 73 GiB left >= 70
    why = kv_refusal(**args, leaving=10 * gi)
    assert "70.00 GiB in use at load, not counting 10.00 GiB of experts in HBM" in why


def test_experts_leaving_hbm_is_zero_off_the_device():
    import torch

    from reap_swap.engine.residency.budget import experts_leaving_hbm

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w13_weight = torch.nn.Parameter(torch.zeros(4, 8, 2), requires_grad=False)
            self.w2_weight = torch.nn.Parameter(torch.zeros(4, 2, 4), requires_grad=False)

    assert experts_leaving_hbm(Layer(), 26) == 0  # host tensors (the UVA offloader's, or CPU)
    assert experts_leaving_hbm(None, 26) == 0


def test_experts_in_hbm_at_attach_counts_one_layer_under_the_offloader():
    """Run 14 (H200, vLLM 0.26.0, V1 with --cpu-offload-gb): only the attaching layer was in HBM, and
    counting all 12 made the refusal say "-10.96 GiB in use at load" with a --reap-kv-tokens hint
    13.5 GiB too generous. Without an offloader (Model Runner V2) every hooked layer is in HBM."""
    from reap_swap.sizing.memory_split import experts_in_hbm_at_attach

    layer = 9 * 2**20 * 128
    assert experts_in_hbm_at_attach(layer, 12, offloader_active=True) == layer
    assert experts_in_hbm_at_attach(layer, 26, offloader_active=False) == 26 * layer
    assert experts_in_hbm_at_attach(layer, 0, offloader_active=False) == layer
    assert experts_in_hbm_at_attach(0, 26, offloader_active=False) == 0


def test_weight_offloader_active_reads_vllms_offloader():
    pytest.importorskip("vllm")
    from vllm.model_executor.offloader import base

    from reap_swap.compat.runner import weight_offloader_active

    class Offloader(base.BaseOffloader):  # any offloader but the no-op one
        def wrap_modules(self, modules_generator):
            return list(modules_generator)

    before = base.get_offloader()
    try:
        base.set_offloader(None)
        assert weight_offloader_active() is False
        base.set_offloader(Offloader())
        assert weight_offloader_active() is True
    finally:
        base.set_offloader(before)
