"""The device cache's slot arithmetic, in one place: slots per layer, the pool's tails, lent slots, K.

How the HBM pool (``pool_slots`` of the plan's budget) is lent between the device cache and the
swap table (``--reap-cache-slots``): the pinned form (``core+dlfu``) keeps the plan core pinned
and lends each layer a tail of cache slots out of the pool, and the swap table keeps the rest (K);
the seeded form (``--reap-cache-seed seeded``) lends each layer its C_l = core + a share of the
tail (layer_slots ``core+tail``, the simulator's per-layer slots too); ``--reap-cache-slots swaps``
splits the pool so per-request swaps keep room (plan_swap_split). The CUDA device
(engine/device_cache/lending.py's CacheConfig.split), accounting mode (cache/accounting.py, through
tail_slots / device_tail / swap_capacity here), the simulator (cache/replay.py, cache/probe.py),
the swap resolution's pool (plan/pool_fill.py) and the bench's ``plan-swap+cache`` arm must agree
on these numbers, on their refusals and on their sentences word for word, so the rules live here
once, apart from the ``--reap-budget`` split of device memory (memory_split.py). Pure arithmetic on
duck-typed plans (``layers`` with ``core``, ``per_expert_bytes``, ``swappable_budget_bytes``): no
torch, no vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from reap_swap.sizing.quant.budget import pool_slots

DEVICE_FORM = "core+dlfu"  # the plan core pinned, the tail slots per layer by the device's rule
SMALL_TAIL_TOP_K = 2  # the pinned form wants >= 2 x top_k tail slots per layer (research.md "cachetail")

# ----------------------------------------------------------------------------- counts


def pinned_count(pinned: Mapping[int, Iterable[int]]) -> int:
    """The slots a pinned set (layer -> experts) holds: its distinct experts over all layers."""
    return sum(len(set(v)) for v in pinned.values())


def core_slots(plan: Any) -> int:
    """The plan core's slots: its core experts over all layers (the swap table pins them)."""
    return sum(len(p.core) for p in plan.layers.values())


def plan_pool_slots(plan: Any, budget_bytes: int | None = None) -> int:
    """The pool's slots on ``plan``'s budget (or ``budget_bytes``), as engine._ensure_pool sizes it
    (quant_budget.pool_slots: the experts the budget holds)."""
    budget = plan.swappable_budget_bytes if budget_bytes is None else budget_bytes
    return pool_slots(int(budget), int(plan.per_expert_bytes))


def slots_beyond_pinned(num_slots: int, pinned: Mapping[int, Iterable[int]]) -> int:
    """Pool slots not taken by the pinned set (core + active set): what a device cache may use
    (`--reap-cache-slots auto`)."""
    return max(int(num_slots) - pinned_count(pinned), 0)


def cache_slots_per_layer(setting: int | str, num_layers: int) -> int:
    """``--reap-cache-slots N``'s tail per layer in the pinned form: N // layers (the remainder is
    not lent)."""
    return int(setting) // max(int(num_layers), 1)


# ----------------------------------------------------------------------------- the pinned form


def pinned_tail_split(
    pool_slots: int, num_layers: int, pinned: Mapping[int, Iterable[int]], setting: int | str
) -> tuple[int, str | None]:
    """(cache tail slots per layer, why the cache cannot engage or None): the device cache's pinned
    form (``core+dlfu``, CacheConfig.split) and accounting mode's same policy (device_tail) share
    this rule. ``setting``: --reap-cache-slots, ``auto`` (the pool's slots beyond the pinned set,
    evenly per layer) or N (cache_slots_per_layer); remainders are not lent. Refused: fewer than
    one slot per layer, more than the pool, or a lending that leaves the swap table
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
    per_layer = cache_slots_per_layer(setting, layers)
    if per_layer <= 0:
        return 0, "--reap-cache-slots is 0" if int(setting) <= 0 else (
            f"--reap-cache-slots {setting} < one per layer ({num_layers} layers)"
        )
    if per_layer * num_layers > pool_slots:
        return per_layer, (
            f"{num_layers} layers x {per_layer} cache slots = {per_layer * num_layers} > the pool's {pool_slots}"
        )
    held = pinned_count(pinned)
    if held + per_layer * num_layers > pool_slots:  # the swap table could not hold the pinned set
        return per_layer, (
            f"{num_layers} layers x {per_layer} cache slots = {per_layer * num_layers} leave "
            f"{pool_slots - per_layer * num_layers} of the pool's {pool_slots} for swaps, fewer than the "
            f"pinned set's {held}"
        )
    return per_layer, None


# ----------------------------------------------------------------------------- the small-tail warning


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


# ----------------------------------------------------------------------------- K, the swap table's slots


def swap_slots_after_lending(pool_slots: int, lent: int, refusal: str | None) -> int:
    """K, the pool slots the swap table keeps: the pool less the ``lent`` slots (the pinned form's
    layers x per_layer, the seeded form's C_l summed), or the whole pool when the cache is refused
    (nothing lent). CacheConfig.split returns it on CUDA; accounting mode refuses a swap wider than
    it, as the CUDA table does."""
    return int(pool_slots) if refusal else int(pool_slots) - int(lent)


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


# ----------------------------------------------------------------------------- room for swaps (--reap-cache-slots swaps)


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
    pool, core = plan_pool_slots(plan, budget_bytes), core_slots(plan)
    per_layer, kept, why = swap_cache_split(pool, core, len(plan.layers), int(top_k))
    return PlanSwapSplit(pool, core, len(plan.layers), per_layer, kept, why)


# ----------------------------------------------------------------------------- per-layer slots, the seeded form


def _spread(total: int, layers: Sequence[int]) -> dict[int, int]:
    """``total`` slots over the layers, evenly; the remainder to the lowest layer indices."""
    base, extra = divmod(max(0, total), len(layers))
    return {layer: base + (1 if i < extra else 0) for i, layer in enumerate(sorted(layers))}


def layer_slots(
    total: int,
    layers: Sequence[int],
    core: Mapping[int, frozenset[int]] | None,
    allocation: str,
    num_experts: int,
) -> tuple[dict[int, int], str]:
    """Per-layer slots and how they were chosen. ``core+tail``: each layer's core plus an even share
    of what the budget leaves after the whole core (the device design: a tail beside the pinned
    set); without a plan, or when the core does not fit the budget, it falls back to ``uniform``
    (the simulator checks its --layer-slots choice, replay.ALLOCATIONS, before it asks)."""
    core_total = sum(len(core[l]) for l in layers) if core else 0
    if allocation == "core+tail" and core and core_total <= total:
        tail = _spread(total - core_total, layers)
        slots, how = {l: len(core[l]) + tail[l] for l in layers}, "core+tail"
    else:
        why = "" if allocation == "uniform" else (" (no plan)" if not core else " (the core does not fit)")
        slots, how = _spread(total, layers), "uniform" + why
    return {l: min(num_experts, s) for l, s in slots.items()}, how


def seeded_split(
    pool_slots: int, core: Mapping[int, frozenset[int]], tail: int | str
) -> tuple[dict[int, int], str | None]:
    """``--reap-cache-seed seeded``'s cache slots per layer, C_l = layer_slots(core + tail, ...,
    "core+tail") uncapped (``tail`` "auto": the whole pool), and why the device refuses them (None:
    it lends them): the core does not fit, or core + tail exceeds the pool. The CUDA device's split
    (CacheConfig.split_seeded) and accounting mode's swap capacity (swap_capacity) both run it."""
    total = pool_slots if tail == "auto" else sum(len(c) for c in core.values()) + int(tail)
    slots, how = layer_slots(total, sorted(core), core, "core+tail", 1 << 30)
    want = sum(slots.values())
    if not core or how != "core+tail":
        return slots, f"--reap-cache-seed seeded: the plan core does not fit the {total} slots ({how})"
    if want > pool_slots:
        return slots, f"--reap-cache-seed seeded: core + tail = {want} slots > the pool's {pool_slots}"
    return slots, None


# ----------------------------------------------------------------------------- as accounting mode asks it
# What the CUDA device would lend the cache, and so which swaps it admits: accounting mode moves
# no bytes, so its cache counts and its swap refusals match CUDA only if it sizes the tail and the
# swap table as the device does; these put the device's questions to the rules above and say where
# each number came from, for /reap/status and the log (cache/accounting.py holds the cache itself).


def tail_slots(plan, setting: int | str, pool_tail_slots: Callable[[], int | None] | None) -> tuple[int, str]:
    """(cache slots beyond the pinned set over all layers, where the number came from): accounting
    mode's tail beside the core in every form but the device's pinned one (device_tail)."""
    if setting != "auto":
        return int(setting), "--reap-cache-slots"
    if pool_tail_slots is not None:
        n = pool_tail_slots()
        if n is not None:
            return int(n), "the pool's slots beyond the pinned set"
    budget, core = plan_pool_slots(plan), core_slots(plan)
    return max(0, budget - core), f"plan budget ({budget} experts) minus the plan core ({core})"


def device_tail(plan, setting: int | str, pool_tail_slots=None) -> tuple[int, str, str | None, int, int]:
    """(tail slots per layer, where from, why the device would not engage, K the slots the swap
    table keeps, the pool): the CUDA device's pinned form (CacheConfig.split on the pool of the
    plan's budget, pinned = the plan core) by the rules they share (pinned_tail_split,
    swap_slots_after_lending)."""
    core = {l: p.core for l, p in plan.layers.items()}
    pool, source = device_pool(plan, setting, pool_tail_slots)
    per_layer, refusal = pinned_tail_split(pool, len(plan.layers), core, setting)
    kept = swap_slots_after_lending(pool, per_layer * len(plan.layers), refusal)
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
    the device would refuse its split (seeded_split: core + tail beyond the pool), which
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
    pool = plan_pool_slots(plan)
    if setting == "auto" and pool_tail_slots is not None and pool_tail_slots() is not None:
        return int(pool_tail_slots()) + core_slots(plan), "the pool's slots beyond the pinned set"
    return pool, f"pool of {pool} slots (the plan budget)"
