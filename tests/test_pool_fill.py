"""--reap-budget auto | GiB: a swap keeps the pool full (core ∪ active set ∪ the fill order's
longest prefix that fits the workers' pool), the active set may use the whole pool, and accounting
residency (the CPU build) behaves the same with the plan's budget as the pool. Pure functions and
the controller against the fake workers (the real WorkerCore and accounting backend)."""

import asyncio

import pytest
from reap_fakes import FakeEngine, make_core, tiny_plan_doc

from reap_swap.plan.active_set import ActiveSetError, BudgetExceeded, SwapRequest
from reap_swap.plan.document import load_plan
from reap_swap.plan.pool_fill import Pool, fill_pool, plan_pool, pool_from_workers, resolve_swap
from reap_swap.server.controller import SwapController


def small_plan(slots=24):
    """The tiny plan (4 layers x 16 experts, core 4 per layer) with a budget of `slots` experts."""
    doc = tiny_plan_doc()
    pe = doc["budget"]["per_expert_bytes"]
    doc["budget"].update(
        swappable_expert_budget_bytes=slots * pe,
        specialist_budget_bytes=slots * pe - doc["budget"]["core_budget_bytes"],
        total_active_expert_capacity=slots,
    )
    return load_plan(doc)


PLAN = small_plan()
ORDER = PLAN.fill_order()[0]


def count(resident):
    return sum(len(v) for v in resident.values())


def engine_for(plan, tp_size=2, pool_slots=None):
    engine = FakeEngine(tp_size)
    for w in engine.workers:
        w.core = make_core(w.rank, tp_size, plan)
        if pool_slots is not None:  # a CUDA worker's status: the pool it has (engine/residency/budget.py)
            backend, status = w.core.backend, w.core.backend.status
            backend.status = lambda status=status: {**status(), "pool_slots": pool_slots}
    return engine


def run(coro):
    return asyncio.run(coro)


def test_plan_pool_and_workers_pool():
    assert plan_pool(PLAN) == Pool(24, frozenset(PLAN.layers), plan_pool(PLAN).source)
    assert pool_from_workers(PLAN, [{"mode": "accounting"}]).slots == 24  # no pool reported
    cuda = pool_from_workers(PLAN, [{"pool_slots": 40, "layers_rehomed": [0, 1, 2]}] * 2)
    assert cuda.slots == 40 and cuda.layers == {0, 1, 2} and "2 rank(s)" in cuda.source
    with pytest.raises(ValueError, match="different HBM pools: slots \\[40, 41\\]"):
        pool_from_workers(PLAN, [{"pool_slots": 40}, {"pool_slots": 41}])


def test_fill_pool_takes_the_orders_prefix_on_pooled_layers_only():
    core = PLAN.core_sets()
    filled, added = fill_pool(core, ORDER, plan_pool(PLAN))
    assert count(filled) == 24 and added == 8
    expected = {(layer, e) for layer, e in ORDER[:8]}
    assert {(l, e) for l, v in filled.items() for e in v - core[l]} == expected
    # a pool over layers 0, 1 only: layers 2, 3 keep their core and take no slot
    two = Pool(12, frozenset({0, 1}), "test")
    filled, added = fill_pool(core, ORDER, two)
    assert filled[2] == core[2] and filled[3] == core[3] and len(filled[0]) + len(filled[1]) == 12
    assert added == 4


def test_resolve_swap_keeps_the_active_set_and_fills_the_rest():
    active = {"layer_3": [10, 11, 12, 13]}  # late in the fallback order
    resident, budget, details = resolve_swap(PLAN, active, None, plan_pool(PLAN), ORDER)
    assert {10, 11, 12, 13} <= resident[3] and count(resident) == 24
    assert details["fill_experts"] == 4 and details["pool_slots"] == 24 and details["budget_source"] == "pool"
    # without a pool (--reap-budget plan): exactly core ∪ active set
    exact, _b, d = resolve_swap(PLAN, active, None, None, ORDER)
    assert count(exact) == 20 and "fill_experts" not in d and d["budget_source"] == "plan"
    # a request's lower budget limits the fill too
    low, b, _d = resolve_swap(PLAN, active, 21 * PLAN.per_expert_bytes, plan_pool(PLAN), ORDER)
    assert count(low) == 21 and b == 21 * PLAN.per_expert_bytes


def test_an_active_set_may_use_the_workers_pool_but_not_more():
    big = {f"layer_{l}": sorted(PLAN.layers[l].candidates - PLAN.layers[l].core)[:6] for l in PLAN.layers}
    with pytest.raises(BudgetExceeded):  # 16 + 24 experts > the plan's 24
        resolve_swap(PLAN, big, None, plan_pool(PLAN), ORDER)
    pool = Pool(44, frozenset(PLAN.layers), "workers")
    resident, budget, _d = resolve_swap(PLAN, big, None, pool, ORDER)
    assert count(resident) == 44 and budget == 44 * PLAN.per_expert_bytes
    with pytest.raises(BudgetExceeded) as err:
        resolve_swap(PLAN, big, None, Pool(39, frozenset(PLAN.layers), "workers"), ORDER)
    assert err.value.needed_bytes == 40 * PLAN.per_expert_bytes
    assert err.value.budget_bytes == 39 * PLAN.per_expert_bytes
    with pytest.raises(ActiveSetError, match="above the HBM pool of 39 expert slots"):
        resolve_swap(PLAN, {}, 40 * PLAN.per_expert_bytes, Pool(39, frozenset(PLAN.layers), "w"), ORDER)


def test_controller_fills_the_accounting_pool_at_start_and_keeps_it_full():
    engine = engine_for(PLAN)
    ctl = SwapController(PLAN, engine.rpc, cartridges={}, keep_pool_full=True)
    run(ctl.start())
    startup, _ = fill_pool(PLAN.core_sets(), ORDER, plan_pool(PLAN))
    assert ctl.resident == startup and count(ctl.resident) == 24
    assert all(w.backend.resident() == startup for w in engine.workers)
    out = run(ctl.swap(SwapRequest(request_id="a", active_set={"layer_3": [10, 11, 12, 13]})))
    for w in engine.workers:
        resident = w.backend.resident()
        assert count(resident) == 24 and {10, 11, 12, 13} <= resident[3]
    assert out["validation"]["fill_experts"] == 4 and out["delta"]["totals"]["added"] == 4
    # misses are measured against the filled set: a fill expert is a hit, a non-resident a miss
    hit = next(e for e in sorted(ctl.resident[0]) if e not in PLAN.layers[0].core)
    miss = next(e for e in range(16) if e not in ctl.resident[0])
    engine.route(0, [hit, miss])
    m = run(ctl.router_misses("a"))
    assert m["layers"]["0"]["observed_selections"] == 2 and m["layers"]["0"]["missed_selections"] == 1
    st = run(ctl.status())
    assert st["pool"]["slots"] == 24 and st["workers_consistent"]


def test_controller_uses_the_pool_the_workers_report():
    engine = engine_for(PLAN, pool_slots=40)  # a grown CUDA pool, already filled at startup
    ctl = SwapController(PLAN, engine.rpc, cartridges={}, keep_pool_full=True)
    run(ctl.start())
    assert ctl.pool.slots == 40 and count(ctl.resident) == 40  # the fake has no startup fill: filled here
    big = {f"layer_{l}": sorted(PLAN.layers[l].candidates - PLAN.layers[l].core)[:6] for l in PLAN.layers}
    out = run(ctl.swap(SwapRequest(request_id="b", active_set=big)))
    assert out["validation"]["resident_experts"] == 40 and out["validation"]["fill_experts"] == 0


def test_without_keep_pool_full_a_swap_is_exactly_core_and_active_set():
    engine = engine_for(PLAN)
    ctl = SwapController(PLAN, engine.rpc, cartridges={})
    run(ctl.start())
    assert ctl.resident == PLAN.core_sets() and ctl.pool is None
    run(ctl.swap(SwapRequest(request_id="a", active_set={"layer_3": [10]})))
    assert count(engine.workers[0].backend.resident()) == 17
