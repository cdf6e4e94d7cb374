"""sizing/cache_tail.py, the device cache's slot arithmetic: the counts, the pinned form's tail per
layer, K after the lending, per-layer slots and the seeded form's C_l, the plan-swap+cache split and
the questions accounting mode puts to them (pure: no torch)."""

import pytest

from reap_swap.plan.document import load_plan
from reap_swap.sizing.cache_tail import (
    PlanSwapSplit,
    cache_slots_per_layer,
    core_slots,
    device_pool,
    device_tail,
    layer_slots,
    pinned_count,
    pinned_tail_split,
    plan_pool_slots,
    plan_swap_split,
    seeded_split,
    slots_beyond_pinned,
    swap_cache_split,
    swap_capacity,
    swap_slots_after_lending,
    tail_slots,
)

PLAN = "plans/reap-mini-moe.plan.json"  # 4 layers, a pool of 32 slots, a core of 24


@pytest.fixture(scope="module")
def plan():
    return load_plan(PLAN)


def test_counts(plan):
    assert pinned_count({0: [1, 2, 2], 1: {3}}) == 3 and pinned_count({}) == 0
    assert core_slots(plan) == sum(len(p.core) for p in plan.layers.values()) == 24
    assert plan_pool_slots(plan) == plan.swappable_budget_bytes // plan.per_expert_bytes == 32
    assert plan_pool_slots(plan, 40 * plan.per_expert_bytes + 1) == 40  # a budget given: whole experts only
    assert (
        cache_slots_per_layer(7, 4) == 1
        and cache_slots_per_layer("9", 2) == 4
        and cache_slots_per_layer(5, 0) == 5
    )


def test_pinned_tail_split():
    core = {0: {1, 2}, 1: {3}}
    assert pinned_tail_split(10, 2, core, "auto") == (3, None)  # (10 - 3) // 2, the remainder not lent
    assert pinned_tail_split(10, 2, core, 5) == (2, None)
    assert pinned_tail_split(10, 2, core, 0) == (0, "--reap-cache-slots is 0")
    assert pinned_tail_split(10, 2, core, 1)[1] == "--reap-cache-slots 1 < one per layer (2 layers)"
    assert pinned_tail_split(10, 2, core, 12)[1] == "2 layers x 6 cache slots = 12 > the pool's 10"
    assert pinned_tail_split(4, 2, core, "auto")[1].startswith("--reap-cache-slots auto: 1 pool slot(s)")


def test_slots_beyond_pinned():
    assert slots_beyond_pinned(10, {0: {1, 2}, 1: {3}}) == 7 and slots_beyond_pinned(2, {0: {1, 2, 3}}) == 0


def test_swap_slots_after_lending():
    assert swap_slots_after_lending(32, 4 * 2, None) == 24  # pinned: layers x per_layer lent
    assert swap_slots_after_lending(11, 6 + 5, None) == 0  # seeded: every C_l lent
    assert swap_slots_after_lending(32, 8, "refused") == 32  # refused: nothing lent


def test_layer_slots():
    assert layer_slots(10, [0, 1, 2, 3], None, "uniform", 16) == ({0: 3, 1: 3, 2: 2, 3: 2}, "uniform")
    core = {0: frozenset(range(8)), 1: frozenset(range(7)), 2: frozenset(range(5)), 3: frozenset(range(4))}
    assert layer_slots(32, [0, 1, 2, 3], core, "core+tail", 16) == ({0: 10, 1: 9, 2: 7, 3: 6}, "core+tail")
    slots, how = layer_slots(8, [0, 1, 2, 3], core, "core+tail", 16)
    assert slots == {0: 2, 1: 2, 2: 2, 3: 2} and how == "uniform (the core does not fit)"
    assert layer_slots(8, [0, 1], None, "core+tail", 3) == ({0: 3, 1: 3}, "uniform (no plan)")  # at most E


def test_seeded_split():
    core = {0: frozenset({0, 1}), 1: frozenset({2})}
    assert seeded_split(11, core, "auto") == ({0: 6, 1: 5}, None)  # the whole pool: core 3 + tail 8
    assert seeded_split(11, core, 4) == ({0: 4, 1: 3}, None)  # core 3 + tail 4
    assert seeded_split(6, core, 4)[1] == "--reap-cache-seed seeded: core + tail = 7 slots > the pool's 6"
    slots, why = seeded_split(2, core, "auto")
    assert slots == {0: 1, 1: 1}
    assert (
        why
        == "--reap-cache-seed seeded: the plan core does not fit the 2 slots (uniform (the core does not fit))"
    )


def test_plan_swap_split_is_swap_cache_split_on_the_plans_pool(plan):
    assert swap_cache_split(32, 24, 4, 2) == (1, 28, None)
    split = plan_swap_split(plan, 2)
    assert split == PlanSwapSplit(32, 24, 4, 1, 28, None) and split.cache_slots == 4
    wider = plan_swap_split(plan, 2, 40 * plan.per_expert_bytes)
    assert (wider.pool, wider.per_layer, wider.kept) == (40, 2, 32)
    assert plan_swap_split(plan, 2, 26 * plan.per_expert_bytes).why.startswith("the pool's 26 slots leave 0")


def test_tail_slots_auto_and_fallback(plan):
    budget = plan.swappable_budget_bytes // plan.per_expert_bytes
    core = sum(len(p.core) for p in plan.layers.values())
    assert tail_slots(plan, "auto", None)[0] == max(0, budget - core)
    assert tail_slots(plan, "auto", lambda: None)[0] == max(0, budget - core)
    assert tail_slots(plan, "auto", lambda: 5) == (5, "the pool's slots beyond the pinned set")
    assert tail_slots(plan, 3, None) == (3, "--reap-cache-slots")
    # the device's pinned form: per layer, the remainder not lent (pool 32 slots, core 24, 4 layers)
    # (per layer, refusal, K = the slots the swap table keeps, the pool)
    pick = (0, 2, 3, 4)
    assert [device_tail(plan, "auto")[i] for i in pick] == [(budget - core) // 4, None, 24, 32]
    assert (budget - core) // 4 == 2
    assert [device_tail(plan, 7)[i] for i in pick] == [1, None, 28, 32]
    assert device_tail(plan, 3)[2] == "--reap-cache-slots 3 < one per layer (4 layers)"
    assert device_tail(plan, 3)[3] == 32  # refused: nothing lent, the table keeps the whole pool
    assert device_tail(plan, 40)[2] == "4 layers x 10 cache slots = 40 > the pool's 32"
    # 12 slots fit the pool but leave the table 20 < the core's 24 (CUDA could not pin the core)
    assert device_tail(plan, 12)[2] == (
        "4 layers x 3 cache slots = 12 leave 20 of the pool's 32 for swaps, fewer than the pinned set's 24"
    )
    # an engine's own pool count: 13 beyond the core, 3 per layer lent
    assert [device_tail(plan, "auto", lambda: 13)[i] for i in pick] == [3, None, 25, 37]
    assert device_pool(plan, 7, lambda: 13) == (
        32,
        "pool of 32 slots (the plan budget)",
    )  # N: the plan's pool


def test_swap_capacity_forms(plan):
    assert swap_capacity(plan, "core+dlfu", "auto", None, "off")[0] is None  # the device lends nothing
    assert swap_capacity(plan, "lru-seeded", "auto", None, "on")[:2] == (None, False)  # no such device cache
    k, seeded, how, lent = swap_capacity(plan, "core+dlfu", "auto", None, "on")
    assert (k, seeded, lent) == (24, False, (4, 2)) and how.startswith(
        "the pool of 32 slots less 4 layers x 2"
    )
    assert swap_capacity(plan, "dlfu-seeded", "auto", None, "on")[:2] == (None, True)
    refused = swap_capacity(plan, "dlfu-seeded", 9, None, "on")  # core 24 + 9 > the pool's 32
    assert refused[:2] == (None, False) and "core + tail = 33 slots > the pool's 32" in refused[2]
