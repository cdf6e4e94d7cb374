"""The HBM pool on a real device: one that fits is reserved; one beyond free memory, or one the
driver refuses (the free-memory check bypassed), ends as PoolRefused with nothing left reserved
(run 26's traceback, H100, 2026-12-06). Run on the lent GPU:
    PYTHONPATH=/tmp/site python3 -m pytest -q tests/gpu/test_pool_reserve_gpu.py
It measures the device's free memory, so it needs the card to itself: another process allocating or
freeing beside it moves the numbers (research.md, run 34).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from reap_swap.engine import vmm  # noqa: E402
from reap_swap.engine.residency import pool_reserve  # noqa: E402


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info(0)[0]


def test_a_pool_that_fits_is_reserved_and_released():
    unit = vmm.ensure_available(0) * 5  # 10 MiB at 2 MiB granularity
    before = _free()
    (pool,) = pool_reserve.reserve_pools("t", [(8, unit)], 0)
    assert pool.num_slots == 8 and before - _free() >= 8 * unit
    pool.release()
    assert _free() >= before - 64 * 2**20


def test_a_pool_beyond_free_memory_is_refused_and_nothing_stays():
    unit = vmm.ensure_available(0) * 512  # 1 GiB
    free, total = torch.cuda.mem_get_info(0)
    slots = free // unit + 2
    with pytest.raises(pool_reserve.PoolRefused, match="GiB free of"):
        pool_reserve.reserve_pools("t", [(slots, unit)], 0)
    assert _free() >= free - 64 * 2**20


def test_a_driver_out_of_memory_is_refused_and_every_unit_released():
    unit = vmm.ensure_available(0) * 512  # 1 GiB
    free, total = torch.cuda.mem_get_info(0)
    slots = free // unit + 2

    def lie(device):  # the check passes; the driver then runs out part-way through the units
        return (2 * slots * unit, 2 * slots * unit)

    with pytest.raises(pool_reserve.PoolRefused, match="CUDA_ERROR_OUT_OF_MEMORY"):
        pool_reserve.reserve_pools("t", [(slots, unit)], 0, mem_get_info=lie)
    assert _free() >= free - 64 * 2**20
