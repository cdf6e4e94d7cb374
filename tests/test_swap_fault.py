"""The injected swap failure (issue #9): the faulty store makes apply_swap's local rollback run,
the fault-injecting backend wrapper fails the CUDA backend mid-swap and the accounting backend
before anything changes, the worker RPC arms only its own rank, and a failure on one of two ranks
leaves both on the previous set (no vLLM server)."""

import asyncio
from types import SimpleNamespace

import pytest
from reap_fakes import PLAN, FakeEngine, FakeWorker
from test_residency_swap import FakeStore, _check_consistent

from reap_swap.cache.slot_table import SlotTable
from reap_swap.engine.residency.accounting import AccountingResidency
from reap_swap.engine.residency.cuda_backend import CudaResidency
from reap_swap.engine.residency.fault import FaultInjectingBackend, InjectedSwapFault, SwapFault
from reap_swap.engine.residency.swap import SwapStepFailed, apply_swap
from reap_swap.plan.active_set import SwapRequest, signature
from reap_swap.server.controller import SwapController, WorkerSwapFailed
from reap_swap.server.swap_failure import ranks_named_in


# -- the faulty store over apply_swap -----------------------------------------------------------
@pytest.mark.parametrize("after", [0, 1, 2])
def test_faulty_store_fails_mid_swap_and_the_local_rollback_restores_the_table(after):
    table, store = SlotTable(4), FakeStore(4)
    apply_swap(table, store, {0: {0, 1}, 1: {2}})
    before = table.resident()
    fault = SwapFault(rank=1, after_admissions=after)
    wrapped = fault.wrap(store)
    with pytest.raises(SwapStepFailed) as err:
        apply_swap(table, wrapped, {0: {3}, 1: {4, 5}, 2: {6}})
    assert err.value.rolled_back and "rank 1: injected swap fault" in str(err.value)
    assert isinstance(err.value.__cause__, InjectedSwapFault)
    assert fault.fired and table.resident() == before == store.device_resident()
    _check_consistent(table, store)
    # one-shot: the same wrapped store now passes everything through
    apply_swap(table, wrapped, {0: {3}, 1: {4, 5}, 2: {6}})
    assert table.resident() == {0: frozenset({3}), 1: frozenset({4, 5}), 2: frozenset({6})}


def _cuda_backend(store):
    """CudaResidency over a FakeStore (the VMM store needs a GPU; only the fault path is tested),
    wrapped as the worker wraps it."""
    st = SimpleNamespace(
        table=SlotTable(4), layers={0: None, 1: None, 2: None}, swaps=0, bytes_copied_total=0, plan=None
    )
    return FaultInjectingBackend(CudaResidency.over(st, store), rank=0)


def test_cuda_apply_with_a_fault_rolls_back_locally_and_fires_once():
    store = FakeStore(4)
    backend = _cuda_backend(store)
    backend.apply({0: [0, 1], 1: [2], 2: []})
    before = backend.st.table.resident()
    fault = backend.arm(after_admissions=1)
    with pytest.raises(SwapStepFailed) as err:
        backend.apply({0: [3], 1: [4, 5], 2: [6]})
    assert fault.fired and backend.inner.store is store  # the faulty wrapper was for that one apply
    assert err.value.rolled_back and backend.st.table.resident() == before == store.device_resident()
    assert backend.apply({0: [3], 1: [4, 5], 2: [6]})["admitted"] == 4  # disarmed: it works


def test_cuda_fault_still_fires_when_the_swap_admits_too_few():
    store = FakeStore(4)
    backend = _cuda_backend(store)
    backend.apply({0: [0, 1], 1: [], 2: []})
    before = backend.st.table.resident()
    fault = backend.arm(after_admissions=5)
    with pytest.raises(InjectedSwapFault, match="undone"):
        backend.apply({0: [0, 1, 2], 1: [], 2: []})
    assert fault.fired and backend.st.table.resident() == before == store.device_resident()


def test_accounting_fault_fails_before_the_resident_set_changes():
    backend = FaultInjectingBackend(AccountingResidency(PLAN.core_sets(), PLAN.per_expert_bytes, "x"), 0)
    target = {**PLAN.core_sets(), 0: PLAN.core_sets()[0] | {4}}
    fault = backend.arm()
    backend.apply(target, dry_run=True)  # a dry run never fires it
    assert not fault.fired and backend.armed is fault
    with pytest.raises(InjectedSwapFault, match="rank 0"):
        backend.apply(target)
    assert fault.fired and backend.resident() == PLAN.core_sets()
    assert backend.status()["applies"] == 0 and backend.armed is None


# -- the worker RPC -------------------------------------------------------------------------------
def worker(rank: int, tp_size: int = 2) -> FakeWorker:
    """The real WorkerCore and RPC methods over fake counting layers (no vLLM worker, no model)."""
    return FakeWorker(rank, tp_size)


def wire(resident):
    return {"resident": {str(k): sorted(v) for k, v in resident.items()}}


TARGET = {**PLAN.core_sets(), 0: PLAN.core_sets()[0] | {4}}


def test_arming_applies_only_to_the_matching_rank_and_fires_once():
    w0, w1 = worker(0), worker(1)
    replies = [w.reap_arm_swap_fault("1") for w in (w0, w1)]  # the dev route may send strings
    assert [r["armed"] for r in replies] == [False, True] and "ignored" in replies[0]["note"]
    assert w1.reap_apply_residency(**wire(TARGET), dry_run=True)["dry_run"]  # a dry run leaves it armed
    ok, bad = (w.reap_apply_residency(**wire(TARGET), read_stats=True) for w in (w0, w1))
    assert "error" not in ok and ok["signature"] == signature(TARGET)
    assert bad["error"].startswith("rank 1: InjectedSwapFault")
    assert bad["signature"] == signature(PLAN.core_sets()) and bad["bytes_copied"] == 0
    assert "error" not in w1.reap_apply_residency(**wire(TARGET))  # one-shot
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

    async def rpc(method, **kwargs):
        return [getattr(w, method)(**kwargs) for w in workers]

    ctl = SwapController(PLAN, rpc, cartridges={})
    run(ctl.start())
    return workers, ctl


@pytest.mark.parametrize("failing", [0, 1])
def test_a_fault_on_one_rank_leaves_both_on_the_previous_set(failing):
    workers, ctl = two_ranks()
    good = run(ctl.swap(SwapRequest(request_id="a", active_set={"layer_0": [4]})))
    assert [w["signature"] for w in good["workers"]] == [good["signature"]] * 2 and good["workers_consistent"]
    workers[failing].reap_arm_swap_fault(failing)
    with pytest.raises(WorkerSwapFailed) as err:
        run(ctl.swap(SwapRequest(request_id="b", active_set={"layer_0": [8]})))
    assert err.value.rolled_back and err.value.failed_ranks == [failing] and err.value.workers_consistent
    assert [w["signature"] for w in err.value.workers] == [good["signature"]] * 2
    st = run(ctl.status())
    assert st["workers_consistent"] and st["signature"] == good["signature"]
    assert [w["signature"] for w in st["workers"]] == [good["signature"]] * 2
    assert [w["resident_experts"] for w in st["workers"]] == [sum(len(v) for v in ctl.resident.values())] * 2
    again = run(ctl.swap(SwapRequest(request_id="b", active_set={"layer_0": [8]})))
    assert [w["signature"] for w in again["workers"]] == [again["signature"]] * 2 != [good["signature"]] * 2


def test_failed_rank_is_read_from_a_raised_rpc_error():
    engine = FakeEngine(2)
    ctl = SwapController(PLAN, engine.rpc, cartridges={})
    run(ctl.start())
    engine.raise_next = "Worker failed with error 'rank 1: boom'"  # the RPC fails outright
    with pytest.raises(WorkerSwapFailed) as err:
        run(ctl.swap(SwapRequest(request_id="b", active_set={"layer_0": [8]})))
    assert err.value.rolled_back and err.value.failed_ranks == [1] and err.value.workers_consistent
    assert ranks_named_in("Worker failed with error 'rank 3: boom'") == [3]
    assert ranks_named_in("Executor failed.") == []
