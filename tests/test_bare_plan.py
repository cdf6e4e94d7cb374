"""A server started without a plan runs on a bare plan (reap_swap/plan/bare.py): no core, no slices,
every expert nameable by id, slices and cartridges answered with "a plan is needed"."""

import pytest

from reap_swap.plan.active_set import ActiveSetError, normalize_active_set
from reap_swap.plan.bare import (
    NO_PLAN_POOL_FRACTION,
    bare_plan_document,
    bare_pool_bytes,
    write_bare_plan,
)
from reap_swap.plan.document import load_plan, validate_plan_document
from reap_swap.plan.pool_fill import plan_pool, resolve_swap
from reap_swap.sizing.model_shape import ModelShape

SHAPE = ModelShape(
    architecture="Qwen3MoeForCausalLM",
    num_layers=4,
    moe_layers=(0, 1, 3),
    num_experts=16,
    top_k=4,
    hidden_size=64,
    moe_intermediate_size=32,
    dtype_bytes=2,
)


def bare(pool_bytes=None):
    pool = bare_pool_bytes(SHAPE, "plan") if pool_bytes is None else pool_bytes
    return load_plan(bare_plan_document(SHAPE, "m", pool), SHAPE)


def test_the_bare_plan_is_a_valid_plan_of_the_model_with_no_core_and_no_slices():
    doc = bare_plan_document(SHAPE, "m", bare_pool_bytes(SHAPE, "plan"))
    report = validate_plan_document(doc, SHAPE)
    assert report.ok, report.format_text()
    plan = load_plan(doc, SHAPE)
    assert plan.bare and sorted(plan.layers) == [0, 1, 3]
    assert all(not lp.core and not lp.slices for lp in plan.layers.values())
    assert all(lp.candidates == frozenset(range(16)) for lp in plan.layers.values())
    assert not load_plan({**doc, "bare": True}, SHAPE).cartridges


def test_the_pool_is_a_fixed_share_of_the_experts_unless_a_gib_budget_is_given():
    share = bare_pool_bytes(SHAPE, "plan")
    assert share == int(16 * NO_PLAN_POOL_FRACTION) * 3 * SHAPE.expert_bytes
    assert bare_pool_bytes(SHAPE, "auto") == share  # sized before the engine: see the module docstring
    two = 2 * SHAPE.expert_bytes / 2**30
    assert bare_pool_bytes(SHAPE, two) == 2 * SHAPE.expert_bytes
    assert bare_pool_bytes(SHAPE, 1e6) == 48 * SHAPE.expert_bytes  # never more than every expert


def test_any_expert_may_be_named_by_id_and_the_pool_bounds_the_swap():
    plan = bare()
    pool = plan_pool(plan)
    assert pool.slots == 24
    resident, budget, details = resolve_swap(plan, {"layer_3": [15, 2], "0": [7]}, None, None)
    assert resident == {0: frozenset({7}), 1: frozenset(), 3: frozenset({2, 15})}
    assert details["resident_experts"] == 3 and budget == plan.swappable_budget_bytes


def test_a_slice_id_says_a_plan_is_needed():
    with pytest.raises(ActiveSetError) as exc:
        normalize_active_set(bare(), {"layer_0": ["s0"]})
    assert exc.value.field == "active_set.layer_0[0]"
    assert "--reap-plan" in str(exc.value) and "without a plan" in str(exc.value)


def test_an_expert_outside_the_layer_is_still_refused():
    with pytest.raises(ActiveSetError):
        normalize_active_set(bare(), {"layer_0": [16]})
    with pytest.raises(ActiveSetError):
        normalize_active_set(bare(), {"layer_2": [0]})  # not an MoE layer


def test_the_file_is_named_by_its_content_and_reads_back(tmp_path):
    doc = bare_plan_document(SHAPE, "m", bare_pool_bytes(SHAPE, "plan"))
    first = write_bare_plan(doc, tmp_path)
    assert write_bare_plan(doc, tmp_path) == first
    other = write_bare_plan(bare_plan_document(SHAPE, "m", SHAPE.expert_bytes), tmp_path)
    assert other != first
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, other.name])  # no temp left
    assert load_plan(str(first), SHAPE).identity == load_plan(doc, SHAPE).identity
