"""reap-swap plan --cache-tail (issue 17): the core capped so the device cache's pinned form keeps N
tail slots per layer (core <= budget slots - layers x N, a layer's core <= experts - N); 0 is today's
planner byte for byte."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from script_modules import load_research

from reap_swap.cache.trace import load_trace
from reap_swap.cli.plan import cache_tail_value
from reap_swap.plan.document import load_plan, validate_plan_document
from reap_swap.planner.allocation import core_caps, tail_core_limit
from reap_swap.planner.build import PlannerConfig, PlannerError, build_plan, plan_bytes
from reap_swap.planner.observation_types import LayerStats, Observations
from reap_swap.sizing.cache_tail import pinned_tail_split
from reap_swap.sizing.model_shape import read_model_shape
from tests.test_planner import shape_for

ROOT = Path(__file__).resolve().parents[1]


def zipf_layers(n_layers: int, experts: int, peaks: list[float], seed: int = 0) -> dict[int, LayerStats]:
    """Frequencies ~ rank^-peak per layer (a larger peak: a more peaked layer), random permutation."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(n_layers):
        freq = (1000.0 / np.arange(1, experts + 1) ** peaks[i]).astype(np.int64) + 1
        out[i] = LayerStats(total_tokens=500, expert_frequency=rng.permutation(freq), raw_key=str(i))
    return out


def obs(layers) -> Observations:
    return Observations(label="calib", digest="0" * 64, layers=layers, tags={}, fmt="reap-swap")


def plan(layers, shape, **kw) -> dict:
    doc = build_plan([obs(layers)], shape, PlannerConfig(**kw), "m")
    report = validate_plan_document(doc, shape)
    assert report.ok, report.format_text()
    return doc


def cores(doc) -> dict[int, int]:
    return {int(k.removeprefix("layer_")): len(v["coreExperts"]) for k, v in doc["perLayer"].items()}


def pinned_tail(doc) -> int:
    """The tail the device cache's pinned form would lend per layer on this plan's pool (auto)."""
    p = load_plan(doc)
    pool = p.swappable_budget_bytes // p.per_expert_bytes
    per_layer, _ = pinned_tail_split(pool, len(p.layers), p.core_sets(), "auto")
    return per_layer


def test_limit_and_caps():
    assert tail_core_limit(192, 12, 16) == 0 and tail_core_limit(384, 12, 16) == 192
    assert tail_core_limit(10, 3, 4) == 0  # a budget below layers x tail: no core
    assert core_caps([0, 1, 2], 4, 16) == {0: 12, 1: 12, 2: 12}
    assert core_caps([5], 20, 16) == {5: 0}  # a layer with fewer experts than the tail: no core


def test_cap_leaves_the_tail_and_keeps_the_greedy_prefix():
    # 2 layers x 16 experts, top-2, 50 %: 16 slots; a 0.75 core = 12 split greedily, the peaked
    # layer 1 taking most of it; the pinned form's tail (16 - 12) // 2 = 2
    shape = shape_for(2, 16, 2)
    layers = zipf_layers(2, 16, [0.2, 2.5])
    old = plan(layers, shape, budget_ratio=0.5)
    assert sum(cores(old).values()) == 12 and pinned_tail(old) == 2
    doc = plan(layers, shape, budget_ratio=0.5, cache_tail=3)
    assert sum(cores(doc).values()) == 10 and pinned_tail(doc) == 3  # 16 - 2 x 3
    # the capped core is the greedy core's best part: a subset, layer by layer
    for k, v in doc["perLayer"].items():
        assert set(v["coreExperts"]) <= set(old["perLayer"][k]["coreExperts"])
    assert cores(doc)[1] != cores(doc)[0]  # still split by value across layers, not evenly
    rec = doc["scorerArtifacts"]["cacheTail"]
    assert rec["coreLimit"] == 10 and rec["coreCap"] == {"layer_0": 13, "layer_1": 13}
    assert rec["coreSlotsBeforeCap"] == 12 and rec["coreSlots"] == 10 and rec["pinnedFormTailPerLayer"] == 3
    assert doc["scorerArtifacts"]["parameters"]["cache_tail"] == 3
    # the two freed core slots went to the specialists; the budget adds up
    b, pe = doc["budget"], shape.expert_bytes
    assert b["core_budget_bytes"] == 10 * pe and b["specialist_budget_bytes"] == 6 * pe
    assert b["core_budget_bytes"] + b["specialist_budget_bytes"] == b["swappable_expert_budget_bytes"]
    assert b["core_budget_fraction"] == 0.625 and b["specialist_budget_fraction"] == 0.375
    assert doc["scorerArtifacts"]["slots"]["specialist"] == 6
    assert sum(v["specialistActiveExpertTarget"] for v in doc["perLayer"].values()) == 6
    # fillOrder: every non-core expert once, none of the core
    fo = {tuple(x) for x in doc["fillOrder"]}
    assert len(fo) == len(doc["fillOrder"]) == 32 - 10
    assert not any((l, e) in fo for l in (0, 1) for e in doc["perLayer"][f"layer_{l}"]["coreExperts"])


def test_cap_per_layer():
    # 2 layers x 8 experts, everything resident (16 slots), tail 3: limit 10, at most 5 per layer,
    # though the greedy order would give the flat layer 0 more (its experts each carry more of it)
    shape = shape_for(2, 8, 2)
    layers = zipf_layers(2, 8, [0.1, 3.0], seed=7)
    free = plan(layers, shape, budget_ratio=1.0, core_fraction=0.625)
    assert max(cores(free).values()) > 5
    doc = plan(layers, shape, budget_ratio=1.0, core_fraction=0.625, cache_tail=3)
    assert cores(doc) == {0: 5, 1: 5} and pinned_tail(doc) == 3


def test_auto_is_twice_top_k():
    assert PlannerConfig(budget_ratio=0.5, cache_tail="auto").tail_slots(8) == 16
    shape = shape_for(2, 16, 2)
    doc = plan(zipf_layers(2, 16, [0.2, 2.5]), shape, budget_ratio=0.5, cache_tail="auto")
    rec = doc["scorerArtifacts"]["cacheTail"]
    assert rec["setting"] == "auto" and rec["tailSlotsPerLayer"] == 4 and rec["topK"] == 2
    assert sum(cores(doc).values()) == 8 and pinned_tail(doc) == 4
    assert doc["scorerArtifacts"]["parameters"]["cache_tail"] == "auto"


def test_zero_is_todays_plan_byte_for_byte():
    shape = shape_for(3, 16, 2)
    layers = zipf_layers(3, 16, [0.3, 1.0, 2.0], seed=1)
    for ratio in (0.125, 0.5):
        default = plan_bytes(build_plan([obs(layers)], shape, PlannerConfig(budget_ratio=ratio), "m"))
        zero = plan_bytes(
            build_plan([obs(layers)], shape, PlannerConfig(budget_ratio=ratio, cache_tail=0), "m")
        )
        assert zero == default
        assert b"cache_tail" not in zero and b"cacheTail" not in zero


def test_zero_rebuilds_the_committed_plans_as_they_are():
    """The committed skew12h200 plans (made before --cache-tail existed, research-notes/cache-sim/
    skew12h200/README.md) come back byte for byte from the calibration trace with cache_tail 0,
    up to the input file's record (in-memory observations here, a .pt file there)."""
    skew = load_research("record_skew_trace")
    d = ROOT / "research-notes/cache-sim/skew12h200"
    calib = load_trace(d / "skew-calibration.npz")
    shape = read_model_shape(
        {
            "architectures": ["Qwen3MoeForCausalLM"],
            "num_experts": 128,
            "num_hidden_layers": 12,
            "hidden_size": 2048,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 768,
            "torch_dtype": "bfloat16",
        }
    )
    o = Observations(
        label=".calibration-prefill",
        digest="0" * 64,
        layers=skew.prefill_layer_stats(calib),
        tags={},
        fmt="reap-swap",
    )
    for ratio in ("0.125", "0.25", "0.5"):
        committed = (d / f"plan-{ratio}.json").read_bytes()
        old = orjson.loads(committed)
        doc = build_plan([o], shape, PlannerConfig(budget_ratio=float(ratio), cache_tail=0), "skew-kit")
        doc["scorerArtifacts"]["inputs"] = old["scorerArtifacts"]["inputs"]
        doc["sourceSummaries"] = old["sourceSummaries"]
        assert plan_bytes(doc) == committed, ratio


def test_budget_below_the_tail_gives_empty_cores_and_a_sane_plan():
    # 4 layers x 16 experts, top-2, 12.5 %: 8 slots, 2 per layer < auto's 4: no core anywhere
    shape = shape_for(4, 16, 2)
    layers = zipf_layers(4, 16, [0.5, 1.0, 1.5, 2.0], seed=2)
    doc = plan(layers, shape, budget_ratio=0.125, cache_tail="auto")
    assert cores(doc) == {0: 0, 1: 0, 2: 0, 3: 0}
    b = doc["budget"]
    assert b["core_budget_bytes"] == 0 and b["core_budget_fraction"] == 0.0
    assert b["specialist_budget_bytes"] == b["swappable_expert_budget_bytes"] == 8 * shape.expert_bytes
    assert sum(v["specialistActiveExpertTarget"] for v in doc["perLayer"].values()) == 8
    rec = doc["scorerArtifacts"]["cacheTail"]
    assert rec["pinnedFormTailPerLayer"] == 2 and rec["coreSlots"] == 0
    notes = doc["scorerArtifacts"]["notes"]
    assert any("fewer than 4 layers x 4" in n and "the core is empty" in n for n in notes)
    # every layer's experts remain requestable in slices, and the pinned form still engages
    for v in doc["perLayer"].values():
        assert sorted(e for s in v["sliceCatalog"] for e in s["experts"]) == list(range(16))
    assert pinned_tail(doc) == 2
    assert load_plan(doc).core_bytes() == 0


def test_uniform_allocation_respects_the_caps_and_spends_the_budget():
    shape = shape_for(3, 16, 2)
    layers = zipf_layers(3, 16, [0.3, 1.0, 2.0], seed=3)
    # 37.5 %: 18 slots; tail 4 -> a core of 18 - 12 = 6, uniform: 2 per layer (asked: 13)
    doc = plan(layers, shape, budget_ratio=0.375, cache_tail=4, layer_allocation="uniform")
    assert cores(doc) == {0: 2, 1: 2, 2: 2}
    b = doc["budget"]
    assert b["core_budget_bytes"] == 6 * shape.expert_bytes
    assert b["core_budget_bytes"] + b["specialist_budget_bytes"] == b["swappable_expert_budget_bytes"]
    assert pinned_tail(doc) == 4


def test_super_experts_stay_over_the_cap_with_a_note():
    shape = shape_for(2, 16, 2)
    layers = zipf_layers(2, 16, [1.0, 1.0], seed=4)
    spikes = np.ones(16)
    spikes[9] = 1000.0  # a super expert in layer 1
    layers = {
        0: replace(layers[0], max_activations=np.ones(16)),
        1: replace(layers[1], max_activations=spikes),
    }
    doc = plan(layers, shape, budget_ratio=0.25, cache_tail=4)  # 8 slots - 2 x 4: limit 0
    assert doc["scorerArtifacts"]["superExperts"] == {"layer_1": [9]}
    assert doc["perLayer"]["layer_1"]["coreExperts"] == [9]
    assert cores(doc) == {0: 0, 1: 1}
    assert doc["scorerArtifacts"]["cacheTail"]["coreLimit"] == 1
    assert any("super experts stay in the core" in n for n in doc["scorerArtifacts"]["notes"])
    # one over a layer's cap (experts - tail) too
    small = plan(layers, shape, budget_ratio=1.0, core_fraction=0.25, cache_tail=16)  # caps 0
    assert small["perLayer"]["layer_1"]["coreExperts"] == [9] and cores(small)[0] == 0
    assert any("super experts stay in its core" in n for n in small["scorerArtifacts"]["notes"])
    # a budget whose whole core cannot hold them is still refused by name
    with pytest.raises(PlannerError, match="super experts"):
        build_plan(
            [obs(layers)], shape, PlannerConfig(budget_ratio=0.0625, core_fraction=0.1, cache_tail=4), "m"
        )


def test_reap_guard_respects_the_cap():
    shape = shape_for(2, 16, 2)
    layers = zipf_layers(2, 16, [1.5, 1.5], seed=5)
    rare = int(np.argmin(layers[0].expert_frequency))
    salient = np.full(16, 0.1)
    salient[rare] = 50.0
    layers = {0: replace(layers[0], reap=salient), 1: replace(layers[1], reap=np.full(16, 0.1))}
    free = plan(layers, shape, budget_ratio=0.5, core_fraction=1.0)
    assert free["scorerArtifacts"]["reapGuarded"] == {"layer_0": [rare]}  # the guard fires uncapped
    doc = plan(layers, shape, budget_ratio=0.5, core_fraction=1.0, cache_tail=6)  # 16 - 12: limit 4
    assert sum(cores(doc).values()) == 4 and pinned_tail(doc) == 6
    assert doc["scorerArtifacts"]["reapGuarded"] in ({}, {"layer_0": [rare]})


def test_refusals_and_cli_values():
    with pytest.raises(ValidationError, match="cache_tail"):
        PlannerConfig(budget_ratio=0.5, cache_tail=-1)
    with pytest.raises(ValidationError, match="grouped engine refuses the device cache"):
        PlannerConfig(budget_ratio=0.5, cache_tail="auto", group_size="2")
    assert cache_tail_value("auto") == "auto" and cache_tail_value("16") == 16 and cache_tail_value("0") == 0
    for bad in ("-1", "many", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            cache_tail_value(bad)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(1, 4),
    st.sampled_from([8, 16]),
    st.integers(1, 4),
    st.floats(0.05, 1.0),
    st.integers(0, 12),
    st.sampled_from(["greedy", "uniform"]),
    st.integers(0, 2**31),
)
def test_every_layer_within_its_cap_and_the_budget_spent(n_layers, experts, top_k, ratio, tail, alloc, seed):
    rng = np.random.default_rng(seed)
    shape = shape_for(n_layers, experts, top_k)
    layers = zipf_layers(n_layers, experts, list(rng.uniform(0, 3, n_layers)), seed=seed)
    doc = plan(layers, shape, budget_ratio=ratio, cache_tail=tail, layer_allocation=alloc)
    pe = shape.expert_bytes
    total = doc["budget"]["swappable_expert_budget_bytes"] // pe
    assert all(n <= max(0, experts - tail) for n in cores(doc).values())
    if tail:
        assert sum(cores(doc).values()) <= tail_core_limit(total, n_layers, tail)
    b = doc["budget"]
    assert b["core_budget_bytes"] + b["specialist_budget_bytes"] == b["swappable_expert_budget_bytes"]
    core = sum(cores(doc).values())
    assert core * pe <= b["core_budget_bytes"]
    if tail == 0:
        assert "cacheTail" not in doc["scorerArtifacts"]
    elif total >= n_layers * tail:  # the budget can give every layer its tail: the pinned form does
        assert (total - core) // n_layers >= tail
