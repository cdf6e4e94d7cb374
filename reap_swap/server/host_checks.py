"""The launcher's host-memory decisions, made before vLLM loads anything: whether vLLM's UVA copies
of the experts are pinned at their exact size (``--reap-exact-pinning auto``), how many bytes vLLM
will pin, and whether the host can hold them plus the layer being re-homed (a refusal with the
numbers instead of an out-of-memory kill mid-load). The arithmetic is sizing/host_memory.py's.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from reap_swap import get_logger
from reap_swap.sizing.host_memory import (
    EXACT_PINNING_AUTO_RATIO,
    EXACT_PINNING_MIN_BYTES,
    RELEASE_BLOCK_BYTES,
    HostMemoryNeed,
    alloc_conf,
    exact_pinning_pays,
    mem_available_bytes,
    round_threshold_bytes,
    uva_pinned_bytes,
)

log = get_logger("reap_swap.server.host_checks")


class LaunchError(RuntimeError):
    """Startup refused before any engine process exists; the message says why."""


def resolve_exact_pinning(settings, shape, tp: int) -> bool:
    """`--reap-exact-pinning` on this UVA launch: the setting when given; for auto, on where the re-home
    drains (`drains_in_blocks`) or runs in groups (INT4: a whole layer in flight, the rounding is what
    is saved), and vLLM's rounded copies plus one layer in flight would hold more than 1.2x the
    experts (`host_memory.exact_pinning_pays`), with the numbers in the log either way."""
    if settings.residency.exact_pinning != "auto":
        return bool(settings.residency.exact_pinning)
    # private units drain block by block, grouped units hold a whole layer in flight: both save the
    # rounding; only the device cache (resolved by now) is left out
    if settings.cache.device == "on":
        log.info(
            "reap-swap: --reap-exact-pinning auto: off (the device cache gives vLLM's copy back after the "
            "whole layer, so exact pinning would save only the rounding)"
        )
        return False
    pinned = vllm_pinned_bytes(shape, tp, exact=False)
    experts, layer = shape.total_expert_bytes, shape.layer_expert_bytes
    on = exact_pinning_pays(pinned, experts, layer)
    log.info(
        "reap-swap: --reap-exact-pinning auto: %s (vLLM's pinned copies %.1f GiB + one %.1f GiB layer in flight "
        "= %.2fx the %.1f GiB of experts; on above %.1fx)",
        "on" if on else "off",
        max(pinned, experts) / 2**30,
        layer / 2**30,
        (max(pinned, experts) + layer) / max(experts, 1),
        experts / 2**30,
        EXACT_PINNING_AUTO_RATIO,
    )
    return on


def vllm_pinned_bytes(shape, tp: int, exact: bool) -> int:
    """What vLLM's UVA offload pins for the experts (host_memory.uva_pinned_bytes) under the allocator
    settings of this environment; `exact`: copies from EXACT_PINNING_MIN_BYTES are registered at their size."""
    fmt, threshold = shape.expert_format, round_threshold_bytes(alloc_conf(os.environ))
    if exact:  # --reap-exact-pinning: large copies are registered at their size (compat/pinning.py)
        threshold = EXACT_PINNING_MIN_BYTES if threshold is None else min(threshold, EXACT_PINNING_MIN_BYTES)
    return uva_pinned_bytes(fmt.w13, fmt.w2, shape.num_experts, len(shape.moe_layers), tp, threshold)


def drains_in_blocks(settings, exact: bool | None = None) -> bool:
    """The re-home gives vLLM's exact-pinned copy back block by block (RELEASE_BLOCK_BYTES): only on the
    private-unit path (engine/residency/engine.py `_rehome_plain`); grouped units and the device cache release a
    layer's copy after the whole layer."""
    exact = (
        settings.residency.exact_pinning is True if exact is None else exact
    )  # `exact`: the launch's resolved value
    return exact and settings.residency.group_size == "1" and settings.cache.device != "on"


def check_host_memory(
    shape,
    meminfo: Path = Path("/proc/meminfo"),
    uva_tp: int | None = None,
    exact: bool = False,
    drained: bool = False,
) -> None:
    """Refuse before loading when the host cannot hold the experts in pinned memory (host_memory.py).
    `uva_tp`: vLLM's UVA offload pins the experts (per TP rank, rounded by PyTorch's pinned allocator);
    None: only the engine's own exact host copies. `drained` (`drains_in_blocks`): one block in flight,
    not one layer."""
    pinned = None if uva_tp is None else vllm_pinned_bytes(shape, uva_tp, exact)
    try:
        available = mem_available_bytes(meminfo.read_text())
    except OSError:
        available = None
    if available is None:
        log.warning("reap-swap: cannot read MemAvailable from %s; host memory not checked", meminfo)
        return
    need = HostMemoryNeed(shape.total_expert_bytes, shape.layer_expert_bytes, available, pinned)
    if drained and exact and uva_tp is not None:  # one block of the layer in flight, not the layer
        block = min(need.layer_bytes, RELEASE_BLOCK_BYTES)
        what = f"one {block / 2**30:.1f} GiB block of a layer being re-homed, --reap-exact-pinning"
        need = dataclasses.replace(need, layer_bytes=block, in_flight=what)
    why = need.refusal()
    if why:
        raise LaunchError(why)
    log.info(
        "reap-swap: host memory: %.1f GiB needed for pinned experts, %.1f GiB available",
        need.needed_bytes / 2**30,
        available / 2**30,
    )
