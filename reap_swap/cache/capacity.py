"""What the CUDA device would lend the cache, and so which swaps it admits, as accounting mode
counts it: the cache slots beyond the plan core over all layers (tail_slots), the pinned form's
tail per layer by the device's rule on the pool of the plan's budget (device_tail, device_pool),
and the swap capacity of a CUDA server started with the same flags (swap_capacity). Accounting
mode moves no bytes, so its cache counts and its swap refusals match CUDA only if it sizes the
tail and the swap table as the device does; this module puts the device's questions to the shared
rules (sizing/cache_tail.py, replay.seeded_split) and says where each number came from, for
/reap/status and the log (cache/accounting.py holds the cache itself).
"""

from __future__ import annotations

from collections.abc import Callable

from reap_swap.cache.replay import seeded_split
from reap_swap.sizing.cache_tail import pinned_tail_split, swap_slots_after_lending
from reap_swap.sizing.quant.budget import pool_slots

DEVICE_FORM = "core+dlfu"  # the plan core pinned, the tail slots per layer by the device's rule


def tail_slots(plan, setting: int | str, pool_tail_slots: Callable[[], int | None] | None) -> tuple[int, str]:
    """(cache slots beyond the pinned set over all layers, where the number came from)."""
    if setting != "auto":
        return int(setting), "--reap-cache-slots"
    if pool_tail_slots is not None:
        n = pool_tail_slots()
        if n is not None:
            return int(n), "the pool's slots beyond the pinned set"
    budget = int(plan.swappable_budget_bytes) // int(plan.per_expert_bytes)
    core = sum(len(p.core) for p in plan.layers.values())
    return max(0, budget - core), f"plan budget ({budget} experts) minus the plan core ({core})"


def device_tail(plan, setting: int | str, pool_tail_slots=None) -> tuple[int, str, str | None, int, int]:
    """(tail slots per layer, where from, why the device would not engage, K the slots the swap
    table keeps, the pool): the CUDA device's pinned form (CacheConfig.split on the pool of the
    plan's budget, pinned = the plan core) by the rules they share (cache_tail.pinned_tail_split,
    swap_slots_after_lending)."""
    core = {l: p.core for l, p in plan.layers.items()}
    pool, source = device_pool(plan, setting, pool_tail_slots)
    per_layer, refusal = pinned_tail_split(pool, len(plan.layers), core, setting)
    kept = swap_slots_after_lending(pool, len(plan.layers), per_layer, refusal)
    how = "auto: beyond the plan core" if setting == "auto" else f"--reap-cache-slots {setting}"
    return per_layer, f"{how}, // {len(plan.layers)} layers, {source}", refusal, kept, pool


def swap_capacity(
    plan, name: str, setting, pool_tail_slots, cache_device: str
) -> tuple[int | None, bool, str, tuple[int, int] | None]:
    """(K or None for the whole pool, per-layer C_l check, how, the lending (layers, N per layer)
    beside K for the refusal's sentence): the swap capacity of the CUDA server started with the
    same flags, which accounting's check_swap enforces.

    --reap-cache-device off (CUDA's default) or lru (refused by name there): the CUDA server lends
    nothing, its swap table is the whole pool (the plan budget, checked by the API process).
    lfu, seed pinned, device on: K = the pool less the lent tail (CacheConfig.split's rule).
    lfu, seed seeded, device on: each layer's C_l (the seeded device, which CUDA serves whenever
    asked, pins a swap inside the layer's cache slots; SeededCapacityError), unless
    the device would refuse its split (replay.seeded_split: core + tail beyond the pool), which
    lends nothing: the whole pool. Either form refused by the device: the whole pool."""
    if cache_device != "on":
        return (
            None,
            False,
            (
                "--reap-cache-device off: the CUDA server lends no tail (its default), so a swap may fill "
                "the whole pool there and here; the cache counts model a tail the device would not lend"
            ),
            None,
        )
    if name not in (DEVICE_FORM, "dlfu-seeded"):
        whole = f"{name}: the CUDA device has no such cache and lends nothing: the whole pool"
        return None, False, whole, None
    if name == "dlfu-seeded":
        pool, _source = device_pool(plan, setting, pool_tail_slots)
        _slots, refusal = seeded_split(pool, {l: frozenset(p.core) for l, p in plan.layers.items()}, setting)
        if refusal:
            return _device_refused(refusal)
        seeded = "--reap-cache-seed seeded on the device: each layer's set within its cache slots"
        return None, True, seeded, None
    per_layer, _source, refusal, kept, pool = device_tail(plan, setting, pool_tail_slots)
    if refusal:
        return _device_refused(refusal)
    return (
        kept,
        False,
        (
            f"the pool of {pool} slots less {len(plan.layers)} layers x {per_layer} lent to the cache tail, "
            "as the CUDA device splits it"
        ),
        (len(plan.layers), per_layer),
    )


def _device_refused(refusal: str) -> tuple[None, bool, str, None]:
    """swap_capacity where the CUDA device would refuse the cache: nothing lent, the whole pool."""
    return (
        None,
        False,
        f"the CUDA device cache would be refused ({refusal}): nothing lent, the whole pool",
        None,
    )


def device_pool(plan, setting: int | str, pool_tail_slots=None) -> tuple[int, str]:
    """(the pool's slots device_tail splits, where the number came from)."""
    pool = pool_slots(int(plan.swappable_budget_bytes), int(plan.per_expert_bytes))
    if setting == "auto" and pool_tail_slots is not None and pool_tail_slots() is not None:
        core = sum(len(p.core) for p in plan.layers.values())
        return int(pool_tail_slots()) + core, "the pool's slots beyond the pinned set"
    return pool, f"pool of {pool} slots (the plan budget)"
