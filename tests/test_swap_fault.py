"""The injected swap failure (issue #9): the faulty store makes apply_swap's local rollback run,
the accounting backend fails before changing anything, the worker RPC arms only its own rank,
and a failure on one of two ranks leaves both on the previous set (no vLLM server)."""

import asyncio
from types import SimpleNamespace

import pytest
from reap_fakes import PLAN, FakeEngine
from test_residency_swap import FakeStore, _check_consistent

from reap_swap.active_set import SwapRequest, signature
from reap_swap.controller import SwapController, SwapFailed, ranks_named_in
from reap_swap.residency import engine
from reap_swap.residency.accounting import AccountingResidency
from reap_swap.residency.engine import CudaResidency
from reap_swap.residency.fault import InjectedSwapFault, SwapFault
from reap_swap.residency.slot_table import SlotTable
from reap_swap.residency.swap import SwapFailed as StoreSwapFailed
from reap_swap.residency.swap import apply_swap
from reap_swap.worker import ReapWorkerExtension, _WorkerState


# -- the faulty store over apply_swap -----------------------------------------------------------
@pytest.mark.parametrize("after", [0, 1, 2])
def test_faulty_store_fails_mid_swap_and_the_local_rollback_restores_the_table(after):
    table, store = SlotTable(4), FakeStore(4)
    apply_swap(table, store, {0: {0, 1}, 1: {2}})
    before = table.resident()
    fault = SwapFault(rank=1, after_admissions=after)
    wrapped = fault.wrap(store)
    with pytest.raises(StoreSwapFailed) as err:
        apply_swap(table, wrapped, {0: {3}, 1: {4, 5}, 2: {6}})
    assert err.value.rolled_back and "rank 1: injected swap fault" in str(err.value)
    assert isinstance(err.value.__cause__, InjectedSwapFault)
    assert fault.fired and table.resident() == before == store.device_resident()
    _check_consistent(table, store)
    # one-shot: the same wrapped store now passes everything through
    apply_swap(table, wrapped, {0: {3}, 1: {4, 5}, 2: {6}})
    assert table.resident() == {0: frozenset({3}), 1: frozenset({4, 5}), 2: frozenset({6})}


def _cuda_backend(monkeypatch, store):
    """CudaResidency over a FakeStore (the VMM store needs a GPU; only the fault path is tested)."""
    st = SimpleNamespace(
        table=SlotTable(4), layers={0: None, 1: None, 2: None}, swaps=0, bytes_copied_total=0
    )
    monkeypatch.setattr(engine, "_Store", lambda _st: store)
    backend = object.__new__(CudaResidency)
    backend.st = st
    return backend


def test_cuda_apply_with_a_fault_rolls_back_locally_and_fires_once(monkeypatch):
    store = FakeStore(4)
    backend = _cuda_backend(monkeypatch, store)
    backend.apply({0: [0, 1], 1: [2], 2: []})
    before = backend.st.table.resident()
    fault = SwapFault(rank=0, after_admissions=1)
    with pytest.raises(StoreSwapFailed) as err:
        backend.apply({0: [3], 1: [4, 5], 2: [6]}, fault=fault)
    assert err.value.rolled_back and backend.st.table.resident() == before == store.device_resident()
    assert backend.apply({0: [3], 1: [4, 5], 2: [6]})["admitted"] == 4  # no fault passed: it works


def test_cuda_fault_still_fires_when_the_swap_admits_too_few(monkeypatch):
    store = FakeStore(4)
    backend = _cuda_backend(monkeypatch, store)
    backend.apply({0: [0, 1], 1: [], 2: []})
    before = backend.st.table.resident()
    fault = SwapFault(rank=0, after_admissions=5)
    with pytest.raises(InjectedSwapFault, match="undone"):
        backend.apply({0: [0, 1, 2], 1: [], 2: []}, fault=fault)
    assert fault.fired and backend.st.table.resident() == before == store.device_resident()


def test_accounting_fault_fails_before_the_keep_set_changes():
    backend = AccountingResidency(PLAN.core_sets(), PLAN.per_expert_bytes, "x")
    target = {**PLAN.core_sets(), 0: PLAN.core_sets()[0] | {4}}
    fault = SwapFault(rank=0)
    backend.apply(target, dry_run=True, fault=fault)  # a dry run never fires it
    assert not fault.fired
    with pytest.raises(InjectedSwapFault, match="rank 0"):
        backend.apply(target, fault=fault)
    assert fault.fired and backend.resident() == PLAN.core_sets()
    assert backend.status()["applies"] == 0


# -- the worker RPC -------------------------------------------------------------------------------
def worker(rank: int, tp_size: int = 2) -> ReapWorkerExtension:
    """A worker extension whose state is built from fakes (no vLLM worker, no model)."""
    state = object.__new__(_WorkerState)
    state.plan, state.rank, state.layers, state.fault = PLAN, rank, {}, None
    state.uncounted = {}  # plan layers without counters (none here)
    state.ranks = {"tp_rank": rank, "tp_size": tp_size, "dp_rank": 0}
    state.backend = AccountingResidency(PLAN.core_sets(), PLAN.per_expert_bytes, "fake")
    ext = ReapWorkerExtension()
    ext._reap_worker_state = state
    return ext


def wire(keep):
    return {str(k): sorted(v) for k, v in keep.items()}


TARGET = {**PLAN.core_sets(), 0: PLAN.core_sets()[0] | {4}}


def test_arming_applies_only_to_the_matching_rank_and_fires_once():
    w0, w1 = worker(0), worker(1)
    replies = [w.reap_arm_swap_fault("1") for w in (w0, w1)]  # the dev route may send strings
    assert [r["armed"] for r in replies] == [False, True] and "ignored" in replies[0]["note"]
    assert w1.reap_apply_residency(wire(TARGET), True)["dry_run"]  # a dry run leaves it armed
    ok, bad = (w.reap_apply_residency(wire(TARGET), False, True) for w in (w0, w1))
    assert "error" not in ok and ok["signature"] == signature(TARGET)
    assert bad["error"].startswith("rank 1: InjectedSwapFault")
    assert bad["signature"] == signature(PLAN.core_sets()) and bad["bytes_copied"] == 0
    assert "error" not in w1.reap_apply_residency(wire(TARGET))  # one-shot
    assert w1.reap_status()["signature"] == w0.reap_status()["signature"] == signature(TARGET)


def test_bad_arm_arguments_are_answered_not_raised():
    reply = worker(0).reap_arm_swap_fault("x")
    assert reply["armed"] is False and "expected integers" in reply["error"]
    assert worker(0).reap_arm_swap_fault(0, -1)["armed"] is False


# -- the controller over two ranks -------------------------------------------------------------
def run(coro):
    return asyncio.run(coro)


def two_ranks():
    workers = [worker(0), worker(1)]

    async def rpc(method, *args):
        return [getattr(w, method)(*args) for w in workers]

    ctl = SwapController(PLAN, rpc, cartridges={})
    run(ctl.start())
    return workers, ctl


@pytest.mark.parametrize("failing", [0, 1])
def test_a_fault_on_one_rank_leaves_both_on_the_previous_set(failing):
    workers, ctl = two_ranks()
    good = run(ctl.swap(SwapRequest(request_id="a", active_set={"layer_0": [4]})))
    assert [w["signature"] for w in good["workers"]] == [good["signature"]] * 2 and good["workers_consistent"]
    workers[failing].reap_arm_swap_fault(failing)
    with pytest.raises(SwapFailed) as err:
        run(ctl.swap(SwapRequest(request_id="b", active_set={"layer_0": [8]})))
    assert err.value.rolled_back and err.value.failed_ranks == [failing] and err.value.workers_consistent
    assert [w["signature"] for w in err.value.workers] == [good["signature"]] * 2
    st = run(ctl.status())
    assert st["workers_consistent"] and st["signature"] == good["signature"]
    assert [w["signature"] for w in st["workers"]] == [good["signature"]] * 2
    assert [w["resident_experts"] for w in st["workers"]] == [sum(len(v) for v in ctl.keep.values())] * 2
    again = run(ctl.swap(SwapRequest(request_id="b", active_set={"layer_0": [8]})))
    assert [w["signature"] for w in again["workers"]] == [again["signature"]] * 2 != [good["signature"]] * 2


def test_failed_rank_is_read_from_a_raised_rpc_error():
    engine = FakeEngine(2)
    ctl = SwapController(PLAN, engine.rpc, cartridges={})
    run(ctl.start())
    engine.workers[1].fail_apply = 1  # this fake raises, as an RPC that fails outright would
    with pytest.raises(SwapFailed) as err:
        run(ctl.swap(SwapRequest(request_id="b", active_set={"layer_0": [8]})))
    assert err.value.rolled_back and err.value.failed_ranks == [1] and err.value.workers_consistent
    assert ranks_named_in("Worker failed with error 'rank 3: boom'") == [3]
    assert ranks_named_in("Executor failed.") == []
