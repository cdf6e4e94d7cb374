"""Reserving the HBM pool at load, or refusing with the numbers (never a driver traceback).

The pool is the plan's budget in HBM, reserved at the first MoE layer's attach inside vLLM's
load_model. Where the device's free memory cannot hold it (another server on the GPU, a budget
sized for a larger card), the load stops with one line the launcher prints
(memory_split.pool_refusal, engine/refusal.record_refusal) and nothing stays reserved.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from reap_swap.engine import vmm
from reap_swap.engine.refusal import record_refusal
from reap_swap.sizing.memory_split import BudgetError, pool_refusal


class PoolRefused(BudgetError):
    """The HBM pool does not fit this device now; the message carries the numbers."""


def reserve_pools(
    what: str,
    sizes: Sequence[tuple[int, int]],
    device: int,
    mem_get_info: Callable[[int], tuple[int, int]] | None = None,
) -> list[vmm.DeviceSlotPool]:
    """One DeviceSlotPool per (slots, unit_bytes) in `sizes`, or PoolRefused with none kept.
    `mem_get_info`: (free, total) bytes of a device, torch.cuda.mem_get_info unless given."""
    need = sum(int(slots) * int(unit) for slots, unit in sizes)
    if mem_get_info is None:
        torch.cuda.empty_cache()  # blocks PyTorch caches but does not use would count as taken
    free, total = (mem_get_info or torch.cuda.mem_get_info)(device)
    _refuse_if(pool_refusal(what=what, pool_bytes=need, free=free, total=total, device=device))
    pools: list[vmm.DeviceSlotPool] = []
    with _driver_oom_refused(what, need, device, free, total):
        try:
            for slots, unit in sizes:
                pools.append(vmm.DeviceSlotPool.create(int(slots), int(unit), device))
        except Exception:  # any failure: the pools made so far go back
            for pool in pools:
                pool.release()
            raise
    return pools


def grow_pool(
    pool: vmm.DeviceSlotPool,
    extra: int,
    device: int,
    mem_get_info: Callable[[int], tuple[int, int]] | None = None,
) -> None:
    """pool.grow(extra) for --reap-budget auto | GiB: the growth was sized from free memory, but a
    driver OOM (a neighbour allocating meanwhile) is refused as reserve_pools refuses it, the pool
    unchanged (grow is all or nothing), instead of a traceback through collective_rpc."""
    free, total = (mem_get_info or torch.cuda.mem_get_info)(device)
    what = f"{extra} more slots of {pool.unit_bytes / 2**20:.2f} MiB for --reap-budget"
    with _driver_oom_refused(what, extra * pool.unit_bytes, device, free, total):
        pool.grow(extra)


@contextmanager
def _driver_oom_refused(what: str, need: int, device: int, free: int, total: int) -> Iterator[None]:
    """The driver's CUDA_ERROR_OUT_OF_MEMORY inside becomes PoolRefused; other errors pass."""
    try:
        yield
    except RuntimeError as exc:
        if "OUT_OF_MEMORY" not in str(exc):
            raise
        why = pool_refusal(
            what=what, pool_bytes=need, free=free, total=total, device=device, driver_error=str(exc)
        )
        _refuse_if(why, exc)


def _refuse_if(message: str | None, cause: BaseException | None = None) -> None:
    if message:
        record_refusal(message)  # the launcher prints it as its one error line
        raise PoolRefused(message) from cause
