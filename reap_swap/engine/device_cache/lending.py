"""The CUDA engine's side of the device cache: lend N pool slots per layer, re-home a
layer with its slot units, engage the cache. Off unless CudaEngine is given a CacheConfig.

The pool (engine._ensure_pool, the plan's budget) is split once: slots [0, K) stay with the swap
SlotTable (plan core and per-request swaps), slots [K, K + L*N) are lent, N per cached layer, as
the slot units of that layer's CacheRange (the same HBM allocation mapped a second time; the
pool keeps ownership). K = pool - L*N where L = the plan's layer count; a pool too small for the
lending refuses the cache on every layer, by reason, and keeps the plain engine.

``seed_core``: True = the simulator's ``dlfu-seeded`` (the plan core goes into the cache slots,
evictable); False = ``core+dlfu`` (the engine pins the core in its own units as before; the cache
runs on the N-slot tail). With ``seed_core`` and ``layer_slots`` (``--reap-cache-seed seeded``)
each layer lends its own count C_l = accounting mode's ``cache_tail.layer_slots(core + tail, ...,
"core+tail")`` (auto: the whole pool is core + tail), so K is only the pool's remainder and a
per-request swap is pinned inside the layer's slots (device_cache_seeded.py). The arithmetic (the
tails, C_l, K, the refusals) is sizing/cache_tail.py's; this module applies it to the pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from reap_swap.cache.slot_table import SlotTable
from reap_swap.compat import moe_cache
from reap_swap.engine.device_cache.api import DeviceCaches
from reap_swap.engine.device_cache.range import rehome_with_slots
from reap_swap.sizing.cache_tail import (
    pinned_count,
    pinned_tail_split,
    seeded_split,
    swap_slots_after_lending,
)


@dataclass
class CacheConfig:
    caches: DeviceCaches
    slots_per_layer: int
    seed_core: bool = False
    lent: dict[int, int] = field(default_factory=dict)  # layer -> first lent pool slot
    refusal: str | None = None  # why no layer can be cached (set when the pool is split)
    auto: bool = False  # --reap-cache-slots auto: the pool's slots beyond the pinned set, per layer
    layer_slots: dict[int, int] | None = None  # seeded: layer -> its C_l (set by split)
    tail_total: int = 0  # seeded, --reap-cache-slots N: N (the tail beyond the core, all layers)
    lent_slots: dict[int, int] = field(default_factory=dict)  # layer -> slots lent to it
    slots_setting: int | str | None = None  # --reap-cache-slots as given (split's rule: pinned_tail_split)
    pool_slots: int | None = None  # the pool split() divided (pinned form; for /reap/status's tail_note)
    pinned_slots: int = 0  # the plan core split() left to the swap table (pinned form)

    def slots_of(self, index: int) -> int:
        if self.layer_slots is not None:
            return self.layer_slots.get(index, 0)
        return self.slots_per_layer

    def split_seeded(self, pool_slots: int, core) -> int:
        """--reap-cache-seed seeded: C_l per layer as accounting mode computes it (cache_tail.seeded_split,
        which accounting's swap capacity runs too); K = the rest."""
        core = {l: frozenset(c) for l, c in (core or {}).items()}
        self.layer_slots, refusal = seeded_split(pool_slots, core, "auto" if self.auto else self.tail_total)
        self.slots_per_layer = min(self.layer_slots.values(), default=0)
        if refusal:
            self.refusal = refusal
        return swap_slots_after_lending(pool_slots, sum(self.layer_slots.values()), self.refusal)

    def split(self, pool_slots: int, num_layers: int, pinned=None) -> int:
        """Slots kept for swaps (K); records a refusal when the lending does not fit. ``pinned``:
        layer -> the plan core (what auto leaves to the swap table)."""
        if self.seed_core and self.layer_slots is not None:
            return self.split_seeded(pool_slots, pinned)
        # the rule accounting mode shares (cache_tail.pinned_tail_split; parity: tests/test_cache_device_form.py)
        setting = "auto" if self.auto else self.slots_setting
        if setting is None:  # built without the raw setting (tests, standalone): N per layer given
            setting = self.slots_per_layer * num_layers
        self.slots_per_layer, refusal = pinned_tail_split(pool_slots, num_layers, pinned or {}, setting)
        self.refusal = self.refusal or refusal
        self.pool_slots = pool_slots  # recorded only (cache_tail.small_tail_note); the split is as before
        self.pinned_slots = pinned_count(pinned or {})
        return swap_slots_after_lending(pool_slots, self.slots_per_layer * num_layers, self.refusal)


def swap_table(cache: CacheConfig | None, num_slots: int, plan: Any) -> SlotTable:
    """The swap SlotTable on a pool of ``num_slots`` (engine._ensure_pool): the whole pool without a
    cache or a plan, else K = CacheConfig.split's, beside the slots [K, num_slots) lent to the cache
    tails, with the lending its refusal names (cache_tail.swap_table_refusal): the plan's layers,
    N each in the pinned form, C_l each seeded (per layer None there: the counts differ)."""
    if cache is None or plan is None:
        return SlotTable(num_slots)
    kept = cache.split(num_slots, len(plan.layers), {l: p.core for l, p in plan.layers.items()})
    lent = num_slots - kept
    if not lent:
        return SlotTable(kept)
    per_layer = None if cache.layer_slots is not None else cache.slots_per_layer
    return SlotTable(kept, lent=lent, lent_layers=len(plan.layers), lent_per_layer=per_layer)


def rehome_layer(cfg: CacheConfig, st: Any, layer: Any, index: int, w13, w2, unit_bytes: int):
    """(rng, range_bytes, w13 view, w2 view, ext views or None): with slot units when the cache can
    engage on this layer, else None for the caller to use state.rehome (and a refusal recorded)."""
    n = _layer_slots(cfg, index, w13)
    first = st.table.num_slots + sum(cfg.lent_slots.values())
    reason = _cache_reason(cfg, st)
    if reason is None and first + n > st.pool.num_slots:
        reason = f"pool slots {first}..{first + n - 1} do not exist (pool of {st.pool.num_slots})"
    layer_reason = None if reason else moe_cache.cache_refusal(layer)
    if reason or layer_reason:
        _refuse_layer(cfg, st, index, n, reason, layer_reason)
        return None
    handles = [st.pool.slot_handle(s) for s in range(first, first + n)]
    rng, range_bytes, (v13, v2), ext = rehome_with_slots(w13, w2, unit_bytes, n, st.device, handles)
    cfg.lent[index], cfg.lent_slots[index] = first, n
    return rng, range_bytes, v13, v2, ext


def _cache_reason(cfg: CacheConfig, st: Any) -> str | None:
    """Why no layer of this engine can be cached (nothing is lent then), or None."""
    return cfg.refusal or ("no plan: the pool is not split" if st.plan is None else None)


def _layer_slots(cfg: CacheConfig, index: int, w13) -> int:
    n = cfg.slots_of(index)
    if cfg.layer_slots is not None and w13 is not None:  # as accounting's layer_slots: at most E
        n = min(n, int(w13.shape[0]))
    return n


def _refuse_layer(
    cfg: CacheConfig, st: Any, index: int, n: int, reason: str | None, layer_reason: str | None
):
    """Record why the layer is not cached; a layer's own reason in the seeded form, before anything
    was lent, gives its n slots back to the swap table (which then holds its core)."""
    cfg.caches.refuse(index, reason or layer_reason)
    if layer_reason and cfg.layer_slots is not None and not cfg.lent_slots:
        st.table.grow(n)  # seeded, nothing lent yet: [K, K + n) back to the swap table (its core)
        st.table.lent = max(0, st.table.lent - n)
        st.table.lent_layers = max(0, st.table.lent_layers - 1)


def rehome_plain(cfg: CacheConfig, st: Any, layer: Any, index: int, tensors, bound):
    """rehome_layer on a layer whose re-homed unit is w13 then w2 and nothing else (no aliases; the
    per-expert scales and biases stay whole and get slot rows at engage), the only kind the cache
    engages on; else None for state.rehome, with the refusal recorded by name."""
    w13 = tensors.get("w13_weight")
    plain = (
        set(tensors) == {"w13_weight", "w2_weight"}
        and not bound.aliases
        and bound.layout.offset_of("w2_weight") == w13[0].numel() * w13.element_size()
    )
    if not plain:
        names = sorted(set(tensors) | set(bound.aliases))
        why = (
            f"re-homed unit holds {', '.join(names)}: the cache's slot units copy a w13_weight + w2_weight unit only"
            if names != ["w13_weight", "w2_weight"]
            else "w2_weight does not start right after w13_weight in the unit (the slot views assume it)"
        )
        reason = _cache_reason(cfg, st)
        _refuse_layer(cfg, st, index, _layer_slots(cfg, index, w13), reason, None if reason else why)
        return None
    return rehome_layer(cfg, st, layer, index, w13, tensors["w2_weight"], bound.layout.unit_bytes)


def engage(cfg: CacheConfig, st: Any, layer: Any, index: int, rng, range_bytes, ext) -> None:
    """After the core swap (or instead of it, with seed_core): start the layer's cache."""
    core = set(st.plan.layers[index].core) if st.plan is not None else set()
    if cfg.seed_core:
        cfg.caches.engage(layer, index, rng, range_bytes, ext, seed=sorted(core)[: cfg.slots_of(index)])
    elif cfg.caches.engage(layer, index, rng, range_bytes, ext):
        cfg.caches.on_swap(index, core)
