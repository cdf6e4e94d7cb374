"""Exact-size pinning of vLLM's UVA expert copies (`--reap-exact-pinning`; issue 15 item 4).

vLLM's UVA offloader (0.26.0 and 0.32.0 `offloader/uva.py`, `UVAOffloader._maybe_offload_to_cpu`) copies
each offloaded parameter to the CPU and pins it with `Tensor.pin_memory()`, which PyTorch's caching host
allocator rounds up to a power of two: a Kimi-K2 layer's 21 GiB `w13` takes 32 GiB (torch 2.11 has no
setting against it; research.md "Pinned rounding"). With the setting on, the offloader's CPU copy of a
large tensor is page-locked in place with `cudaHostRegister` (exact size) before vLLM makes its CUDA view
of it; vLLM's view op takes the pinned path (`is_pinned()` is true for registered memory). The copy is
held here until the engine has re-homed the layer and calls `release`, which unregisters it and lets
it go. A refused layer keeps its registered copy: vLLM reads it through the view for good.

The copy is registered in pieces of about `PIECE_BYTES` (64 MiB), cut at page boundaries, so that the engine can give a layer's copy back *while* it re-homes it
(`block_releaser`): each block of experts, once copied into the engine's host units, has its pieces
unregistered and their pages returned to the kernel (`madvise(MADV_DONTNEED)`). The host then never
holds a whole layer twice, only one block (issue 15 item 4: run 15's V3 layer took 1.84x its bytes).

Verified where: the mechanism on the H200 with torch 2.11 without vLLM (research-notes/pinned-round:
exact RSS, device pointer = host pointer, a kernel and a CUDA-graph replay read through the view,
unregister and free return the memory); the patch against a stand-in offloader on the CPU
(tests/test_exact_pinning.py). **Not run in a server yet.**
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from reap_swap.compat.moe import current_additional_config
from reap_swap.host_memory import EXACT_PINNING_MIN_BYTES

logger = logging.getLogger("reap_swap.compat")

# below this a tensor is pinned as vLLM pins it: the rounding costs little in absolute terms (the
# launcher's host check counts with the same size)
MIN_EXACT_BYTES = EXACT_PINNING_MIN_BYTES
_PORTABLE_MAPPED = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped
_ATTR = "_reap_exact_pinning"

PIECE_BYTES = 64 << 20  # registration piece: a finer one returns memory sooner, at more register calls
PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4  # Linux


@dataclass
class Copy:
    """One registered CPU copy: the tensor (kept alive here) and its registered pieces, base -> bytes."""

    tensor: Any
    nbytes: int
    pieces: dict[int, int] = field(default_factory=dict)

    @property
    def held_bytes(self) -> int:
        return sum(self.pieces.values())


_registered: dict[int, Copy] = {}  # host pointer -> its registered copy


def pieces_of(ptr: int, nbytes: int, chunk: int, page: int = PAGE) -> list[tuple[int, int]]:
    """[(base, bytes)] covering [ptr, ptr + nbytes): cut about every `chunk` bytes at page-aligned
    addresses, so no two pieces share a page (cudaHostRegister locks whole pages); one piece if
    `chunk` <= 0 or the tensor is not larger than it."""
    end = ptr + nbytes
    if chunk <= 0 or nbytes <= chunk:
        return [(ptr, nbytes)]
    cuts = [ptr]
    while True:
        nxt = -(-(cuts[-1] + chunk) // page) * page  # round up to a page
        if nxt >= end:
            break
        cuts.append(nxt)
    return [(a, b - a) for a, b in zip(cuts, [*cuts[1:], end])]


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


def exact_view(
    view: Callable[[Any], Any],
    register: Callable[[int, int], int] | None = None,
    unregister: Callable[[int], int] | None = None,
    chunk: int | None = None,
):
    """`view(cpu)` on a tensor pinned exactly, in pieces (large) or by `pin_memory()` (small, or if
    registering any piece fails: the pieces done are unregistered first)."""
    register, unregister = register or _cuda_register, unregister or _cuda_unregister

    def pinned_view(cpu: Any) -> Any:
        if cpu.is_pinned():
            return view(cpu)
        if cpu.nbytes < MIN_EXACT_BYTES or not cpu.is_contiguous():
            return view(cpu.pin_memory())
        copy = Copy(cpu, cpu.nbytes)
        for base, n in pieces_of(cpu.data_ptr(), cpu.nbytes, PIECE_BYTES if chunk is None else chunk):
            rc = register(base, n)
            if rc != 0:
                logger.warning(
                    "reap-swap: cudaHostRegister of %d bytes failed (%s); pin_memory() instead", n, rc
                )
                for done in copy.pieces:
                    unregister(done)
                return view(cpu.pin_memory())
            copy.pieces[base] = n
        _registered[cpu.data_ptr()] = copy
        return view(cpu)

    return pinned_view


def pointers(params: Iterable[Any]) -> list[int]:
    """Host pointers of these parameters' current data where it is a copy registered here (UVA: the
    device pointer of registered memory is its host pointer; checked on the H200)."""
    return [p.data.data_ptr() for p in params if p.data.data_ptr() in _registered]


def release(ptrs: Iterable[int], unregister: Callable[[int], int] | None = None) -> int:
    """Unregister and drop the copies at these host pointers (after the engine re-pointed the layer);
    the bytes released (of pieces still registered: `block_releaser` may have returned the rest)."""
    freed = 0
    for ptr in ptrs:
        copy = _registered.get(ptr)
        if copy is None:
            continue
        freed += _unregister_pieces(copy, list(copy.pieces), unregister)
        if not copy.pieces:
            del _registered[ptr]
    return freed


def release_range(
    ptr: int,
    start: int,
    end: int,
    unregister: Callable[[int], int] | None = None,
    discard: Callable[[int, int], int] | None = None,
) -> int:
    """Unregister the pieces of the copy at `ptr` that lie wholly in bytes [start, end) of it and give
    their pages back to the kernel (the engine copied those bytes; nothing reads them again);
    the bytes released."""
    copy = _registered.get(ptr)
    if copy is None:
        return 0
    inside = [b for b, n in copy.pieces.items() if b >= ptr + start and b + n <= ptr + end]
    freed = _unregister_pieces(copy, inside, unregister, discard or _discard)
    if not copy.pieces:
        del _registered[ptr]
    return freed


def block_releaser(tensors: Iterable[Any]) -> Callable[[int, int], int] | None:
    """For the engine's re-home copy, which copies experts in ascending blocks: `release(e0, e1)` (experts
    [0, e1) copied) gives back every piece of these [E, ...] registered copies that lies wholly in
    those experts' bytes, a piece straddling two blocks with the later one (the bytes released);
    None when none of the tensors is a registered copy."""
    spans = []
    for t in tensors:
        ptr = t.data_ptr()
        if ptr in _registered and t.dim() >= 1 and t.shape[0] and t.is_contiguous():
            spans.append((ptr, _registered[ptr].nbytes // int(t.shape[0])))
    if not spans:
        return None

    def release_experts(e0: int, e1: int) -> int:
        return sum(release_range(ptr, 0, e1 * slab) for ptr, slab in spans)

    return release_experts


def registered_bytes() -> int:
    return sum(c.held_bytes for c in _registered.values())


def _unregister_pieces(
    copy: Copy,
    bases: list[int],
    unregister: Callable[[int], int] | None,
    discard: Callable[[int, int], int] | None = None,
) -> int:
    freed = 0
    for base in bases:
        rc = (unregister or _cuda_unregister)(base)
        if rc != 0:
            logger.warning("reap-swap: cudaHostUnregister failed (%s); that piece of the copy is kept", rc)
            continue
        n = copy.pieces.pop(base)
        if discard is not None:
            lo, hi = -(-base // PAGE) * PAGE, (base + n) // PAGE * PAGE
            if hi > lo and discard(lo, hi - lo) != 0:
                logger.warning("reap-swap: madvise(DONTNEED) failed on %d bytes; they stay resident", hi - lo)
        freed += n
    return freed


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
