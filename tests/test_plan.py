"""plan: schema strictness, semantic checks with JSON paths, identity, immutability, speed."""

import copy
import dataclasses
import hashlib
from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reap_swap.plan.document import PlanError, canonical_json, load_plan, plan_schema, validate_plan_document
from reap_swap.sizing.model_shape import read_model_shape

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT.parent / "shared" / "fixtures" / "strict30-v2-plan.json"
QWEN35 = Path(__file__).parent / "data" / "qwen3_5_moe_35b_a3b_config.json"

needs_fixture = pytest.mark.skipif(not FIXTURE.exists(), reason=f"shared fixture missing: {FIXTURE}")


@pytest.fixture(scope="module")
def strict30() -> dict:
    if not FIXTURE.exists():
        pytest.skip(f"shared fixture missing: {FIXTURE}")
    return orjson.loads(FIXTURE.read_bytes())


def minimal(num_experts=8, core=(0, 1), slices=(("s0", (2, 3)),), pe=100, layers=(0,)) -> dict:
    """The smallest plan a planner may emit: only the required keys."""
    return {
        "mode": "dynamic_core_specialist",
        "budget": {"per_expert_bytes": pe},
        "perLayer": {
            f"layer_{i}": {
                "numExperts": num_experts,
                "coreExperts": list(core),
                "sliceCatalog": [{"sliceId": f"{sid}_{i}", "experts": list(ex)} for sid, ex in slices],
            }
            for i in layers
        },
    }


def paths(report):
    return [issue.path for issue in report.errors]


# ----------------------------------------------------------------------------- fixture


@needs_fixture
def test_fixture_loads_with_expected_shape(strict30):
    plan = load_plan(FIXTURE)
    assert plan.mode == "dynamic_core_specialist" and plan.model == "Qwen/Qwen3.5-35B-A3B"
    assert list(plan.layers) == list(range(40))
    assert sum(len(layer.core) for layer in plan.layers.values()) == 1960
    assert sum(len(layer.slices) for layer in plan.layers.values()) == 1040
    assert plan.per_expert_bytes == 6291456
    assert plan.swappable_budget_bytes == 16757880012
    assert plan.max_refreshes_per_request == 1
    assert plan.core_bytes() == 1960 * 6291456
    layer0 = plan.layers[0]
    assert layer0.key == "layer_0" and layer0.num_experts == 256
    assert layer0.slice_by_id["layer_0_slice_00"].experts == (32, 82, 98, 154, 159, 196, 200, 236)
    assert layer0.slice_by_id["layer_0_slice_00"].task_priors["personal"] == pytest.approx(0.21489111)
    assert layer0.candidates == frozenset(range(256))
    assert plan.identity == hashlib.sha256(canonical_json(strict30)).hexdigest()


@needs_fixture
def test_fixture_validates_against_the_model_config(strict30):
    report = validate_plan_document(strict30, read_model_shape(QWEN35))
    assert report.ok, report.format_text()
    assert report.warnings == ()
    s = report.summary
    assert (s["layers"], s["experts_per_layer"], s["core_experts"], s["slices"]) == (40, 256, 1960, 1040)
    assert s["coverage"] == 1.0 and s["core_bytes"] == 1960 * 6291456


@needs_fixture
def test_the_schema_is_checked_and_compiled_once_not_per_load(monkeypatch):
    # What keeps a 1 MB plan's load well under a second (a speed goal, so measured in research.md,
    # not timed here): the schema is checked and its validator built once per process.
    from reap_swap.plan import document

    load_plan(FIXTURE)
    assert FIXTURE.stat().st_size > 1_000_000

    def rebuilt(*args, **kwargs):
        raise AssertionError("the plan schema was checked again")

    monkeypatch.setattr(document.jsonschema.Draft202012Validator, "check_schema", rebuilt)
    load_plan(FIXTURE)
    load_plan(FIXTURE)


def test_packaged_schema_is_the_published_schema():
    published = (ROOT / "schemas" / "reap_plan.schema.json").read_bytes()
    packaged = (ROOT / "reap_swap" / "plan" / "schemas" / "reap_plan.schema.json").read_bytes()
    assert published == packaged
    assert plan_schema()["$schema"] == "https://json-schema.org/draft/2020-12/schema"


# ----------------------------------------------------------------------------- schema strictness


@needs_fixture
@pytest.mark.parametrize(
    "where, wrong, right",
    [
        ("perLayer.layer_5", "coreExpert", "coreExperts"),
        ("perLayer.layer_12", "slice_catalog", "sliceCatalog"),
        ("budget", "per_expert_byte", "per_expert_bytes"),
        ("perLayer.layer_3.sliceCatalog[4]", "expert", "experts"),
        ("$", "perlayer", "perLayer"),
    ],
)
def test_misspelled_key_is_refused_naming_offender_and_expected_keys(strict30, where, wrong, right):
    doc = copy.deepcopy(strict30)
    target = _at(doc, where)
    target[wrong] = target.pop(right)
    report = validate_plan_document(doc)
    assert not report.ok
    offender = wrong if where == "$" else f"{where}.{wrong}"
    [issue] = [i for i in report.errors if i.path == offender]
    assert f"unknown key {wrong!r}" in issue.message
    assert f"did you mean {right!r}" in issue.message
    assert "expected keys: " in issue.message and right in issue.message.split("expected keys: ")[1]


def _at(doc, where):
    if where == "$":
        return doc
    node = doc
    for part in where.replace("[", ".").replace("]", "").split("."):
        node = node[int(part)] if part.isdigit() else node[part]
    return node


def test_minimal_plan_is_valid_and_gets_defaults():
    plan = load_plan(minimal())
    assert plan.model == "" and plan.max_refreshes_per_request == 1
    # no declared budget: everything the plan offers fits (core 2 + slice 2 experts of 100 bytes)
    assert plan.swappable_budget_bytes == 400
    assert plan.layers[0].slices[0].byte_cost == 200


def test_budget_falls_back_to_core_plus_specialist():
    doc = minimal()
    doc["budget"].update(core_budget_bytes=300, specialist_budget_bytes=250)
    assert load_plan(doc).swappable_budget_bytes == 550


def test_free_form_sections_accept_anything():
    doc = minimal()
    doc["scorerArtifacts"] = {"anything": {"nested": [1, "x", None]}, "seed": 7}
    doc["sourceSummaries"] = [{"label": "code", "workflow": "w", "extraField": [1, 2]}]
    doc["perLayer"]["layer_0"]["sliceCatalog"][0]["taskPriors"] = {"any task name": 0.5}
    doc["perLayer"]["layer_0"]["sliceCatalog"][0]["signalsBySummary"] = {"code": {"deep": 1}}
    assert validate_plan_document(doc).ok


def test_type_errors_and_wrong_mode_are_reported_with_paths():
    doc = minimal()
    doc["mode"] = "static"
    doc["perLayer"]["layer_0"]["numExperts"] = "eight"
    doc["perLayer"]["layer_0"]["sliceCatalog"][0]["experts"] = []
    doc["perLayer"]["layer_0"]["sliceCatalog"][0]["taskPriors"] = {"code": "high"}
    doc["perLayer"]["layer_01"] = {"numExperts": 8, "coreExperts": []}
    del doc["budget"]["per_expert_bytes"]
    report = validate_plan_document(doc)
    got = {(i.path, i.message.split(";")[0]) for i in report.errors}
    assert ("mode", "'dynamic_core_specialist' was expected") in got
    assert ("perLayer.layer_0.numExperts", "'eight' is not of type 'integer'") in got
    assert ("perLayer.layer_0.sliceCatalog[0].experts", "[] should be non-empty") in got
    assert ("perLayer.layer_0.sliceCatalog[0].taskPriors.code", "'high' is not of type 'number'") in got
    assert ("perLayer.layer_01", "unknown key 'layer_01'") in got
    assert ("budget", "missing required key 'per_expert_bytes'") in got


def test_not_an_object():
    report = validate_plan_document([1, 2])
    assert paths(report) == ["$"]


# ----------------------------------------------------------------------------- semantic checks


def test_semantic_errors_carry_exact_paths():
    doc = minimal(num_experts=8, core=(0, 1, 1), slices=(("a", (2, 300)), ("a", (4, 4))))
    doc["perLayer"]["layer_0"]["sliceCatalog"][1]["sliceId"] = "a_0"
    doc["perLayer"]["layer_0"]["rawLayerKey"] = "model.layers.3.mlp"
    report = validate_plan_document(doc)
    by_path = {i.path: i.message for i in report.errors}
    assert by_path == {
        "perLayer.layer_0.coreExperts[2]": "duplicate expert id 1",
        "perLayer.layer_0.rawLayerKey": "'model.layers.3.mlp' does not name layer 0 (key 'layer_0')",
        "perLayer.layer_0.sliceCatalog[0].experts[1]": "300 is not < numExperts 8",
        "perLayer.layer_0.sliceCatalog[1].experts[1]": "duplicate expert id 4",
        "perLayer.layer_0.sliceCatalog[1].sliceId": "duplicate sliceId 'a_0' (also sliceCatalog[0])",
    }


def test_raw_layer_key_naming_the_same_index_is_fine():
    doc = minimal(layers=(7,))
    doc["perLayer"]["layer_7"]["rawLayerKey"] = "7"
    assert validate_plan_document(doc).ok
    doc["perLayer"]["layer_7"]["rawLayerKey"] = "model.layers.7.mlp.experts"
    assert validate_plan_document(doc).ok


def test_byte_cost_disagreement_is_a_warning_not_an_error():
    doc = minimal(pe=100)
    doc["perLayer"]["layer_0"]["coreByteCost"] = 999
    doc["perLayer"]["layer_0"]["sliceCatalog"][0]["byteCost"] = 150
    report = validate_plan_document(doc)
    assert report.ok
    assert [w.path for w in report.warnings] == [
        "perLayer.layer_0.coreByteCost",
        "perLayer.layer_0.sliceCatalog[0].byteCost",
    ]
    assert "150 != 2 experts x per_expert_bytes 100 = 200" in report.warnings[1].message


def test_core_over_budget_is_an_error():
    doc = minimal(core=(0, 1, 2), pe=100)
    doc["budget"].update(core_budget_bytes=250, swappable_expert_budget_bytes=1000)
    report = validate_plan_document(doc)
    assert paths(report) == ["budget.core_budget_bytes"]
    assert "need 300 bytes" in report.errors[0].message and "by 50" in report.errors[0].message


def test_summary_must_match_content():
    doc = minimal(layers=(0, 1))
    doc["summary"] = {
        "layerCount": 2,
        "totalCoreExperts": 5,
        "totalSlices": 2,
        "residentFractionPctMin": 40.0,
        "residentFractionPctMax": 30.0,
    }
    report = validate_plan_document(doc)
    assert paths(report) == ["summary.residentFractionPctMin", "summary.totalCoreExperts"]
    assert report.errors[1].message == "says 5, plan has 4"


def test_model_shape_mismatch_is_reported():
    shape = read_model_shape(QWEN35)
    doc = minimal(num_experts=128, pe=6291456, layers=(0, 1, 45))
    report = validate_plan_document(doc, shape)
    by_path = {i.path: i.message for i in report.errors}
    assert by_path["perLayer.layer_0.numExperts"] == "128 != model's 256 experts per layer"
    assert by_path["perLayer.layer_45"].startswith(
        "model Qwen3_5MoeForConditionalGeneration has no MoE layer 45"
    )
    assert by_path["perLayer"].startswith(
        "plan has 3 layers, model Qwen3_5MoeForConditionalGeneration has 40"
    )
    assert "missing: 2..39" in by_path["perLayer"]

    full = minimal(num_experts=256, pe=4096, layers=range(40))
    assert paths(validate_plan_document(full, shape)) == ["budget.per_expert_bytes"]
    full["budget"]["per_expert_bytes"] = 6291456
    assert validate_plan_document(full, shape).ok


def test_errors_are_in_natural_path_order():
    doc = minimal(layers=(2, 10), core=(0, 99))
    assert paths(validate_plan_document(doc)) == [
        "perLayer.layer_2.coreExperts[1]",
        "perLayer.layer_10.coreExperts[1]",
    ]


def test_cartridges_are_checked_against_the_plan():
    doc = minimal(layers=(0, 1))
    doc["cartridges"] = {"code": {"layer_0": ["s0_0"], "1": [2, 3]}}
    plan = load_plan(doc)
    assert plan.cartridges["code"]["1"] == (2, 3)
    doc["cartridges"]["bad"] = {"layer_1": [5]}
    report = validate_plan_document(doc)
    assert paths(report) == ["cartridges.bad.layer_1[0]"]
    assert "expert 5 of layer 1" in report.errors[0].message


# ----------------------------------------------------------------------------- identity and immutability


def test_load_plan_raises_plan_error_with_report(tmp_path):
    with pytest.raises(PlanError) as info:
        load_plan(minimal(core=(9,)))
    assert info.value.report.errors[0].path == "perLayer.layer_0.coreExperts[0]"
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(PlanError, match="not valid JSON"):
        load_plan(bad)


def test_plan_is_immutable():
    plan = load_plan(minimal())
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.identity = "x"
    with pytest.raises(TypeError):
        plan.document["mode"] = "x"
    with pytest.raises(TypeError):
        plan.document["perLayer"]["layer_0"]["coreExperts"][0] = 5
    with pytest.raises(TypeError):
        plan.layers[3] = plan.layers[0]
    with pytest.raises(TypeError):
        plan.layers[0].slice_by_id["x"] = None
    assert isinstance(plan.layers[0].core, frozenset)
    # the frozen document re-validates and keeps its identity
    again = load_plan(plan.document)
    assert again.identity == plan.identity


plan_docs = st.builds(
    lambda n, layers, core_len, seed: minimal(
        num_experts=n,
        layers=tuple(sorted(layers)),
        core=tuple(range(min(core_len, n))),
        slices=tuple((f"s{j}", (j % n,)) for j in range(seed % 4)),
        pe=1 + seed,
    ),
    n=st.integers(1, 64),
    layers=st.sets(st.integers(0, 60), min_size=1, max_size=6),
    core_len=st.integers(0, 64),
    seed=st.integers(0, 1000),
)


@settings(max_examples=60, deadline=None)
@given(doc=plan_docs, data=st.data())
def test_identity_ignores_key_order_but_not_content(doc, data):
    def reorder(obj):
        if isinstance(obj, dict):
            items = data.draw(st.permutations(list(obj.items())))
            return {k: reorder(v) for k, v in items}
        if isinstance(obj, list):
            return [reorder(v) for v in obj]
        return obj

    plan = load_plan(doc)
    assert load_plan(reorder(doc)).identity == plan.identity
    changed = copy.deepcopy(doc)
    changed["budget"]["per_expert_bytes"] += 1
    assert load_plan(changed).identity != plan.identity


@settings(max_examples=60, deadline=None)
@given(doc=plan_docs, data=st.data())
def test_any_out_of_range_id_is_reported_at_its_path(doc, data):
    key = data.draw(st.sampled_from(sorted(doc["perLayer"])))
    layer = doc["perLayer"][key]
    layer["coreExperts"].append(layer["numExperts"] + data.draw(st.integers(0, 5)))
    report = validate_plan_document(doc)
    position = len(layer["coreExperts"]) - 1
    assert paths(report) == [f"perLayer.{key}.coreExperts[{position}]"]
    assert report.errors[0].message == f"{layer['coreExperts'][-1]} is not < numExperts {layer['numExperts']}"
