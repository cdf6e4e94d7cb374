"""Planner properties: within budget, valid, deterministic, optimal core split, slices from co-activation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reap_swap.plan.document import validate_plan_document
from reap_swap.planner.allocation import find_super_experts
from reap_swap.planner.build import PlannerConfig, PlannerError, build_plan, plan_bytes
from reap_swap.planner.inputs import merge_layer_stats
from reap_swap.planner.observation_types import LayerStats, Observations
from reap_swap.planner.slices import group_by_coactivation
from reap_swap.sizing.model_shape import read_model_shape


def shape_for(layers: int, experts: int, top_k: int):
    return read_model_shape(
        {
            "architectures": ["Qwen3MoeForCausalLM"],
            "num_experts": experts,
            "num_hidden_layers": layers,
            "hidden_size": 64,
            "num_experts_per_tok": top_k,
            "moe_intermediate_size": 32,
            "torch_dtype": "bfloat16",
        }
    )


def routed(rng: np.random.Generator, tokens: int, experts: int, top_k: int, sharpness: float) -> np.ndarray:
    """[tokens, top_k] expert ids from random logits with a per-expert bias (sharpness = peakedness)."""
    bias = rng.normal(size=experts) * sharpness
    logits = rng.normal(size=(tokens, experts)) + bias
    return np.argsort(-logits, axis=1, kind="stable")[:, :top_k]


def stats_from_routing(
    top: np.ndarray,
    experts: int,
    rng: np.random.Generator | None = None,
    *,
    coact: bool = True,
    reap: bool = False,
    max_act: bool = False,
    key: str = "0",
) -> LayerStats:
    freq = np.bincount(top.ravel(), minlength=experts).astype(np.int64)
    c = None
    if coact:
        onehot = np.zeros((top.shape[0], experts), dtype=np.int64)
        np.put_along_axis(onehot, top, 1, axis=1)
        c = onehot.T @ onehot
    rng = rng or np.random.default_rng(0)
    return LayerStats(
        total_tokens=top.shape[0],
        expert_frequency=freq,
        weighted_frequency=freq * rng.uniform(0.2, 0.8, size=experts),
        coactivation=c,
        reap=rng.uniform(0.1, 1.0, size=experts) * (freq > 0) if reap else None,
        max_activations=rng.uniform(1, 5, size=experts) if max_act else None,
        raw_key=key,
    )


def observations(
    layer_stats: dict[int, LayerStats], label="calib", digest="0" * 64, tags=None
) -> Observations:
    return Observations(label=label, digest=digest, layers=layer_stats, tags=tags or {}, fmt="reap-swap")


@st.composite
def scenarios(draw):
    n_layers = draw(st.integers(1, 4))
    experts = draw(st.sampled_from([4, 8, 16]))
    top_k = draw(st.integers(1, min(4, experts)))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    flags = dict(coact=draw(st.booleans()), reap=draw(st.booleans()), max_act=draw(st.booleans()))
    layers = {}
    for i in range(n_layers):
        tokens = draw(st.integers(0, 300))
        layers[i] = stats_from_routing(
            routed(rng, tokens, experts, top_k, draw(st.floats(0, 3))), experts, rng, key=str(i), **flags
        )
    tags = {}
    if draw(st.booleans()):
        tags["code"] = {i: s for i, s in layers.items()}
    ratio = draw(st.floats(0.02, 1.0))
    config = PlannerConfig(
        budget_ratio=ratio,
        core_fraction=draw(st.floats(0, 1)),
        layer_allocation=draw(st.sampled_from(["greedy", "uniform"])),
        slices_per_request=draw(st.integers(1, 3)),
        super_experts=draw(st.booleans()),
        reap_guard=draw(st.booleans()),
    )
    return shape_for(n_layers, experts, top_k), observations(layers, tags=tags), config


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_plan_is_valid_within_budget_and_deterministic(scenario):
    shape, obs, config = scenario
    try:
        doc = build_plan([obs], shape, config, "m")
    except PlannerError as exc:  # only legitimate refusal: super experts that do not fit the core
        assert "super experts" in str(exc)
        return
    report = validate_plan_document(doc, shape)
    assert report.ok, report.format_text()
    pe = shape.expert_bytes
    budget = doc["budget"]
    layers = doc["perLayer"].values()
    core = sum(len(l["coreExperts"]) for l in layers)
    specialist = sum(l["specialistActiveExpertTarget"] for l in layers)
    assert core * pe <= budget["core_budget_bytes"]
    assert (core + specialist) * pe <= budget["swappable_expert_budget_bytes"]
    assert (
        budget["core_budget_bytes"] + budget["specialist_budget_bytes"]
        == budget["swappable_expert_budget_bytes"]
    )
    for layer in doc["perLayer"].values():
        sliced = [e for s in layer.get("sliceCatalog", []) for e in s["experts"]]
        assert len(sliced) == len(set(sliced)), "slices overlap"
        assert not set(sliced) & set(layer["coreExperts"]), "a slice repeats a core expert"
        if layer.get("sliceCatalog"):  # every non-core expert can be requested
            assert set(sliced) | set(layer["coreExperts"]) == set(range(shape.num_experts))
        assert layer["specialistActiveExpertTarget"] <= shape.num_experts - len(layer["coreExperts"])
    # same inputs -> same bytes; identity too
    assert plan_bytes(build_plan([obs], shape, config, "m")) == plan_bytes(doc)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 5), st.sampled_from([4, 8]), st.floats(0.05, 1.0))
def test_greedy_core_split_maximises_covered_selections(seed, n_layers, experts, ratio):
    """No super experts, no guard: the core covers as many routed selections (summed layer shares)
    as the best possible choice of the same number of (layer, expert) slots."""
    rng = np.random.default_rng(seed)
    layers = {
        i: stats_from_routing(routed(rng, 200, experts, 2, rng.uniform(0, 3)), experts, rng, key=str(i))
        for i in range(n_layers)
    }
    shape = shape_for(n_layers, experts, 2)
    doc = build_plan([observations(layers)], shape, PlannerConfig(budget_ratio=ratio, core_fraction=1.0), "m")
    shares = {i: s.expert_frequency / s.expert_frequency.sum() for i, s in layers.items()}
    chosen = sum(shares[int(k[6:])][l["coreExperts"]].sum() for k, l in doc["perLayer"].items())
    n = sum(len(l["coreExperts"]) for l in doc["perLayer"].values())
    best = np.sort(np.concatenate(list(shares.values())))[::-1][:n].sum()
    assert chosen == pytest.approx(best, abs=1e-12)


def test_core_split_differs_across_layers():
    """A peaked layer and a flat layer: at a tight budget the peaked one takes the slots."""
    experts = 16
    peaked = np.array([400, 300, 200, 100] + [0] * 12)
    flat = np.full(experts, 62)
    layers = {0: LayerStats(500, flat, raw_key="0"), 1: LayerStats(500, peaked, raw_key="1")}
    shape = shape_for(2, experts, 2)
    doc = build_plan(
        [observations(layers)], shape, PlannerConfig(budget_ratio=4 / 32, core_fraction=1.0), "m"
    )
    assert doc["perLayer"]["layer_1"]["coreExperts"] == [0, 1, 2, 3]
    assert doc["perLayer"]["layer_0"]["coreExperts"] == []
    uniform = build_plan(
        [observations(layers)],
        shape,
        PlannerConfig(budget_ratio=4 / 32, core_fraction=1.0, layer_allocation="uniform"),
        "m",
    )
    assert [len(l["coreExperts"]) for l in uniform["perLayer"].values()] == [2, 2]


def test_slices_group_experts_that_fire_together():
    """Experts 0-3 always co-fire, 4-7 always co-fire; 8-15 are random. Frequency order interleaves
    them, so frequency buckets would mix the groups; co-activation must not."""
    rng = np.random.default_rng(7)
    rows = []
    for t in range(400):
        if t % 2 == 0:
            rows.append([0, 1, 2, 3] if t % 4 == 0 else [4, 5, 6, 7])
        else:
            rows.append(list(rng.choice(np.arange(8, 16), size=4, replace=False)))
    top = np.array(rows)
    stats = stats_from_routing(top, 16, rng)
    shape = shape_for(1, 16, 4)
    config = PlannerConfig(budget_ratio=0.5, core_fraction=0.0, slice_size=4)
    doc = build_plan([observations({0: stats})], shape, config, "m")
    groups = {tuple(s["experts"]) for s in doc["perLayer"]["layer_0"]["sliceCatalog"]}
    assert (0, 1, 2, 3) in groups and (4, 5, 6, 7) in groups
    scores = {tuple(s["experts"]): s["coactivationScore"] for s in doc["perLayer"]["layer_0"]["sliceCatalog"]}
    assert scores[(0, 1, 2, 3)] == pytest.approx(1.0)
    assert doc["scorerArtifacts"]["sliceMethod"] == "coactivation_greedy_ochiai"
    # without co-activation: documented fallback, consecutive in value order, no coactivationScore
    no_c = LayerStats(stats.total_tokens, stats.expert_frequency, stats.weighted_frequency, raw_key="0")
    doc2 = build_plan([observations({0: no_c})], shape, config, "m")
    assert doc2["scorerArtifacts"]["sliceMethod"] == "frequency_rank_buckets"
    assert all("coactivationScore" not in s for s in doc2["perLayer"]["layer_0"]["sliceCatalog"])
    order = sorted(range(16), key=lambda e: (-no_c.expert_frequency[e], -no_c.weighted_frequency[e], e))
    expected = {tuple(sorted(order[k : k + 4])) for k in range(0, 16, 4)}
    assert {tuple(s["experts"]) for s in doc2["perLayer"]["layer_0"]["sliceCatalog"]} == expected


def test_group_by_coactivation_is_greedy_by_mean_affinity():
    aff = np.zeros((5, 5))
    aff[0, 3] = aff[3, 0] = 0.9
    aff[0, 1] = aff[1, 0] = 0.5
    aff[3, 4] = aff[4, 3] = 0.8
    assert group_by_coactivation([0, 1, 2, 3, 4], aff, 3) == [[0, 3, 4], [1, 2]]


def test_super_experts_are_always_core_and_reap_guard_is_capped():
    rng = np.random.default_rng(3)
    experts = 16
    layers = {}
    for i in range(4):
        s = stats_from_routing(
            routed(rng, 300, experts, 2, 2.0), experts, rng, reap=True, max_act=True, key=str(i)
        )
        layers[i] = s
    # plant a super expert: a never-frequent expert with a huge max activation in layer 2
    freq2 = layers[2].expert_frequency
    rare = int(np.argmin(freq2))
    layers[2].max_activations[rare] = 1000.0
    assert find_super_experts(layers, 99.5, 10.0) == {2: [rare]}
    # plant a REAP outlier in layer 1: routed, but rarely, with huge saliency
    freq1 = layers[1].expert_frequency
    rare1 = int(np.flatnonzero(freq1 > 0)[np.argmin(freq1[freq1 > 0])])
    layers[1].reap[:] = 0.1
    layers[1].reap[rare1] = 50.0
    shape = shape_for(4, experts, 2)
    doc = build_plan([observations(layers)], shape, PlannerConfig(budget_ratio=0.25, core_fraction=1.0), "m")
    assert rare in doc["perLayer"]["layer_2"]["coreExperts"]
    assert doc["scorerArtifacts"]["superExperts"] == {"layer_2": [rare]}
    assert rare1 in doc["perLayer"]["layer_1"]["coreExperts"]
    guarded = sum(len(v) for v in doc["scorerArtifacts"]["reapGuarded"].values())
    assert 1 <= guarded <= int(0.1 * 16)
    off = build_plan(
        [observations(layers)],
        shape,
        PlannerConfig(budget_ratio=0.25, core_fraction=1.0, super_experts=False, reap_guard=False),
        "m",
    )
    assert rare not in off["perLayer"]["layer_2"]["coreExperts"]
    assert off["scorerArtifacts"]["reapGuarded"] == {}
    with pytest.raises(PlannerError, match="super experts"):
        build_plan([observations(layers)], shape, PlannerConfig(budget_ratio=0.01), "m")


def test_merge_reweights_reap_by_frequency_and_sums_counts():
    a = LayerStats(10, np.array([10, 10]), reap=np.array([1.0, 2.0]), max_activations=np.array([1.0, 5.0]))
    b = LayerStats(30, np.array([30, 30]), reap=np.array([3.0, 2.0]), max_activations=np.array([4.0, 2.0]))
    m = merge_layer_stats([a, b])
    assert m.total_tokens == 40 and list(m.expert_frequency) == [40, 40]
    assert m.reap == pytest.approx([2.5, 2.0])
    assert list(m.max_activations) == [4.0, 5.0]
    c = LayerStats(5, np.array([5, 5]))  # no reap: merged field would be biased, so it is dropped
    assert merge_layer_stats([a, c]).reap is None


def test_two_files_and_tags_feed_summaries_and_priors():
    rng = np.random.default_rng(11)
    shape = shape_for(2, 8, 2)
    code = {i: stats_from_routing(routed(rng, 100, 8, 2, 2.0), 8, rng, key=str(i)) for i in range(2)}
    prose = {i: stats_from_routing(routed(rng, 100, 8, 2, 2.0), 8, rng, key=str(i)) for i in range(2)}
    a = observations(code, "a", "1" * 64, tags={"code": code})
    b = observations(prose, "b", "2" * 64, tags={"prose": prose})
    doc = build_plan([a, b], shape, PlannerConfig(budget_ratio=0.5), "m")
    assert validate_plan_document(doc, shape).ok
    assert [s["label"] for s in doc["sourceSummaries"]] == ["a", "b"]
    assert [x["sha256"] for x in doc["scorerArtifacts"]["inputs"]] == ["1" * 64, "2" * 64]
    sl = doc["perLayer"]["layer_0"]["sliceCatalog"][0]
    assert set(sl["signalsBySummary"]) == {"a", "b"}
    assert set(sl["taskPriors"]) == {"global", "code", "prose"}
    assert set(doc["scorerArtifacts"]["taskFamilySlicePriors"]) == {"global", "code", "prose"}
    # merged counts: core mass is measured on the sum of both files
    merged = code[0].expert_frequency + prose[0].expert_frequency
    core = doc["perLayer"]["layer_0"]["coreExperts"]
    assert doc["perLayer"]["layer_0"]["coreActivationMass"] == pytest.approx(
        merged[core].sum() / merged.sum(), abs=1e-8
    )
    with pytest.raises(PlannerError, match="twice"):
        build_plan([a, a], shape, PlannerConfig(budget_ratio=0.5), "m")


def test_refuses_observations_of_another_model():
    rng = np.random.default_rng(0)
    layers = {i: stats_from_routing(routed(rng, 50, 8, 2, 1.0), 8, rng, key=str(i)) for i in range(2)}
    with pytest.raises(PlannerError, match="missing"):
        build_plan([observations(layers)], shape_for(3, 8, 2), PlannerConfig(budget_ratio=0.5), "m")
    with pytest.raises(PlannerError, match="experts"):
        build_plan([observations(layers)], shape_for(2, 16, 2), PlannerConfig(budget_ratio=0.5), "m")


def test_config_needs_exactly_one_budget():
    with pytest.raises(ValueError):
        PlannerConfig()
    with pytest.raises(ValueError):
        PlannerConfig(budget_ratio=0.3, budget_gib=1.0)
    assert PlannerConfig(budget_gib=1.0).budget_gib == 1.0


def test_budget_gib_and_parameters_are_recorded():
    rng = np.random.default_rng(0)
    layers = {i: stats_from_routing(routed(rng, 50, 8, 2, 1.0), 8, rng, key=str(i)) for i in range(2)}
    shape = shape_for(2, 8, 2)
    gib = 6 * shape.expert_bytes / (1 << 30)
    doc = build_plan([observations(layers)], shape, PlannerConfig(budget_gib=gib, core_fraction=0.5), "m")
    assert doc["budget"]["swappable_expert_budget_bytes"] == int(6 * shape.expert_bytes)
    assert doc["scorerArtifacts"]["parameters"]["budget_gib"] == gib
    assert doc["scorerArtifacts"]["parameters"]["core_fraction"] == 0.5
    assert sum(len(l["coreExperts"]) for l in doc["perLayer"].values()) == 3
    # within a layer the core is a top set by frequency: no left-out expert is routed more often
    for key, layer in doc["perLayer"].items():
        freq = layers[int(key[6:])].expert_frequency
        core = layer["coreExperts"]
        rest = sorted(set(range(8)) - set(core))
        if core:
            assert freq[core].min() >= freq[rest].max()
