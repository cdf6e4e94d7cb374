"""How the HBM pool is lent between the device cache's tail and the swap table (``--reap-cache-slots``):
the pinned form (``core+dlfu``) keeps the plan core pinned and lends each layer a tail of cache
slots out of the pool, and the swap table keeps the rest (K). The CUDA device
(engine/device_cache/lending.py's CacheConfig.split), accounting mode (cache/accounting.py) and
the bench's ``plan-swap+cache`` arm must agree on that split, on its refusals and on their
sentences word for word, so the rules live here once, apart from the ``--reap-budget`` split of
device memory (memory_split.py): the tail per layer, K, the refusal of a resident set wider than K
and the small-tail warning. Pure arithmetic (no torch, no vLLM).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from reap_swap.sizing.quant.budget import pool_slots


def slots_beyond_pinned(num_slots: int, pinned: Mapping[int, Iterable[int]]) -> int:
    """Pool slots not taken by the pinned set (core + active set): what a device cache may use
    (`--reap-cache-slots auto`)."""
    return max(int(num_slots) - sum(len(set(v)) for v in pinned.values()), 0)


def pinned_tail_split(
    pool_slots: int, num_layers: int, pinned: Mapping[int, Iterable[int]], setting: int | str
) -> tuple[int, str | None]:
    """(cache tail slots per layer, why the cache cannot engage or None): the device cache's pinned
    form (``core+dlfu``, device_cache_engine.CacheConfig.split) and accounting mode's same policy
    (cache_accounting) share this rule. ``setting``: --reap-cache-slots, ``auto`` (the pool's slots
    beyond the pinned set, evenly per layer) or N (N // layers each); remainders are not lent. Refused:
    fewer than one slot per layer, more than the pool, or a lending that leaves the swap table
    (swap_slots_after_lending) fewer slots than the pinned set (CUDA pins it there at load)."""
    layers = max(int(num_layers), 1)
    if setting == "auto":
        beyond = slots_beyond_pinned(pool_slots, pinned)
        per_layer = beyond // layers
        if per_layer <= 0:  # e.g. every expert pinned: no tail, no cost
            return 0, (
                f"--reap-cache-slots auto: {beyond} pool slot(s) beyond the pinned set, fewer than one "
                f"per layer ({num_layers} layers, pool {pool_slots})"
            )
        return per_layer, None
    per_layer = int(setting) // layers
    if per_layer <= 0:
        return 0, "--reap-cache-slots is 0" if int(setting) <= 0 else (
            f"--reap-cache-slots {setting} < one per layer ({num_layers} layers)"
        )
    if per_layer * num_layers > pool_slots:
        return per_layer, (
            f"{num_layers} layers x {per_layer} cache slots = {per_layer * num_layers} > the pool's {pool_slots}"
        )
    held = sum(len(set(v)) for v in pinned.values())
    if held + per_layer * num_layers > pool_slots:  # the swap table could not hold the pinned set
        return per_layer, (
            f"{num_layers} layers x {per_layer} cache slots = {per_layer * num_layers} leave "
            f"{pool_slots - per_layer * num_layers} of the pool's {pool_slots} for swaps, fewer than the "
            f"pinned set's {held}"
        )
    return per_layer, None


SMALL_TAIL_TOP_K = 2  # the pinned form wants >= 2 x top_k tail slots per layer (research.md "cachetail")


def small_tail_note(
    per_layer: int, top_k: int, pool_slots: int, pinned_slots: int, num_layers: int
) -> str | None:
    """The sentence for the log and /reap/status ``cache.tail_note`` when the pinned form
    (core+dlfu, device and accounting alike) engages with fewer than 2 x top_k tail slots per layer;
    None when the tail is large enough, or when there is no tail (that is a refusal, said apart)."""
    want = SMALL_TAIL_TOP_K * int(top_k)
    if per_layer <= 0 or top_k <= 0 or per_layer >= want:
        return None
    return (
        f"core+dlfu cache tail of {per_layer} slot(s) per layer is below 2 x top_k = {want} (top_k "
        f"{top_k}; pool {pool_slots} slots, {pinned_slots} of them the pinned plan core, {num_layers} "
        "layers): with so few tail slots the cache thrashes; in simulation at 12.5 % of expert bytes such "
        "plans had 6-12 points less expert hit rate (more host reads) than the same cache on a core capped "
        "for a 2 x top_k tail (research.md 'cachetail'). Remedy: re-plan with `reap-swap plan --cache-tail auto` (each "
        "layer's core capped to leave 2 x top_k tail slots; at small budgets the core may become small "
        "or empty, a layout NOT yet verified on a GPU), or a larger budget (a plan with a larger "
        "--budget-ratio/--budget-gib; a larger --reap-budget where it may grow the pool, not with "
        "--reap-cache-device on)"
    )


def swap_slots_after_lending(pool_slots: int, num_layers: int, per_layer: int, refusal: str | None) -> int:
    """K, the pool slots the swap table keeps in the pinned form: the pool less the lent tail
    (layers x per_layer), or the whole pool when the cache is refused (nothing lent). CacheConfig.split
    returns it on CUDA; accounting mode refuses a swap wider than it, as the CUDA table does."""
    return int(pool_slots) if refusal else int(pool_slots) - int(per_layer) * int(num_layers)


def swap_table_refusal(
    needed: int, swap_slots: int, lent: int, layers: int, per_layer: int | None = None
) -> str:
    """The refusal of a resident set wider than the swap table beside lent cache tails: one sentence
    for CUDA's SlotTable.plan and accounting mode's check_swap (both raise PoolCapacityError with
    it). ``swap_slots``: K; ``lent``: the pool slots lent to the cache tails (the pool is K + lent);
    ``layers`` / ``per_layer``: the lending, ``layers x per_layer = lent`` in the pinned form
    (swap_slots_after_lending); ``per_layer`` None where the layers lend different counts (the
    seeded device's C_l)."""
    split = f"{layers} layers x {per_layer} = {lent}" if layers and per_layer is not None else f"{lent}"
    over = f" of {layers} layers" if layers and per_layer is None else ""
    # The remedies that make this set fit, whatever the setting (a server already at `swaps` was once
    # told to pass `swaps`). Pinned: N // layers a layer is lent, so N <= lent - overflow fits; below
    # one slot a layer the cache is refused and the whole pool swaps. Seeded: C_l = core + N spread.
    overflow = needed - swap_slots
    fit = lent - overflow
    if per_layer is None:
        lend = f"lend {overflow} fewer (--reap-cache-slots N lower by {overflow} or more)"
    elif layers and fit < layers:
        lend = "serve without the cache (--reap-cache off: it lends at least one slot a layer)"
    else:
        lend = f"lend at most {fit} (--reap-cache-slots N <= {fit})"
    return (
        f"resident set needs {needed} expert slots but the swap table has {swap_slots} (overflow "
        f"{overflow} experts): the HBM pool of {swap_slots + lent} slots less {split} lent to the cache "
        f"tails{over}; ask for at most {swap_slots} experts, {lend}, or serve a plan with a larger budget"
    )


def swap_cache_split(
    pool_slots: int, core_slots: int, num_layers: int, top_k: int
) -> tuple[int, int, str | None]:
    """(tail slots per layer, K the swap table keeps, why not) for the cache *and* per-request swaps
    in the pinned form (the bench's ``plan-swap+cache``). With ``--reap-cache-slots auto`` the tail
    takes every slot beyond the core, so K = the core and no swap beyond it fits (research.md
    "acctail"); this split leaves the swaps half of what lies beyond the core, with the tail at most
    2 x top_k per layer (SMALL_TAIL_TOP_K, research.md "cachetail")."""
    layers = max(int(num_layers), 1)
    beyond = (int(pool_slots) - int(core_slots)) // layers
    per_layer = min(SMALL_TAIL_TOP_K * int(top_k), beyond // 2)
    if per_layer < 1:
        return (
            0,
            int(pool_slots),
            (
                f"the pool's {pool_slots} slots leave {beyond} per layer beyond the plan core ({core_slots} "
                f"experts, {num_layers} layers): too few to split between a cache tail and per-request swaps"
            ),
        )
    return per_layer, int(pool_slots) - per_layer * layers, None


@dataclass(frozen=True)
class PlanSwapSplit:
    """swap_cache_split on a plan's pool: what ``--reap-cache-slots swaps`` serves and the bench's
    ``plan-swap+cache`` arm passes (``cache_slots`` = layers x per_layer; per-request swaps fit K)."""

    pool: int  # the engine's pool slots (quant_budget.pool_slots of the budget)
    core: int  # the plan core's slots
    layers: int
    per_layer: int  # cache tail slots per layer
    kept: int  # K, the swap table the lending leaves
    why: str | None  # no room for both (per_layer 0, kept = pool)

    @property
    def cache_slots(self) -> int:
        return self.per_layer * self.layers


def plan_swap_split(plan: Any, top_k: int, budget_bytes: int | None = None) -> PlanSwapSplit:
    """The split of ``plan``'s pool (its budget, or ``budget_bytes``) as engine._ensure_pool sizes it."""
    per_expert = int(plan.per_expert_bytes)
    budget = int(plan.swappable_budget_bytes) if budget_bytes is None else int(budget_bytes)
    pool = pool_slots(budget, per_expert)
    core = int(plan.core_bytes()) // per_expert  # the plan core's slots (the swap table pins it)
    per_layer, kept, why = swap_cache_split(pool, core, len(plan.layers), int(top_k))
    return PlanSwapSplit(pool, core, len(plan.layers), per_layer, kept, why)
