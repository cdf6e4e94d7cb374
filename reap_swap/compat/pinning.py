"""Exact-size pinning of vLLM's UVA expert copies (`--reap-exact-pinning`).

vLLM's UVA offloader (0.26.0 and 0.32.0 `offloader/uva.py`, `UVAOffloader._maybe_offload_to_cpu`) copies
each offloaded parameter to the CPU and pins it with `Tensor.pin_memory()`, which PyTorch's caching host
allocator rounds up to a power of two: a Kimi-K2 layer's 21 GiB `w13` takes 32 GiB (torch 2.11 has no
setting against it; research.md "Pinned rounding"). With the setting on, the offloader's CPU copy of a
large tensor is page-locked in place with `cudaHostRegister` (exact size) before vLLM makes its CUDA view
of it; vLLM's view op takes the pinned path (`is_pinned()` is true for registered memory). The copy is
held here until the engine has re-homed the layer and calls `release`, which unregisters it and lets
it go. A refused layer keeps its registered copy: vLLM reads it through the view for good.

During the re-home the engine does not read the copy through the view: `drain` unregisters it whole
first (it becomes plain pageable memory; nothing reads the layer until its parameters are re-pointed),
the engine copies it from the CPU tensor in blocks of experts, and after each block `on_copied` returns
that block's pages to the kernel (`madvise(MADV_DONTNEED)`). The host then never holds a whole layer
twice, only one block (without the drain a DeepSeek-V3 layer took 1.84x its bytes: research.md). Registering in pieces
instead, to unregister them block by block, fails: a CUDA memcpy whose range spans two registrations
is refused with cudaErrorInvalidValue (H200, torch 2.11: research-notes/pinned-round/chunk_probe.json),
and vLLM's weight loader copies into the view with memcpys.

Verified where: the mechanism on the H200 with torch 2.11 without vLLM (research-notes/pinned-round:
exact RSS, device pointer = host pointer, a kernel and a CUDA-graph replay read through the view,
unregister and free return the memory; view_probe, then drain_probe with the engine's own
`rehome` and a real host-backed range, and loader_probe: the loader's copies into a registration); the
patch against a stand-in offloader on the CPU (tests/test_exact_pinning.py); in a server on vLLM 0.26.0
(H200, research.md: the DeepSeek-V3 layer shape at depth 6, eager: host memory in use 0.95x experts + dense,
text and MoE digests equal to stock at 0 / 25 / 50 / 100 % and back, swaps moving bytes at 54 GB/s).
The launcher turns it on by default where it pays (`server.resolve_exact_pinning`).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from reap_swap.compat.moe import LOADED_PTRS_ATTR, current_additional_config
from reap_swap.sizing.host_memory import EXACT_PINNING_MIN_BYTES

logger = logging.getLogger("reap_swap.compat")

# below this a tensor is pinned as vLLM pins it: the rounding costs little in absolute terms (the
# launcher's host check counts with the same size)
MIN_EXACT_BYTES = EXACT_PINNING_MIN_BYTES
_PORTABLE_MAPPED = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped
_ATTR = "_reap_exact_pinning"

PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4  # Linux


@dataclass
class Copy:
    """One CPU copy made here: the tensor (kept alive until `release`), whether it is still registered,
    and how many of its leading bytes were given back to the kernel (`drain`)."""

    tensor: Any
    nbytes: int
    registered: bool = True
    discarded: int = 0


_registered: dict[int, Copy] = {}  # host pointer -> the copy


def wanted() -> bool:
    """Is `exact_pinning` on in the config being built (the launcher's --additional-config)?"""
    from reap_swap.config.settings import ADDITIONAL_CONFIG_KEY

    cfg = current_additional_config()
    reap = cfg.get(ADDITIONAL_CONFIG_KEY) if isinstance(cfg, dict) else None
    # `is True`: an unresolved "auto" (a config not written by the launcher) means off
    residency = reap.get("residency") if isinstance(reap, dict) else None
    return bool(isinstance(residency, dict) and residency.get("exact_pinning") is True)


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
        _registered[cpu.data_ptr()] = Copy(cpu, cpu.nbytes)
        return view(cpu)

    return pinned_view


def pointers(params: Iterable[Any]) -> list[int]:
    """Host pointers of these parameters' current data where it is a copy registered here (UVA: the
    device pointer of registered memory is its host pointer; checked on the H200)."""
    return [p.data.data_ptr() for p in params if p.data.data_ptr() in _registered]


def layer_copies(layer: Any, params: Iterable[Any]) -> list[int]:
    """`pointers` of these parameters, plus the copies of the layer's parameters as loaded (recorded
    before vLLM's process_weights_after_loading: a repack that replaced a parameter left its loaded
    copy here, which nothing reads any more), each once."""
    loaded = (getattr(layer, LOADED_PTRS_ATTR, None) or {}).values()
    ptrs = dict.fromkeys([*pointers(params), *(p for p in loaded if p in _registered)])
    return list(ptrs)


def release(ptrs: Iterable[int], unregister: Callable[[int], int] | None = None) -> int:
    """Unregister (unless `drain` did) and drop the copies at these host pointers (after the engine
    re-pointed the layer); the bytes released."""
    freed = 0
    for ptr in ptrs:
        copy = _registered.get(ptr)
        if copy is None:
            continue
        if copy.registered and not _unregister(copy, ptr, unregister):
            continue
        del _registered[ptr]
        freed += copy.nbytes
    return freed


def drain(
    tensors: Mapping[str, Any],
    unregister: Callable[[int], int] | None = None,
    discard: Callable[[int, int], int] | None = None,
) -> tuple[dict[str, Any], Callable[[int, int], int] | None]:
    """Ready the copies among these [E, ...] views for a re-home that gives them back as it goes.

    Each registered copy is unregistered whole and replaced, as the copy's source, by its CPU tensor;
    the callback `on_copied(e0, e1)` (experts [0, e1) copied; blocks ascend) returns those experts'
    whole pages to the kernel and the bytes given back. The callback is None when no tensor is a copy
    here. After this, nothing may read the copies through their views: the caller re-points the
    layer or fails loudly (a failed re-home cannot fall back to vLLM's path)."""
    sources, spans = dict(tensors), []
    for name, t in tensors.items():
        ptr = t.data_ptr()
        copy = _registered.get(ptr)
        if copy is None or not copy.registered or t.dim() < 1 or not t.shape[0]:
            continue
        if not _unregister(copy, ptr, unregister):
            continue  # still registered: the re-home reads it through the view, released after
        sources[name] = copy.tensor
        spans.append((ptr, copy, copy.nbytes // int(t.shape[0])))
    if not spans:
        return sources, None

    def on_copied(e0: int, e1: int) -> int:
        given = 0
        for ptr, copy, slab in spans:
            lo = -(-(ptr + copy.discarded) // PAGE) * PAGE
            hi = (ptr + min(e1 * slab, copy.nbytes)) // PAGE * PAGE
            if hi <= lo:
                continue
            if (discard or _discard)(lo, hi - lo) != 0:
                logger.warning("reap-swap: madvise(DONTNEED) failed on %d bytes; they stay resident", hi - lo)
                continue
            copy.discarded, given = hi - ptr, given + hi - lo
        return given

    return sources, on_copied


def registered_bytes() -> int:
    """Bytes of the copies made here that are still held (registered or being drained)."""
    return sum(c.nbytes for c in _registered.values())


def _unregister(copy: Copy, ptr: int, unregister: Callable[[int], int] | None) -> bool:
    rc = (unregister or _cuda_unregister)(ptr)
    if rc != 0:
        logger.warning("reap-swap: cudaHostUnregister failed (%s); the copy is kept", rc)
        return False
    copy.registered = False
    return True


def _discard(addr: int, nbytes: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return int(libc.madvise(addr, nbytes, _MADV_DONTNEED))


def _cuda_register(ptr: int, nbytes: int) -> int:
    import torch

    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _PORTABLE_MAPPED))


def _cuda_unregister(ptr: int) -> int:
    import torch

    return int(torch.cuda.cudart().cudaHostUnregister(ptr))
