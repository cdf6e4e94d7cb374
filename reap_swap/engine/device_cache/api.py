"""The device expert cache of a worker process: what the layers, the engine and the server call.

THE INTERFACE (agreed in writing here; branch ``cacheacc`` builds ``--reap-cache``, Prometheus and
CPU accounting on it; nothing below is called on the hot path except ``forward``):

``DeviceCaches(policy="dlfu", decay=LFU_DECAY)`` -- one per worker process (per GPU / TP rank), owned by
the worker runtime next to the CudaEngine. ``policy``: only ``dlfu`` (reap_swap.cache.device,
the simulator's ``dlfu-seeded`` when seeded with the plan core, ``core+dlfu`` when the core is
pinned). ``--reap-cache lru`` is not implemented on the device: refuse it by name.

Load time (engine, per layer, after re-homing it with device_cache_range.rehome_with_slots):
  ``engage(layer, index, rng, range_bytes, ext_views, seed=())`` -> None, or
  ``refuse(index, reason)`` when compat.moe_cache.cache_refusal(layer) or the pool says no.
  A refused layer keeps the plain pooled/stock path; the reason is in ``status()`` and the log.

Per step (ReapRoutedExperts.forward_modular, inside vLLM's MoE op, captured by CUDA graphs):
  ``forward(layer, x, topk_weights, topk_ids, padding, shared_experts, shared_experts_input)``:
  the router counters have already counted the ORIGINAL ids; this counts the step into the
  cache, copies admissions into slots, remaps ids, rewrites the slot rows of the layer's per-expert
  scales / zero points / biases (device_cache_side.py; bound at engage by
  bind_slot_rows) and runs the kernel over E + N units.

Between steps (worker RPC on the engine-core thread; no forward races with it):
  ``read_counters(reset=False) -> {layer: {name: int}}`` -- names: device_cache.COUNTER_NAMES
      (steps, selections, selection_hits, experts, expert_hits, admitted = promotions, evicted,
      bypassed = missed experts read through, read_through_steps). Monotonic unless reset.
      Prometheus (cacheacc): hits = expert_hits, misses = experts - expert_hits, promotions =
      admitted, evictions = evicted, read-through steps = read_through_steps; the per-selection
      pair (selections, selection_hits) is the router-miss unit.
  ``status() -> {"policy", "decay", "layers": {layer: {"slots", "active", "occupied", "cached":
      [experts], "pinned": [experts]}}, "refused": {layer: reason}}`` -- ``/reap/status``.
  ``on_swap(layer, pinned, active_slots)`` -- after a per-request swap made ``pinned`` resident in
      their own units: they leave the cache and the tail shrinks to ``active_slots`` (the tail
      yields to the swap); returns the emptied slots.

Accounting mode on CPU (cacheacc): replay the counters' stream through
cache_policy.device.DLFU (or DeviceCache on CPU tensors: the same integers, tests/
test_device_policy.py proves the two agree step by step) -- same counts as ``read_counters``.

Serving: ``--reap-cache lfu --reap-cache-device on`` with residency
cuda builds the CacheConfig (device_cache_serving.py), the worker reports it through
DeviceCacheView, cuda_backend.apply calls ``on_swap`` after every swap. The notes below predate it.

Wired: ``CudaEngine(plan, refusals, cache=CacheConfig(...))``
(device_cache_engine.py) lends N pool slots per layer, re-homes with slot units and engages; with
``cache=None`` (the default) the engine is unchanged. NOT wired: the runtime does not build a
CacheConfig from settings (``--reap-cache`` / ``--reap-cache-slots`` are cacheacc's); after a
per-request swap nobody calls ``on_swap`` yet (correct anyway -- a swapped expert then sits in
both its own unit and a slot, with the same bytes -- but it wastes the slot and the tail does not
yield).
"""

from __future__ import annotations

from typing import Any

import torch

from reap_swap import get_logger
from reap_swap.cache.online import LFU_DECAY
from reap_swap.compat import moe_cache
from reap_swap.engine.counting import counters
from reap_swap.engine.device_cache.copy import unit_view
from reap_swap.engine.device_cache.fast import fits as triton_fits
from reap_swap.engine.device_cache.fast import warm as warm_triton_step
from reap_swap.engine.device_cache.layer import DeviceCache, LayerStep
from reap_swap.engine.device_cache.shadow import Shadow, slots_hold_their_experts
from reap_swap.engine.device_cache.side import SlotRows

log = get_logger("reap_swap.device_cache")


class DeviceCaches:
    """Every cached layer of one worker process (see the module docstring: the interface)."""

    def __init__(
        self,
        policy: str = "dlfu",
        decay: float = LFU_DECAY,
        step: str = "torch",
        shadow: str | None = None,
    ) -> None:
        if policy != "dlfu":
            raise ValueError(f"--reap-cache {policy}: the device cache implements dlfu only")
        self.policy, self.decay = policy, decay
        self.step = step  # layer.POLICY_STEPS: triton in serving (the torch step where it does not fit)
        self.layers: dict[int, LayerStep] = {}
        self.views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.side: dict[int, SlotRows] = {}  # scales / biases with N slot rows (device_cache_side)
        self.refused: dict[int, str] = {}
        self.shadow_mode = shadow  # device_cache_shadow.py: None, "out" or "bytes" (debug only)
        self.shadows: dict[int, Shadow] = {}

    def refuse(self, index: int, reason: str) -> None:
        self.refused[index] = reason
        log.warning("reap-swap: device cache not engaged on layer %s: %s", index, reason)

    def engage(self, layer: Any, index: int, rng: Any, range_bytes: torch.Tensor, ext_views, seed=()) -> bool:
        """Attach a cache over ``rng`` (a CacheRange) to ``layer``; False (refused) if it cannot."""
        reason = moe_cache.cache_refusal(layer)
        if reason is None and rng.num_slots == 0:
            reason = "no slot units (the pool leaves nothing after the pinned set)"
        if reason is not None:
            self.refuse(index, reason)
            return False
        e, n = rng.num_experts, rng.num_slots
        cache = DeviceCache(e, n, range_bytes.device, self.decay)
        step_name = self.step if self.step != "triton" or triton_fits(e, n) else "torch"
        if step_name == "triton" and range_bytes.is_cuda:
            step_name = self._warm(cache, index)
        step = LayerStep(cache, unit_view(range_bytes, e + n, rng.unit_bytes), step=step_name)
        self.side[index] = bind_slot_rows(layer, e, n)  # before the seed: its rows follow the slots
        step.seed(seed)
        moe_cache.install_config_alias()
        moe_cache.alias_units(e + n, e, int(ext_views[0].shape[1]), int(ext_views[0].shape[2]))
        self.layers[index], self.views[index] = step, ext_views
        if self.shadow_mode is not None:
            self.shadows[index] = Shadow(range_bytes.device, n, self.shadow_mode == "bytes")
        layer.reap_device_cache = (self, index)
        side = self.side[index].names
        log.info(
            "reap-swap: device cache on layer %d: %d slots, %d seeded%s", index, n, len(tuple(seed)),
            f", slot rows for {', '.join(side)}" if side else "",
        )  # fmt: skip
        return True

    def _warm(self, cache: DeviceCache, index: int) -> str:
        """Compile the Triton step's variants before capture (no compilation inside a request); a
        Triton build that cannot compile it leaves the layer on the torch reference step (the same
        result, slower), with the reason in the log, rather than failing the server's start."""
        try:
            warm_triton_step(cache)
        except Exception as exc:  # noqa: BLE001 - any compile or launch error of the kernel
            log.warning(
                "reap-swap: layer %d runs the torch policy step: the Triton step failed: %r", index, exc
            )
            return "torch"
        return "triton"

    def forward(self, layer, index, x, topk_weights, topk_ids, padding, shared_experts, shared_experts_input):
        """The step (captured): cache update, slot copies, remapped ids, kernel over E + N units."""
        step = self.layers[index]
        ids = step(topk_ids, counters.rows_from_padding(padding))
        self.side[index].refresh(step.cache.slot_expert)  # scale / bias rows of the slots' experts
        w13, w2 = self.views[index]
        out = moe_cache.run_extended(
            layer, x, w13, w2, topk_weights, ids, shared_experts, shared_experts_input
        )
        shadow = self.shadows.get(index)
        if shadow is not None and shared_experts is None:  # debug: the uncached call beside it
            ref = moe_cache.run_stock(layer, x, topk_weights, topk_ids)
            ok = None
            if shadow.check_bytes:
                ok = slots_hold_their_experts(step.units, step.cache.slot_expert, step.cache.num_experts)
            shadow.record(out, ref, topk_ids, ids, step.cache.copy_expert, ok)
        return out

    def read_counters(self, reset: bool = False) -> dict[int, dict[str, int]]:
        return {i: s.cache.read_counters(reset) for i, s in sorted(self.layers.items())}

    def on_swap(self, index: int, pinned, active_slots: int | None = None) -> list[int]:
        step = self.layers.get(index)
        return [] if step is None else step.cache.set_pinned(pinned, active_slots)

    def status(self) -> dict:
        layers = {}
        for i, s in sorted(self.layers.items()):
            cached, pinned = s.cache.resident_experts()
            layers[i] = {
                "slots": s.cache.num_slots,
                "active": int(s.cache.active),
                "occupied": len(cached),
                "cached": sorted(cached),
                "pinned": sorted(pinned),
                "side_rows": self.side[i].names if i in self.side else [],
            }
        out = {"policy": self.policy, "decay": self.decay, "layers": layers, "refused": dict(self.refused)}
        if self.shadows:
            out["shadow"] = {i: sh.report() for i, sh in sorted(self.shadows.items())}
            bad = {i: r for i, r in out["shadow"].items() if r["mismatched_steps"] or r["bad_slot_steps"]}
            if bad:
                log.warning("reap-swap cache shadow: cached != uncached on layers %s", bad)
        return out


def bind_slot_rows(layer: Any, num_experts: int, num_slots: int) -> SlotRows:
    """The layer's per-expert side tensors with N slot rows (compat.moe_cache.slot_row_places finds
    them in the kernel's weight quant config), pointed at where the kernel reads them."""
    places, unbound = moe_cache.slot_row_places(layer)
    if unbound:  # cache_refusal refuses such a layer before engage
        raise ValueError(f"no slot rows for {', '.join(unbound)} (cache_refusal refuses this layer)")
    rows = SlotRows({name: getattr(layer, name).data for name in places}, num_experts, num_slots)
    moe_cache.point_slot_rows(layer, places, rows.ext)
    return rows
