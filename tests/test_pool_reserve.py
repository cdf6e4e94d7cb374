"""The HBM pool at load: reserved when it fits, else refused with the numbers and nothing kept.

Run 26 (H100 80 GB, 2026-12-06): full-size Qwen3.5 served by reap-swap beside a stock server that
held 65 GiB; the pool's cuMemCreate failed with CUDA_ERROR_OUT_OF_MEMORY and the load ended in a
driver traceback. These tests run pool_reserve against the fake driver of test_vmm_ranges (no GPU).
"""

import pytest
from test_vmm_ranges import UNIT, FakeDriver  # the fake CUDA driver (tests/ is on sys.path)

from reap_swap.engine import refusal as budget_startup
from reap_swap.engine import vmm
from reap_swap.engine.residency import pool_reserve
from reap_swap.sizing.memory_split import BudgetError, pool_refusal

GIB = 2**30


class OomDriver(FakeDriver):
    """Fails the `fail_at`-th cuMemCreate (1-based) with `code` (2: out of memory)."""

    def __init__(self, fail_at: int, code: int = 2) -> None:
        super().__init__()
        self.fail_at, self.code, self.creates = fail_at, code, 0

    def cuMemCreate(self, size, prop, flags):
        self.creates += 1
        if self.creates == self.fail_at:
            return (self.code, None)
        return super().cuMemCreate(size, prop, flags)

    @staticmethod
    def cuGetErrorName(err):
        return (0, {2: b"CUDA_ERROR_OUT_OF_MEMORY", 1: b"CUDA_ERROR_INVALID_VALUE"}[int(err)])


@pytest.fixture
def refusal_file(tmp_path, monkeypatch):
    monkeypatch.setenv(budget_startup.REFUSAL_ENV, "")  # restored after the test
    return budget_startup.arm_refusal_file(tmp_path)


def free_of(free_gib: float, total_gib: float = 80.0):
    return lambda device: (int(free_gib * GIB), int(total_gib * GIB))


def test_pool_refusal_names_the_numbers_and_what_to_do():
    assert pool_refusal(what="x", pool_bytes=10 * GIB, free=10 * GIB, total=80 * GIB, device=0) is None
    why = pool_refusal(what="1920 expert slots", pool_bytes=18 * GIB, free=9 * GIB, total=80 * GIB, device=1)
    assert why.startswith("the HBM pool (1920 expert slots) needs 18.00 GiB")
    assert "cuda:1 has 9.00 GiB free of 80.00 GiB" in why and "reap-swap plan --budget-gib" in why
    drv = pool_refusal(what="x", pool_bytes=GIB, free=9 * GIB, total=80 * GIB, device=0, driver_error="OOM")
    assert "the CUDA driver refused it (OOM) with 9.00 GiB free" in drv


def test_a_pool_that_fits_is_reserved(monkeypatch):
    drv = FakeDriver()
    monkeypatch.setattr(vmm, "_drv", drv)
    pools = pool_reserve.reserve_pools("t", [(3, UNIT), (2, 2 * UNIT)], 0, free_of(1))
    assert [(p.num_slots, p.unit_bytes) for p in pools] == [(3, UNIT), (2, 2 * UNIT)]
    assert len(drv.allocs) == 5 and len(drv.mapped) == 5


def test_a_pool_beyond_free_memory_is_refused_before_anything_is_reserved(monkeypatch, refusal_file):
    drv = FakeDriver()
    monkeypatch.setattr(vmm, "_drv", drv)
    with pytest.raises(pool_reserve.PoolRefused, match="needs 18.00 GiB but cuda:0 has 9.00 GiB free") as exc:
        pool_reserve.reserve_pools("the plan's budget", [(18, GIB)], 0, free_of(9))
    assert isinstance(exc.value, BudgetError)  # the worker's refusal type: the launcher prints one line
    assert drv.reserved == {} and drv.allocs == {}
    assert budget_startup.read_refusal(refusal_file) == str(exc.value)


def test_a_driver_oom_releases_every_pool_made_and_refuses(monkeypatch, refusal_file):
    drv = OomDriver(fail_at=5)  # the second pool's second unit
    monkeypatch.setattr(vmm, "_drv", drv)
    with pytest.raises(pool_reserve.PoolRefused, match="CUDA driver refused it") as exc:
        pool_reserve.reserve_pools("t", [(3, UNIT), (3, UNIT)], 0, free_of(1))
    assert "CUDA_ERROR_OUT_OF_MEMORY" in str(exc.value)
    assert drv.reserved == {} and drv.allocs == {} and drv.mapped == {}  # nothing half-applied
    assert budget_startup.read_refusal(refusal_file) == str(exc.value)


def test_another_driver_error_is_raised_as_it_is(monkeypatch, refusal_file):
    drv = OomDriver(fail_at=5, code=1)  # the second pool's second unit: the first pool goes back too
    monkeypatch.setattr(vmm, "_drv", drv)
    with pytest.raises(RuntimeError, match="CUDA_ERROR_INVALID_VALUE") as exc:
        pool_reserve.reserve_pools("t", [(3, UNIT), (3, UNIT)], 0, free_of(1))
    assert not isinstance(exc.value, pool_reserve.PoolRefused)
    assert drv.reserved == {} and drv.allocs == {}
    assert budget_startup.read_refusal(refusal_file) is None


def test_a_driver_oom_while_the_budget_grows_the_pool_is_refused_and_nothing_grows(monkeypatch, refusal_file):
    # --reap-budget auto | GiB: residency/budget.grow_and_fill grows the pool after startup; an OOM
    # there went through collective_rpc as a traceback (review after run 26)
    drv = OomDriver(fail_at=4)  # the growth's second unit
    monkeypatch.setattr(vmm, "_drv", drv)
    (pool,) = pool_reserve.reserve_pools("t", [(2, UNIT)], 0, free_of(1))
    with pytest.raises(pool_reserve.PoolRefused, match="3 more slots of 2.00 MiB for --reap-budget") as exc:
        pool_reserve.grow_pool(pool, 3, 0, free_of(1))
    assert isinstance(exc.value, BudgetError)  # what worker.reap_fill_budget answers as an error
    assert pool.num_slots == 2 and len(drv.allocs) == 2  # all or nothing
    assert budget_startup.read_refusal(refusal_file) == str(exc.value)
    pool_reserve.grow_pool(pool, 2, 0, free_of(1))  # the driver has room again
    assert pool.num_slots == 4
