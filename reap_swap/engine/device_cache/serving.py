"""The device cache in serving: from the settings to a CacheConfig, and the worker's view
of the engaged caches in the shape cache_accounting's surfaces read (/reap/status "cache" section,
cache_surface's Prometheus counters).

On by default on CUDA: the launcher resolves ``--reap-cache-device auto`` (settings.cache_form) to
on wherever the device cache is served (one GPU per model, private units, the plan's pool, lfu)
and ``--reap-cache-seed auto`` to seeded there, so the workers see on/off and pinned/seeded. The
seeded form (``dlfu-seeded``, the integer LFU with decay of cache_policy.device): every layer's
core + tail share of the pool is cache slots seeded with the plan core, evictable, and a
per-request swap pins its set inside them (device_cache_seeded.py); /reap/status reports each
layer's slots as ``pin_capacity``, which the API process cuts wider sets to. The pinned form
(``core+dlfu``, ``--reap-cache-seed pinned`` or ``--reap-cache-slots swaps``): the plan core pinned
in its own units by the engine, the cache on the tail. ``--reap-cache lru`` has no device form.
CPU accounting mode (state only, no bytes) runs the same integer policies (cache/accounting.py).

The pinned form with fewer than 2 x top_k tail slots per layer logs one WARNING and shows
``tail_note`` in /reap/status (cache_tail.small_tail_note, as accounting mode; the engine's split
is unchanged, only its pool and pinned counts are recorded for the note).

Counters are read between steps (the status RPC on the engine-core thread: one ``.tolist()`` per
layer there, nothing on the step path; the per-step stream of accounting mode is not used).
"""

from __future__ import annotations

from typing import Any

from reap_swap import get_logger
from reap_swap.cache.online import LFU_DECAY
from reap_swap.engine.device_cache.api import DeviceCaches
from reap_swap.engine.device_cache.lending import CacheConfig
from reap_swap.engine.device_cache.shadow import shadow_mode
from reap_swap.sizing.cache_tail import cache_slots_per_layer, small_tail_note

log = get_logger("reap_swap.cache")


def cache_config_for(settings: Any, plan: Any) -> tuple[CacheConfig | None, str | None]:
    """(config, None) when the device cache should engage, else (None, why not)."""
    if settings.cache.policy == "off":
        return None, "--reap-cache off"
    if settings.cache.device != "on":
        return None, "device cache off (--reap-cache-device off, or not served here: the launcher logged why)"
    if settings.cache.policy != "lfu":
        return None, f"--reap-cache {settings.cache.policy}: the device cache implements lfu (dlfu) only"
    auto = settings.cache.slots == "auto"
    per_layer = 0 if auto else cache_slots_per_layer(settings.cache.slots, len(plan.layers))
    shadow = shadow_mode(settings)
    if shadow is not None:
        log.warning(
            "reap-swap cache: --reap-cache-shadow %s: every cached MoE step also runs the uncached "
            "kernel and compares (debug; /reap/status cache.shadow)",
            shadow,
        )
    caches = DeviceCaches(decay=LFU_DECAY, step="triton", shadow=shadow)
    if settings.cache.seed == "seeded":
        tail = 0 if auto else int(settings.cache.slots)
        return CacheConfig(caches, 0, seed_core=True, auto=auto, layer_slots={}, tail_total=tail), None
    cfg = CacheConfig(caches, slots_per_layer=per_layer, seed_core=False, auto=auto)
    cfg.slots_setting = settings.cache.slots  # split: cache_tail.pinned_tail_split, as accounting
    return cfg, None


class DeviceCacheView:
    """What WorkerCore holds as ``cache`` when the device cache is built: status() and totals() in
    cache_accounting's shape; no per-step stream (``caches`` is empty, so WorkerCore takes no
    counter snapshots); ``pin`` is a no-op because cuda_backend.apply calls ``on_swap`` itself."""

    caches: dict = {}  # noqa: RUF012 - read-only marker for WorkerCore.cache_before_step
    record = None

    def __init__(self, cfg: CacheConfig, top_k: int = 0) -> None:
        self.cfg = cfg
        self.top_k = top_k  # the model's (worker.build_cache); 0: unknown, no tail_note
        self._tail_note: str | None = None
        self._tail_checked = False
        self.tail_note()  # the pool is split at the first layer's load, before the worker builds this

    def tail_note(self) -> str | None:
        """The pinned form's tail below 2 x top_k per layer (cache_tail.small_tail_note), logged
        once as a WARNING when first known; None for seeded, a refused cache or an unsplit pool."""
        cfg = self.cfg
        if self._tail_checked or getattr(cfg, "pool_slots", None) is None:
            return self._tail_note
        self._tail_checked = True
        if not cfg.seed_core and cfg.refusal is None:
            layers = len(cfg.caches.status()["layers"]) or len(cfg.lent_slots)
            self._tail_note = small_tail_note(
                cfg.slots_per_layer, self.top_k, cfg.pool_slots, cfg.pinned_slots, layers
            )
            if self._tail_note:
                log.warning("reap-swap cache: %s", self._tail_note)
        return self._tail_note

    def step(self, rows, request_start: bool) -> None:  # the device counts inside the forward
        return None

    def pin(self, resident) -> None:
        return None

    def trace(self, reset: bool) -> list:
        return []

    def reset_counters(self) -> None:
        """Zero the device counters, at the controller's startup reset only (WorkerCore.reset_stats;
        swaps leave them cumulative): vLLM's startup forwards run the cache step too (a seeded
        server's /reap/status before any request showed 8192 tokens x top-8 selections per layer), so without this /reap/status and the metrics count tokens no request
        sent. The policy state (slots, scores) keeps what those forwards admitted."""
        self.cfg.caches.read_counters(reset=True)

    def totals(self) -> dict[str, int]:
        out = dict.fromkeys(("hits", "misses", "expert_hits", "expert_misses", "promotions"), 0)
        out.update(evictions=0, read_through_steps=0)
        for c in self.cfg.caches.read_counters().values():
            for k, v in counters_of(c).items():
                out[k] += v
        return out

    def status(self) -> dict[str, Any]:
        dev = self.cfg.caches.status()
        counts = self.cfg.caches.read_counters()
        layers: dict[str, Any] = {}
        for l, s in dev["layers"].items():
            layers[str(l)] = {
                "slots": s["slots"],
                "occupied": s["occupied"],
                "pinned": len(s["pinned"]),
                "tail_slots": s["active"],
                "resident": sorted(set(s["cached"]) | set(s["pinned"])),
                "side_rows": s.get("side_rows", []),  # per-expert scales / biases given slot rows
                "engaged": True,
                **counters_of(counts[l]),
                "counts": counts[l],
            }
        for l, why in dev["refused"].items():
            layers[str(l)] = {"engaged": False, "reason": why}
        reason = self.cfg.refusal
        return {
            "engaged": bool(dev["layers"]),
            "mode": "device",
            "policy": "dlfu-seeded" if self.cfg.seed_core else "core+dlfu",
            "lfu_decay": dev["decay"],
            "tail_slots": sum(self.cfg.lent_slots.get(int(l), 0) for l in dev["layers"])
            if self.cfg.seed_core
            else self.cfg.slots_per_layer * len(dev["layers"]),
            "tail_source": _tail_source(self.cfg),
            "steps": max((c["steps"] for c in counts.values()), default=0),
            "recording": 0,
            "totals": self.totals(),
            "layers": layers,
            **({"reason": reason} if reason else {}),
            **({"tail_note": note} if (note := self.tail_note()) else {}),
            "seed": _seed_status(self.cfg),
            # seeded: a swap pins inside each layer's slots, so a layer holds at most its slots
            **(
                {"pin_capacity": {str(l): s["slots"] for l, s in dev["layers"].items()}}
                if self.cfg.seed_core
                else {}
            ),
            **({"shadow": {str(k): v for k, v in dev["shadow"].items()}} if "shadow" in dev else {}),
        }


def _seed_status(cfg: CacheConfig) -> dict[str, Any]:
    """/reap/status cache.seed: the form asked and served (the same on CUDA and in accounting)."""
    served = "seeded" if cfg.seed_core else "pinned"
    return {"requested": served, "served": served}


def _tail_source(cfg: CacheConfig) -> str:
    if cfg.seed_core and cfg.layer_slots is not None:
        how = "the whole pool" if cfg.auto else f"the plan core + --reap-cache-slots {cfg.tail_total}"
        return f"--reap-cache-seed seeded: {how} as cache slots, per layer core+tail, seeded with the core"
    return "--reap-cache-slots auto: pool slots beyond the plan core" if cfg.auto else "--reap-cache-slots"


def counters_of(c: dict[str, int]) -> dict[str, int]:
    """cache_accounting.counters_of's names from the device counters (device_cache.COUNTER_NAMES)."""
    return {
        "hits": c["selection_hits"],
        "misses": c["selections"] - c["selection_hits"],
        "expert_hits": c["expert_hits"],
        "expert_misses": c["experts"] - c["expert_hits"],
        "promotions": c["admitted"],
        "evictions": c["evicted"],
        "read_through_steps": c["read_through_steps"],
    }


def on_swap(caches: DeviceCaches | None, target) -> None:
    """After a swap made ``target`` (layer -> experts) resident in their own units: those experts
    leave each layer's cache (the tail yields to the swap)."""
    if caches is None:
        return
    for layer, experts in target.items():
        emptied = caches.on_swap(int(layer), experts)
        if emptied:
            log.info("reap-swap cache: layer %s: swap pinned its set, %d slots emptied", layer, len(emptied))
