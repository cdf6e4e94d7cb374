"""Exact-size pinning of vLLM's UVA expert copies (`--reap-exact-pinning`; issue 15 item 4).

vLLM's UVA offloader (0.26.0 and 0.32.0 `offloader/uva.py`, `UVAOffloader._maybe_offload_to_cpu`) copies
each offloaded parameter to the CPU and pins it with `Tensor.pin_memory()`, which PyTorch's caching host
allocator rounds up to a power of two: a Kimi-K2 layer's 21 GiB `w13` takes 32 GiB (torch 2.11 has no
setting against it; research.md "Pinned rounding"). With the setting on, the offloader's CPU copy of a
large tensor is page-locked in place with `cudaHostRegister` (exact size) before vLLM makes its CUDA view
of it; vLLM's view op takes the pinned path (`is_pinned()` is true for registered memory). The copy is
held here until the engine has re-homed the layer and calls `release`, which unregisters it and lets
it go. A refused layer keeps its registered copy: vLLM reads it through the view for good.

Verified where: the mechanism on the H200 with torch 2.11 without vLLM (research-notes/pinned-round:
exact RSS, device pointer = host pointer, a kernel and a CUDA-graph replay read through the view,
unregister and free return the memory); the patch against a stand-in offloader on the CPU
(tests/test_exact_pinning.py). **Not run in a server yet.**
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from reap_swap.compat.moe import current_additional_config
from reap_swap.host_memory import EXACT_PINNING_MIN_BYTES

logger = logging.getLogger("reap_swap.compat")

# below this a tensor is pinned as vLLM pins it: the rounding costs little in absolute terms (the
# launcher's host check counts with the same size)
MIN_EXACT_BYTES = EXACT_PINNING_MIN_BYTES
_PORTABLE_MAPPED = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped
_ATTR = "_reap_exact_pinning"

_registered: dict[int, tuple[Any, int]] = {}  # host pointer -> (the CPU tensor, bytes)


def wanted() -> bool:
    """Is `exact_pinning` on in the config being built (the launcher's --additional-config)?"""
    from reap_swap.settings import ADDITIONAL_CONFIG_KEY

    cfg = current_additional_config()
    reap = cfg.get(ADDITIONAL_CONFIG_KEY) if isinstance(cfg, dict) else None
    return bool(isinstance(reap, dict) and reap.get("exact_pinning"))


def install(uva: Any = None) -> str | None:
    """Wrap `UVAOffloader._maybe_offload_to_cpu` once (it acts only where `wanted()`); None when
    installed, else why not. `uva`: the offloader module (tests pass a stand-in)."""
    if uva is None:
        try:
            from vllm.model_executor.offloader import uva  # 0.26.0, 0.32.0
        except ImportError as exc:
            return f"no vllm.model_executor.offloader.uva ({exc})"
    cls = getattr(uva, "UVAOffloader", None)
    original = getattr(cls, "_maybe_offload_to_cpu", None)
    view = getattr(uva, "get_accelerator_view_from_cpu_tensor", None)
    if original is None or view is None:
        return "this vLLM's UVA offloader has no _maybe_offload_to_cpu / get_accelerator_view_from_cpu_tensor"
    if getattr(original, _ATTR, False):
        return None

    def maybe_offload_to_cpu(self: Any, module: Any) -> Any:
        if not (getattr(self, "pin_memory", False) and getattr(self, "uva_offloading", False) and wanted()):
            return original(self, module)
        # vLLM skips pin_memory(); the view function (looked up in the module at call time) pins
        self.pin_memory = False
        uva.get_accelerator_view_from_cpu_tensor = exact_view(view)
        try:
            return original(self, module)
        finally:
            self.pin_memory = True
            uva.get_accelerator_view_from_cpu_tensor = view

    setattr(maybe_offload_to_cpu, _ATTR, True)
    cls._maybe_offload_to_cpu = maybe_offload_to_cpu
    return None


def exact_view(view: Callable[[Any], Any], register: Callable[[int, int], int] | None = None):
    """`view(cpu)` on a tensor pinned exactly (large) or by `pin_memory()` (small, or if registering fails)."""

    def pinned_view(cpu: Any) -> Any:
        if cpu.is_pinned():
            return view(cpu)
        if cpu.nbytes < MIN_EXACT_BYTES or not cpu.is_contiguous():
            return view(cpu.pin_memory())
        rc = (register or _cuda_register)(cpu.data_ptr(), cpu.nbytes)
        if rc != 0:
            logger.warning(
                "reap-swap: cudaHostRegister of %d bytes failed (%s); pin_memory() instead", cpu.nbytes, rc
            )
            return view(cpu.pin_memory())
        _registered[cpu.data_ptr()] = (cpu, cpu.nbytes)
        return view(cpu)

    return pinned_view


def pointers(params: Iterable[Any]) -> list[int]:
    """Host pointers of these parameters' current data where it is a copy registered here (UVA: the
    device pointer of registered memory is its host pointer; checked on the H200)."""
    return [p.data.data_ptr() for p in params if p.data.data_ptr() in _registered]


def release(ptrs: Iterable[int], unregister: Callable[[int], int] | None = None) -> int:
    """Unregister and drop the copies at these host pointers (after the engine re-pointed the layer);
    the bytes released."""
    freed = 0
    for ptr in ptrs:
        entry = _registered.pop(ptr, None)
        if entry is None:
            continue
        rc = (unregister or _cuda_unregister)(ptr)
        if rc != 0:
            logger.warning("reap-swap: cudaHostUnregister failed (%s); the copy is kept", rc)
            _registered[ptr] = entry
            continue
        freed += entry[1]
    return freed


def registered_bytes() -> int:
    return sum(n for _, n in _registered.values())


def _cuda_register(ptr: int, nbytes: int) -> int:
    import torch

    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _PORTABLE_MAPPED))


def _cuda_unregister(ptr: int) -> int:
    import torch

    return int(torch.cuda.cudart().cudaHostUnregister(ptr))
