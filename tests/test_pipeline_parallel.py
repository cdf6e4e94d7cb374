"""Pipeline parallelism in the API process's logic (no vLLM): fake workers of two stages (PP=2,
optionally x TP=2) each hold half the plan's layers, as vLLM's PPMissingLayer split leaves them.
Statistics cover every layer exactly once, a swap touching both stages is applied on both (each
records only its own layers), and a failure on one stage rolls back both. The real server runs in
tests/e2e/test_zz_pipeline_parallel.py."""

import asyncio
from types import SimpleNamespace

import pytest
from reap_fakes import PLAN, FakeEngine, stage_layers

from reap_swap.plan.active_set import SwapRequest, signature
from reap_swap.plan.forensics import aggregate_workers
from reap_swap.server import cache_status as cache_surface
from reap_swap.server.controller import SwapController, WorkerSwapFailed
from reap_swap.server.swap_failure import stages_agree


def run(coro):
    return asyncio.run(coro)


def make(tp_size=1, pp_size=2):
    engine = FakeEngine(tp_size, pp_size)
    ctl = SwapController(PLAN, engine.rpc, cartridges={})
    run(ctl.start())
    return engine, ctl


def req(rid, active_set):
    return SwapRequest(request_id=rid, active_set=active_set)


def stage_sig(resident, pp_rank, pp_size=2):
    mine = stage_layers(PLAN, pp_rank, pp_size)
    return signature({l: v for l, v in resident.items() if l in mine})


@pytest.mark.parametrize("tp_size", [1, 2])
def test_status_lists_every_plan_layer_on_exactly_one_stage(tp_size):
    engine, ctl = make(tp_size)
    st = run(ctl.status())
    assert [(w["pp_rank"], w["tp_rank"]) for w in st["workers"]] == [
        (p, t) for p in range(2) for t in range(tp_size)
    ]
    assert [w["stage_layers"] for w in st["workers"]] == [[0, 1]] * tp_size + [[2, 3]] * tp_size
    assert st["stages"]["every_layer_once"] and st["stages"]["pp_size"] == 2
    half = tp_size  # workers per stage
    assert st["stages"]["layer_workers"] == {
        "0": list(range(half)),
        "1": list(range(half)),
        "2": list(range(half, 2 * half)),
        "3": list(range(half, 2 * half)),
    }
    assert st["workers_consistent"]


def test_the_cache_section_joins_the_stages_layers_and_sums_their_totals():
    def status(rank, pp_rank, layers, hits):
        doc = {"engaged": True, "policy": "lfu", "totals": {"hits": hits}, "steps": 3}
        doc["layers"] = {str(l): {"resident": [l], "engaged": True} for l in layers}
        return SimpleNamespace(rank=rank, pp_rank=pp_rank, cache=SimpleNamespace(model_dump=lambda: doc))

    out = cache_surface.report([status(0, 0, [0, 1], 5), status(1, 1, [2, 3], 7)])
    assert sorted(out["layers"]) == ["0", "1", "2", "3"] and out["totals"] == {"hits": 12}
    assert out["ranks_agree"] and out["steps"] == 3
    tp = cache_surface.report([status(0, 0, [0, 1], 5), status(1, 0, [0, 1], 4)])  # TP ranks differ
    assert not tp["ranks_agree"] and tp["totals"] == {"hits": 5}  # rank 0's, as before


def test_a_swap_touching_both_stages_is_applied_on_both_each_holding_its_own_layers():
    engine, ctl = make()
    out = run(ctl.swap(req("a", {"layer_1": [9, 10], "layer_3": [7]})))
    assert out["workers_consistent"] and [w["pp_rank"] for w in out["workers"]] == [0, 1]
    assert [w["signature"] for w in out["workers"]] == [
        stage_sig(ctl.resident, 0),
        stage_sig(ctl.resident, 1),
    ]
    first, second = (w.core.backend.resident() for w in engine.workers)
    assert sorted(first) == [0, 1] and sorted(second) == [2, 3]
    assert {9, 10} <= first[1] and 7 in second[3]
    st = run(ctl.status())
    assert st["workers_consistent"] and st["stages"]["every_layer_once"]
    assert (
        st["workers"][0]["resident_experts"] + st["workers"][1]["resident_experts"] == st["resident_experts"]
    )


def test_router_statistics_cover_every_layer_exactly_once():
    engine, ctl = make(tp_size=2)
    run(ctl.swap(req("r", {"layer_0": [4]})))
    for layer in range(4):
        engine.route(layer, [4, 9, 14])
    m = run(ctl.router_misses("r"))
    assert m["tp_disagreement"] == []
    assert sorted(m["layers"]) == ["0", "1", "2", "3"]
    for layer in range(4):
        row = m["layers"][str(layer)]
        assert row["observed_selections"] == 3, layer  # one stage's worth, one tp rank's worth
        resident = ctl.resident[layer]
        assert row["missed_selections"] == sum(e not in resident for e in (4, 9, 14))
    assert m["totals"]["observed_selections"] == 12


def test_a_layer_reported_by_two_stages_is_counted_once_and_named():
    a = {"rank": 0, "pp_rank": 0, "layers": {"0": {"counts": [1, 2], "weights": [0.5, 1.0]}}}
    b = {"rank": 1, "pp_rank": 1, "layers": {"0": {"counts": [1, 2], "weights": [0.5, 1.0]}}}
    c = {"rank": 1, "pp_rank": 1, "layers": {"1": {"counts": [3, 0], "weights": [1.5, 0.0]}}}
    agg = aggregate_workers([a, b])
    assert agg[0]["counts"] == [1, 2] and agg[0]["tp_disagreement"] == [
        {"dp_rank": 0, "pp_rank": 1, "tp_rank": 0}
    ]
    agg = aggregate_workers([a, c])
    assert agg[0]["counts"] == [1, 2] and agg[1]["counts"] == [3, 0]
    assert agg[0]["tp_disagreement"] == agg[1]["tp_disagreement"] == []


def test_stages_agree_is_one_signature_per_stage():
    assert stages_agree([(0, "a"), (0, "a")]) and not stages_agree([(0, "a"), (0, "b")])
    assert stages_agree([(0, "a"), (1, "b")]) and not stages_agree([(0, "a"), (0, "c"), (1, "b")])
    assert not stages_agree([])


@pytest.mark.parametrize("failing", [0, 1])
def test_a_failure_on_one_stage_rolls_back_both(failing):
    engine, ctl = make()
    good = run(ctl.swap(req("a", {"layer_0": [4], "layer_2": [0]})))
    before = [w.core.backend.resident() for w in engine.workers]
    r = engine.workers[failing].reap_arm_swap_fault(failing)
    assert r["armed"]
    with pytest.raises(WorkerSwapFailed) as err:
        run(ctl.swap(req("b", {"layer_1": [0], "layer_3": [8]})))
    assert err.value.rolled_back and err.value.failed_ranks == [failing] and err.value.workers_consistent
    assert [w["signature"] for w in err.value.workers] == [w["signature"] for w in good["workers"]]
    assert [w.core.backend.resident() for w in engine.workers] == before
    st = run(ctl.status())
    assert st["signature"] == good["signature"] and st["workers_consistent"] and st["failed_count"] == 1
    again = run(ctl.swap(req("b", {"layer_1": [0], "layer_3": [8]})))
    assert again["workers_consistent"] and 0 in engine.workers[0].core.backend.resident()[1]
    assert 8 in engine.workers[1].core.backend.resident()[3]


class _Pins:
    """A stand-in for the worker's cache that records what a swap pins."""

    def __init__(self):
        self.pins = []

    def pin(self, resident):
        self.pins.append(sorted(resident))

    def status(self):
        return None


def test_a_swap_changing_only_the_other_stage_still_pins_this_stages_cache():
    """As without PP (a changed set on any layer pins every cached layer): stage 0 pins too."""
    engine, ctl = make()
    for w in engine.workers:
        w.core.cache = _Pins()
    run(ctl.swap(req("a", {"layer_3": [7]})))  # only stage 1's layer changes
    assert [w.core.cache.pins for w in engine.workers] == [[[0, 1]], [[2, 3]]]
    run(ctl.swap(req("a2", {"layer_3": [7]})))  # the same set again: a no-op, nothing pinned
    assert [len(w.core.cache.pins) for w in engine.workers] == [1, 1]
    run(ctl.swap(req("b", {"layer_0": [4], "layer_3": [7]})))  # only stage 0's layer changes
    assert [len(w.core.cache.pins) for w in engine.workers] == [2, 2]
