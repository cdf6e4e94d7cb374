"""Group-aware planning (`reap-swap plan --group-size`): prices, whole groups, budget, schema, status."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import orjson
import pytest
from test_planner import observations, routed, stats_from_routing

from reap_swap.cli import plan as plan_cmd
from reap_swap.cli.main import main
from reap_swap.plan.document import load_plan, validate_plan_document
from reap_swap.planner.allocation import layer_work
from reap_swap.planner.build import PlannerConfig, PlannerError, build_plan, plan_bytes
from reap_swap.planner.groups import allocate_core_grouped, group_pricing, round_forced_to_groups
from reap_swap.server.swap_report import group_size_report
from reap_swap.sizing.groups import plan_groups, plan_permutations, set_cost
from reap_swap.sizing.model_shape import read_model_shape

MiB = 2**20
ROOT = Path(__file__).resolve().parents[1]
MINI_PLAN = ROOT / "plans" / "reap-mini-moe.plan.json"
FIXTURE = ROOT.parent / "shared" / "fixtures" / "strict30-v2-plan.json"


def qwen30b(quant: dict | None = None, layers: int = 4, experts: int = 16):
    """Qwen3-30B-A3B expert shape (hidden 2048, moe_intermediate 768), few layers and experts."""
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "num_experts": experts,
        "num_hidden_layers": layers,
        "hidden_size": 2048,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 768,
        "torch_dtype": "bfloat16",
    }
    if quant:
        config["quantization_config"] = quant
    return read_model_shape(config)


FP8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
INT4 = {"quant_method": "awq", "bits": 4, "group_size": 128}


def obs_for(layers: int = 4, experts: int = 16, seed: int = 0, **kw):
    rng = np.random.default_rng(seed)
    stats = {
        i: stats_from_routing(routed(rng, 3000, experts, 2, 1.5), experts, rng, key=str(i), **kw)
        for i in range(layers)
    }
    return observations(stats)


def plan_doc(shape, group_size, ratio=0.5, seed=0, **config):
    obs = obs_for(len(shape.moe_layers), shape.num_experts, seed)
    return build_plan([obs], shape, PlannerConfig(budget_ratio=ratio, group_size=group_size, **config), "m")


# -- prices -------------------------------------------------------------------------------------
def test_prices_follow_the_engine_layout():
    fp8, bf16 = qwen30b(FP8), qwen30b()
    p = group_pricing(fp8, "auto")  # FP8 4.5 MiB: b = 2, strides 3 + 2 MiB -> 10 MiB per pair
    assert (p.group_size, p.group_bytes, p.bytes_per_expert) == (2, 10 * MiB, 5 * MiB)
    p4 = group_pricing(fp8, "4")  # exact: 18 MiB per 4
    assert (p4.group_bytes, p4.bytes_per_expert) == (18 * MiB, 4.5 * MiB)
    b1 = group_pricing(bf16, "auto")  # bf16 9 MiB: auto b = 1, the private 10 MiB unit
    assert (b1.group_size, b1.group_bytes) == (1, 10 * MiB)
    assert group_pricing(bf16, "4").bytes_per_expert == 9 * MiB
    i4 = group_pricing(qwen30b(INT4), "auto")  # contiguous (Marlin / moe_wna16): b = 8, whole pages
    assert (i4.group_size, i4.group_bytes, i4.bytes_per_expert) == (8, 18 * MiB, 2.25 * MiB)
    with pytest.raises(PlannerError, match="contiguous kernel: .*whole pages"):
        group_pricing(qwen30b(INT4), "4")  # w2 4 x 0.75 MiB = 3 MiB: not whole pages
    with pytest.raises(PlannerError, match="not whole groups of 4"):
        group_pricing(qwen30b(FP8, experts=6), "4")
    with pytest.raises(PlannerError, match="expected one of"):
        group_pricing(fp8, "3")


# -- the plan: whole groups, the budget in grouped HBM -------------------------------------------
@pytest.mark.parametrize(("group_size", "b"), [("auto", 2), ("2", 2), ("4", 4), ("8", 8)])
@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75])
def test_cores_and_slices_are_whole_groups_within_the_grouped_budget(group_size, b, ratio):
    shape = qwen30b(FP8)
    doc = plan_doc(shape, group_size, ratio)
    report = validate_plan_document(doc, shape)
    assert report.ok, report.format_text()
    assert not report.warnings, report.format_text()
    assert doc["groupSize"] == b
    budget = doc["budget"]
    gb = budget["group_hbm_bytes"]
    assert gb == group_pricing(shape, group_size).group_bytes
    core_groups = spec_groups = 0
    for layer in doc["perLayer"].values():
        assert len(layer["coreExperts"]) % b == 0
        assert all(len(s["experts"]) % b == 0 for s in layer.get("sliceCatalog", []))
        assert layer["specialistActiveExpertTarget"] % b == 0
        core_groups += len(layer["coreExperts"]) // b
        spec_groups += layer["specialistActiveExpertTarget"] // b
    assert core_groups * gb <= budget["core_budget_bytes"]
    assert (core_groups + spec_groups) * gb <= budget["swappable_expert_budget_bytes"]
    # the budget is spent: fewer than one group left of the core budget (16 x 4 experts is room)
    assert budget["core_budget_bytes"] - core_groups * gb < gb
    # and what the grouped engine really takes: no passenger anywhere, HBM = wanted x group price
    plan = load_plan(doc, shape)
    perms = plan_permutations(plan)
    fmt = shape.expert_format
    layout = plan_groups((("w13_weight", fmt.w13), ("w2_weight", fmt.w2)), shape.num_experts, b)
    for index, lp in plan.layers.items():
        for n in range(len(lp.slices) + 1):
            wanted = [*lp.core, *(e for s in lp.slices[:n] for e in s.experts)]
            cost = set_cost(wanted, perms[index], layout)
            assert cost.resident == cost.wanted
            assert cost.hbm_bytes == cost.wanted * gb // b


def test_without_group_size_the_plan_is_todays():
    shape = qwen30b(FP8)
    doc = plan_doc(shape, None)
    assert "groupSize" not in doc and "group_hbm_bytes" not in doc["budget"]
    assert "group_size" not in doc["scorerArtifacts"]["parameters"]
    assert "grouping" not in doc["scorerArtifacts"]
    assert load_plan(doc, shape).group_size == 1
    # priced at checkpoint bytes: more experts than the grouped plan of the same budget
    grouped = plan_doc(shape, "auto")
    assert doc["summary"]["totalCoreExperts"] > grouped["summary"]["totalCoreExperts"]
    assert grouped["scorerArtifacts"]["parameters"]["group_size"] == "auto"


def test_grouped_core_is_each_layers_value_prefix_greedy_by_group_value():
    """Without forced experts, each layer's core is the first k x b of its value order, and the
    split across layers is the greedy one over groups (optimal: per-layer group values decrease)."""
    shape = qwen30b(FP8)
    obs = obs_for()
    for seed in range(3):
        obs = obs_for(seed=seed)
        cfg = PlannerConfig(budget_ratio=0.4, group_size="2")
        doc = build_plan([obs], shape, cfg, "m")
        work = layer_work(obs.layers, "frequency")
        covered = 0.0
        for i, w in work.items():
            core = doc["perLayer"][f"layer_{i}"]["coreExperts"]
            assert set(core) == set(w.order[: len(core)])
            covered += float(w.values[core].sum())
        # brute force over every split of the same number of groups
        groups = sum(len(v["coreExperts"]) for v in doc["perLayer"].values()) // 2
        best = _best_split({i: w.values[w.order] for i, w in work.items()}, groups, 2)
        assert covered == pytest.approx(best)


def _best_split(sorted_values: dict, groups: int, b: int) -> float:
    layers = list(sorted_values)
    best = {0: 0.0}  # groups used -> best value over the layers so far
    for i in layers:
        v = sorted_values[i]
        gains = [float(v[: k * b].sum()) for k in range(len(v) // b + 1)]
        nxt: dict[int, float] = {}
        for used, val in best.items():
            for k, g in enumerate(gains):
                if used + k <= groups:
                    nxt[used + k] = max(nxt.get(used + k, -1.0), val + g)
        best = nxt
    return best[groups]


def test_forced_experts_open_groups_filled_by_the_next_best():
    obs = obs_for()
    work = layer_work(obs.layers, "frequency")
    w0 = work[0]
    forced = w0.order[-1]  # the layer's least valuable expert, forced (as a super expert would be)
    w0.core.add(forced)
    added = round_forced_to_groups(work, 4)
    assert added == {0: w0.order[:3]}  # its group is completed by the layer's three best
    assert all(len(w.core) % 4 == 0 for w in work.values())
    allocate_core_grouped(work, 16, False, 4)
    assert sum(len(w.core) for w in work.values()) == 16
    with pytest.raises(PlannerError, match="rounded to groups of 4"):
        allocate_core_grouped(work, 12, False, 4)


def test_super_experts_join_the_core_in_whole_groups():
    shape = qwen30b(FP8)
    rng = np.random.default_rng(1)
    stats = {}
    for i in range(4):
        s = stats_from_routing(routed(rng, 3000, 16, 2, 1.5), 16, rng, key=str(i), max_act=True)
        if i == 2:
            s.max_activations[int(np.argmin(s.expert_frequency))] = 1e4  # a super expert, rarely routed
        stats[i] = s
    doc = build_plan([observations(stats)], shape, PlannerConfig(budget_ratio=0.5, group_size="2"), "m")
    assert validate_plan_document(doc, shape).ok
    supers = doc["scorerArtifacts"]["superExperts"]["layer_2"]
    assert set(supers) <= set(doc["perLayer"]["layer_2"]["coreExperts"])
    assert all(len(v["coreExperts"]) % 2 == 0 for v in doc["perLayer"].values())


def test_explicit_slice_size_must_be_whole_groups():
    with pytest.raises(PlannerError, match="--slice-size 3 is not a multiple"):
        plan_doc(qwen30b(FP8), "2", slice_size=3)
    doc = plan_doc(qwen30b(FP8), "2", slice_size=4)
    sizes = {len(s["experts"]) for v in doc["perLayer"].values() for s in v.get("sliceCatalog", [])}
    assert max(sizes) == 4 and all(n % 2 == 0 for n in sizes)  # a layer's last slice: the even rest


def test_uniform_allocation_in_groups():
    doc = plan_doc(qwen30b(FP8), "2", layer_allocation="uniform")
    # core budget 0.375 x 64 x 4.5 MiB = 108 MiB = 10 groups of 10 MiB: 3, 3, 2, 2 groups per layer
    assert [len(doc["perLayer"][f"layer_{i}"]["coreExperts"]) for i in range(4)] == [6, 6, 4, 4]


# -- schema, validation, round trip -------------------------------------------------------------
def test_schema_round_trip_and_old_plans(tmp_path):
    shape = qwen30b(FP8)
    doc = plan_doc(shape, "auto")
    path = tmp_path / "p.json"
    path.write_bytes(plan_bytes(doc))
    plan = load_plan(path, shape)
    assert plan.group_size == 2 and plan.document["groupSize"] == 2
    assert plan_bytes(orjson.loads(path.read_bytes())) == path.read_bytes()
    # old plans: no groupSize, still valid, read as 1
    old = load_plan(MINI_PLAN)
    assert old.group_size == 1 and "groupSize" not in old.document
    bad = dict(doc, groupSize=3)
    report = validate_plan_document(bad, shape)
    assert not report.ok and any(i.path == "groupSize" for i in report.errors)


def test_validation_names_passengers_and_grouped_budget_overruns():
    shape = qwen30b(FP8)
    doc = orjson.loads(plan_bytes(plan_doc(shape, "2")))
    layer = doc["perLayer"]["layer_0"]
    layer["coreExperts"] = layer["coreExperts"][:-1]  # odd core: a passenger, not an error
    layer["coreByteCost"] = len(layer["coreExperts"]) * doc["budget"]["per_expert_bytes"]
    doc["summary"]["totalCoreExperts"] -= 1
    report = validate_plan_document(doc, shape)
    assert report.ok
    assert [w.path for w in report.warnings] == ["perLayer.layer_0.coreExperts"]
    assert "boundary group carries a passenger" in report.warnings[0].message
    over = orjson.loads(plan_bytes(doc))
    over["budget"]["core_budget_bytes"] = over["budget"]["group_hbm_bytes"]  # one group of core budget
    report = validate_plan_document(over, shape)
    assert any(i.path == "budget.core_budget_bytes" and "groups of 2" in i.message for i in report.errors)
    wrong = orjson.loads(plan_bytes(doc))
    wrong["budget"]["group_hbm_bytes"] = 8 * MiB  # cheaper than the engine's 10 MiB
    report = validate_plan_document(wrong, shape)
    assert [i.path for i in report.errors] == ["budget.group_hbm_bytes"]
    assert validate_plan_document(wrong).ok  # without a model there is nothing to compare it with


def test_validate_cli_accepts_a_grouped_plan(tmp_path, capsys):
    shape = qwen30b(FP8)
    path = tmp_path / "p.json"
    path.write_bytes(plan_bytes(plan_doc(shape, "auto")))
    assert main(["validate", str(path)]) == 0
    assert "0 warning(s)" in capsys.readouterr().out
    doc = orjson.loads(path.read_bytes())
    doc["groupSize"] = 16
    path.write_bytes(orjson.dumps(doc))
    assert main(["validate", str(path)]) == 1
    assert "groupSize" in capsys.readouterr().out


def test_plan_command_parses_group_size():
    parser = argparse.ArgumentParser()
    plan_cmd.add_arguments(parser)
    base = ["--observations", "o.pt", "--model", "m", "--budget-ratio", "0.5", "--out", "p.json"]
    assert parser.parse_args(base).group_size is None
    assert parser.parse_args([*base, "--group-size", "auto"]).group_size == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--group-size", "3"])


# -- /reap/status: the plan's groupSize against the engine's b -----------------------------------
def test_status_group_size_report():
    grouped = {"layers_rehomed": [0, 1], "layouts": {"0": {"group_size": 2}, "1": {"group_size": 2}}}
    assert group_size_report(2, [grouped]) == {
        "plan": 2,
        "engine": {"0": 2, "1": 2},
        "matches": True,
        "warning": None,
    }
    private = {"layers_rehomed": [0, 1, 2]}  # default --reap-group-size 1: no layouts
    out = group_size_report(2, [private])
    assert out["matches"] is False and "b = 1 on layers 0..2" in out["warning"]
    out = group_size_report(1, [grouped])  # an old plan on a grouped engine: warned, not refused
    assert out["matches"] is False and "groups of 1" in out["warning"]
    assert group_size_report(1, [private])["warning"] is None
    assert group_size_report(1, [{}]) == {"plan": 1, "engine": {}, "matches": None, "warning": None}
    assert "not checked" in group_size_report(2, [{}])["warning"]


def test_reap_status_carries_the_group_size_report():
    from fastapi.testclient import TestClient
    from test_routes import make_app

    app, _, _ = make_app()
    with TestClient(app) as c:
        report = c.get("/reap/status").json()["group_size"]
    assert report["plan"] == 1 and report["warning"] is None


def test_int4_plans_in_whole_contiguous_groups_of_eight():
    doc = plan_doc(qwen30b(INT4), "auto")
    assert doc["groupSize"] == 8 and doc["budget"]["group_hbm_bytes"] == 18 * MiB
    cores = [len(layer["coreExperts"]) for layer in doc["perLayer"].values()]
    assert cores and all(c % 8 == 0 for c in cores) and sum(cores) > 0
