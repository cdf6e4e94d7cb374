"""Replay a routing trace through DeviceCache and through the simulator, step by step, and compare.

The check ("the device policy's misses equal the simulator's on a replayed
trace, exactly"): per layer, the device cache is driven with the trace's own topk ids (plus
padding rows it must ignore, as CUDA-graph padding), and after every step its contents (slots +
pinned) must equal the simulator policy's resident set; at the end its counters must equal
``replay_layer``'s counts. Used by tests/test_device_policy.py (CPU tensors) and
tests/gpu/test_device_cache.py (CUDA tensors, optionally with the step captured in a CUDA graph).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from reap_swap.cache.device import DLFU
from reap_swap.cache.mechanism import LayerSteps, replay_layer
from reap_swap.cache.online import LFU_DECAY
from reap_swap.cache.trace import Trace
from reap_swap.engine.device_cache.layer import DeviceCache, step_counts


@dataclass(frozen=True)
class Variant:
    """How a simulator policy maps onto the device: ``dlfu`` / ``dlfu-seeded`` / ``core+dlfu``."""

    name: str
    seed: frozenset[int]
    pinned: frozenset[int]

    @classmethod
    def of(cls, name: str, core: frozenset[int]) -> Variant:
        if name == "dlfu":
            return cls(name, frozenset(), frozenset())
        if name == "dlfu-seeded":
            return cls(name, core, frozenset())
        if name == "core+dlfu":
            return cls(name, core, core)
        raise ValueError(f"no device variant for policy {name!r}")


def layer_ids(trace: Trace, layer: int) -> list[np.ndarray]:
    """Per step, the [tokens, top_k] topk ids of ``layer``."""
    col = trace.layers.index(layer)
    off = trace.step_offsets
    return [trace.topk_ids[off[t] : off[t + 1], col, :] for t in range(trace.num_steps)]


def make_cache(variant: Variant, num_experts: int, capacity: int, device, decay: float) -> DeviceCache:
    """A DeviceCache set up as the simulator's policy starts (C = pinned + slots)."""
    slots = capacity - len(variant.pinned)
    cache = DeviceCache(num_experts, slots, device, decay=decay)
    cache.set_pinned(variant.pinned, slots)
    cache.seed(variant.seed - variant.pinned)
    return cache


def padded(ids: np.ndarray, pad_to: int, pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad a step's ids to ``pad_to`` rows with ``pad_id`` rows, and the valid-row mask."""
    rows = max(pad_to, ids.shape[0])
    out = np.full((rows, ids.shape[1]), pad_id, dtype=np.int32)
    out[: ids.shape[0]] = ids
    valid = np.zeros(rows, dtype=bool)
    valid[: ids.shape[0]] = True
    return torch.from_numpy(out).to(device), torch.from_numpy(valid).to(device)


def compare_layer(
    trace: Trace,
    layer: int,
    variant: Variant,
    capacity: int,
    device="cpu",
    decay: float = LFU_DECAY,
    step_fn: Callable | None = None,
    pad_to: int = 8,
) -> dict:
    """Drive both per step; raise AssertionError at the first differing step. Returns the counts.

    ``step_fn(cache, ids, valid)`` runs one device step (default: step_counts + cache.step); a GPU
    test passes one that replays a captured CUDA graph."""
    starts = trace.request_first_steps()
    steps = LayerSteps.from_counts(layer, trace.step_counts(layer), starts)
    ref = DLFU(variant.name, seed=variant.seed, pinned=variant.pinned, decay=decay)
    resident = frozenset(ref.start(steps, capacity))
    cache = make_cache(variant, trace.num_experts, capacity, device, decay)
    step_fn = step_fn or _eager_step
    pad_id = trace.num_experts - 1
    for t, ids in enumerate(layer_ids(trace, layer)):
        x, valid = padded(ids, pad_to, pad_id, device)
        step_fn(cache, x, valid)
        resident = frozenset(ref.choose(t, resident, steps.needed[t], steps.counts[t]))
        slots, pinned = cache.resident_experts()
        if slots | pinned != resident:
            raise AssertionError(
                f"layer {layer} {variant.name} C={capacity} step {t}: device {sorted(slots | pinned)}"
                f" != simulator {sorted(resident)}"
            )
    got = cache.read_counters()
    want = replay_layer(DLFU(variant.name, variant.seed, variant.pinned, decay), steps, capacity)
    for name in ("selections", "selection_hits", "experts", "expert_hits", "admitted", "bypassed"):
        if got[name] != getattr(want, name):
            raise AssertionError(
                f"layer {layer} {variant.name}: {name} device {got[name]} != {getattr(want, name)}"
            )
    if got["read_through_steps"] != want.read_through_steps:
        raise AssertionError(
            f"layer {layer}: read_through_steps {got['read_through_steps']} != {want.read_through_steps}"
        )
    return got


def _eager_step(cache: DeviceCache, ids: torch.Tensor, valid: torch.Tensor) -> None:
    cache.step(step_counts(ids, cache.num_experts, valid))
