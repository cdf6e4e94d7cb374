"""SwapController against fake workers: swaps, no-ops, attribution, refresh limit, rollback,
validate-only, cartridges, serialisation. The fakes implement the worker RPC contract with the
real accounting backend, replicated like tensor-parallel ranks."""

import asyncio
import json

import pytest
from reap_fakes import PLAN, FakeEngine, tiny_plan_doc

from reap_swap.plan.active_set import ActiveSetError, RefreshLimitExceeded, SwapRequest
from reap_swap.plan.cartridges import load_cartridges
from reap_swap.plan.document import load_plan
from reap_swap.plan.forensics import summarize_router_misses
from reap_swap.server.controller import SwapController, UnknownCartridge, WorkerSwapFailed


def run(coro):
    return asyncio.run(coro)


def make(tp_size=2, **kw):
    engine = FakeEngine(tp_size)
    ctl = SwapController(PLAN, engine.rpc, cartridges={}, **kw)
    return engine, ctl


def req(rid, active_set=None, **kw):
    return SwapRequest(request_id=rid, active_set=active_set or {}, **kw)


def test_start_adopts_the_workers_set_and_discards_warmup_counts():
    engine, ctl = make()
    engine.route(0, [5, 6, 7])  # warm-up traffic
    out = run(ctl.start())
    assert out["workers"] == 2 and ctl.resident == PLAN.core_sets()
    assert all(sum(c) == 0 for w in engine.workers for c in w.counts.values())


def test_swap_applies_on_every_worker_and_reports_the_delta():
    engine, ctl = make()
    run(ctl.start())
    out = run(ctl.swap(req("a", {"layer_0": ["layer_0_slice_00"], "3": [5]})))
    assert out["noop"] is False and out["swap_seq"] == 1
    assert out["delta"]["layers"]["0"] == {"added": 4, "removed": 0, "reused": 4}
    assert out["delta"]["layers"]["3"]["added"] == 1
    assert out["bytes_copied"] == 0 and len(out["workers"]) == 2
    for w in engine.workers:
        assert w.backend.resident()[0] == PLAN.core_sets()[0] | {4, 5, 6, 7}
    st = run(ctl.status())
    assert st["workers_consistent"] and st["signature"] == out["signature"] and st["swap_count"] == 1
    assert out["forensics"]["plan_identity"] == PLAN.identity


def test_same_set_is_a_noop_that_still_opens_the_request():
    engine, ctl = make()
    run(ctl.start())
    first = run(ctl.swap(req("a", {"layer_1": [9]})))
    again = run(ctl.swap(req("b", {"1": [9]})))
    assert again["noop"] is True and again["signature"] == first["signature"] and "no-op" in again["note"]
    assert ctl.open_request == "b"


def test_statistics_go_to_the_request_that_was_open_under_its_own_resident_set():
    engine, ctl = make()
    run(ctl.start())
    run(ctl.swap(req("a")))  # core only: layer 0 core = 0..3
    engine.route(0, [0, 1, 8, 9])  # 2 misses for a
    run(ctl.swap(req("b", {"layer_0": ["layer_0_slice_01"]})))  # adds 8..11
    engine.route(0, [8, 9, 12])  # 1 miss for b (12)
    a, b = run(ctl.router_misses("a")), run(ctl.router_misses("b"))
    assert a["open"] is False and b["open"] is True
    assert a["layers"]["0"]["observed_selections"] == 4 and a["layers"]["0"]["missed_selections"] == 2
    assert a["layers"]["0"]["inactive_experts"] == [8, 9]
    assert b["layers"]["0"]["observed_selections"] == 3 and b["layers"]["0"]["missed_selections"] == 1
    assert b["workers"] == 2 and b["tp_disagreement"] == []  # 2 TP ranks, counted once
    assert b["layers"]["0"]["observed_mass"] == pytest.approx(1.5)


def test_decode_refresh_segments_are_masked_separately_and_the_limit_holds():
    engine, ctl = make()
    run(ctl.start())
    run(ctl.swap(req("r")))
    engine.route(0, [8])  # miss under core
    out = run(ctl.swap(req("r", {"layer_0": ["layer_0_slice_01"]}, phase="decode_refresh")))
    assert out["refresh_count"] == 1
    engine.route(0, [8])  # hit under the refreshed set
    m = run(ctl.router_misses("r"))
    assert m["layers"]["0"]["observed_selections"] == 2 and m["layers"]["0"]["missed_selections"] == 1
    sig = ctl.sig
    with pytest.raises(RefreshLimitExceeded) as exc:
        run(ctl.swap(req("r", {"layer_0": ["layer_0_slice_02"]}, phase="decode_refresh")))
    assert exc.value.limit == 1 and ctl.sig == sig and ctl.refreshes.count("r") == 1


def test_reset_router_stats_and_reset_query():
    engine, ctl = make()
    run(ctl.start())
    run(ctl.swap(req("x")))
    engine.route(2, [0, 1])
    run(ctl.swap(req("x", reset_router_stats=True)))  # discards what x had
    assert run(ctl.router_misses("x"))["totals"]["observed_selections"] == 0
    engine.route(2, [0])
    first = run(ctl.router_misses("x", reset=True))
    assert first["totals"]["observed_selections"] == 1
    assert run(ctl.router_misses("x"))["totals"]["observed_selections"] == 0
    assert run(ctl.router_misses("unknown")) is None


def test_a_failing_worker_rolls_back_and_keeps_the_old_set():
    engine, ctl = make()
    run(ctl.start())
    good = run(ctl.swap(req("a", {"layer_0": [4]})))
    engine.workers[1].fail_apply = 1
    with pytest.raises(WorkerSwapFailed) as exc:
        run(ctl.swap(req("b", {"layer_0": [8]})))
    assert "rank 1: InjectedSwapFault" in str(exc.value) and exc.value.rolled_back is True
    assert ctl.sig == good["signature"] and ctl.open_request == "a" and ctl.failed_count == 1
    for w in engine.workers:  # worker 0 had applied {8}: the rollback put it back
        assert w.backend.resident()[0] == PLAN.core_sets()[0] | {4}
    assert run(ctl.status())["workers_consistent"]
    # the engine keeps working: the next swap succeeds
    assert run(ctl.swap(req("c", {"layer_0": [8]})))["swap_seq"] == 2


def test_a_failed_rollback_is_reported():
    engine, ctl = make()
    run(ctl.start())
    engine.workers[1].fail_apply = 2  # the swap and its rollback
    with pytest.raises(WorkerSwapFailed) as exc:
        run(ctl.swap(req("b", {"layer_0": [8]})))
    assert exc.value.rolled_back is False and "injected swap fault" in exc.value.rollback_error
    assert ctl.resident == PLAN.core_sets()


def test_validate_only_dry_runs_and_changes_nothing():
    engine, ctl = make(validate_only=True)
    run(ctl.start())
    before = ctl.sig
    out = run(ctl.swap(req("v", {"layer_0": ["layer_0_slice_00"]})))
    assert out["validate_only"] is True and ctl.sig == before and ctl.swap_count == 0
    applies = [kw for w in engine.workers for method, kw in w.calls if method == "reap_apply_residency"]
    assert applies and all(kw["dry_run"] is True and kw["read_stats"] is False for kw in applies)
    assert all(w.backend.resident() == PLAN.core_sets() for w in engine.workers)


def test_invalid_sets_raise_before_any_worker_call():
    engine, ctl = make()
    run(ctl.start())
    calls = len(engine.workers[0].calls)
    with pytest.raises(ActiveSetError, match="active_set.layer_3"):
        run(ctl.swap(req("bad", {"layer_3": [14]})))
    assert len(engine.workers[0].calls) == calls


def test_cartridges_are_resolved_once_and_lru_bounded(tmp_path):
    engine = FakeEngine()
    defs = {"one": {"layer_0": ["layer_0_slice_00"]}, "two": {"layer_1": ["layer_1_slice_00"]}}
    ctl = SwapController(PLAN, engine.rpc, cartridges=defs, max_loaded_cartridges=1)
    run(ctl.start())
    a = run(ctl.swap_cartridge("one", "c1"))
    assert a["validation"]["cartridge_was_loaded"] is False
    b = run(ctl.swap_cartridge("one", "c2"))
    assert b["validation"]["cartridge_was_loaded"] is True and b["noop"] is True
    run(ctl.swap_cartridge("two", "c3"))
    assert list(ctl.cartridges) == ["two"]  # "one" evicted
    with pytest.raises(UnknownCartridge):
        run(ctl.swap_cartridge("three", "c4"))


def test_cartridges_file_beside_the_plan(tmp_path):
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(tiny_plan_doc()))
    (tmp_path / "cartridges.json").write_text(json.dumps({"cartridges": {"side": {"2": [0]}}}))
    assert load_cartridges(load_plan(plan_file), plan_file) == {"side": {"2": [0]}}
    (tmp_path / "cartridges.json").write_text(json.dumps({"bad": {"layer_3": [15]}}))
    with pytest.raises(ValueError, match="cartridge 'bad'"):
        load_cartridges(load_plan(plan_file), plan_file)


def test_concurrent_swaps_are_serialised():
    engine, ctl = make()
    run(ctl.start())

    async def many():
        sets = [{}, {"layer_0": ["layer_0_slice_00"]}, {"layer_2": [0, 1]}]
        return await asyncio.gather(*(ctl.swap(req(f"c{i}", sets[i % 3])) for i in range(30)))

    outs = sorted(run(many()), key=lambda o: o["swap_seq"])
    assert engine.max_in_flight == 1
    assert [o["swap_seq"] for o in outs] == list(range(1, 31))
    for prev, cur in zip(outs, outs[1:]):
        assert cur["previous_signature"] == prev["signature"]
    assert ctl.sig == outs[-1]["signature"]


def test_miss_summary_counts_expert_totals_and_ratios():
    observed = {0: {"counts": [2, 1, 1], "weights": [1.0, 0.5, 0.5]}}
    missed = {0: {"counts": [0, 1, 1], "weights": [0.0, 0.5, 0.5]}}
    out = summarize_router_misses(observed, missed)
    row = out["layers"]["0"]
    assert row["expert_counts"] == [2, 1, 1] and row["inactive_experts"] == [1, 2]
    assert row["miss_ratio"] == 0.5 and row["inactive_mass_ratio"] == 0.5
    assert out["totals"]["missed_selections"] == 2
