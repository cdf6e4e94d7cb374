"""Can this host hold the model's experts in pinned memory? Checked before vLLM loads anything.

On CUDA the launcher loads every expert into pinned host memory (stock UVA offload) and the
engine then copies each layer into its own host-backed range, returning vLLM's pinned copy
layer by layer (compat.moe.release_cached_pinned_memory). So the host must hold the expert set
once, plus one layer in flight, plus the process itself (Python, CUDA context, compile workers: a few
GiB at full size; research.md has the measurements).
Quantized checkpoints: the expert bytes are as the checkpoint stores them
(`ModelShape.expert_bytes`: FP8 one byte per weight); the launcher does not offload (so does not
check) formats the engine refuses (sizing/quant/budget.py). Online `--quantization fp8` of a bf16
checkpoint is checked at its bf16 bytes, an upper bound (vLLM loads bf16 and quantizes after).
PyTorch's caching host allocator rounds every `pin_memory()` up to a power of two (torch 2.11:
research-notes/pinned-round), and vLLM's UVA offload
(0.26.0 and 0.32.0 `offloader/uva.py`: `cpu_data.pin_memory()`) pins each layer's w13 and w2 that
way, so on that path the pinned bytes are the rounded ones (a Mixtral-8x7B
layer's 1.75 + 0.875 GiB pins as 2 + 1). Newer torch skips the rounding
above `pinned_max_round_threshold_mb` (torch 2.11 rejects the key and fails at CUDA init).
Biases and scales are not pinned this way (`--cpu-offload-params w13_weight w2_weight`).
Pure: the caller reads /proc/meminfo and the allocator settings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GIB = 2**30
# what a serving process needs beside the pinned experts, one layer in flight included (research.md)
PROCESS_MARGIN_BYTES = 6 * GIB
# --reap-exact-pinning registers tensors from this size at their exact bytes (compat/pinning.MIN_EXACT_BYTES)
EXACT_PINNING_MIN_BYTES = 64 << 20
# with --reap-exact-pinning and private units, the re-home copies a layer in blocks of about this many
# bytes and gives vLLM's copy of each block back as it goes (compat/pinning.drain, residency/state.rehome),
# so the host holds one block twice, not one layer (the DeepSeek-V3 layer shape's host peak falls from
# about 1.6x to about 1.1x its expert bytes: research.md)
RELEASE_BLOCK_BYTES = 512 << 20
# --reap-exact-pinning auto turns it on where vLLM's rounded copies plus one layer in flight would hold more
# than this multiple of the expert bytes: on for the DeepSeek-V3 layer shape (predicted 1.48x), off for
# Mixtral-8x7B (1.17x) and Qwen3.5-35B-A3B (1.02x), each close to its measured peak (research.md)
EXACT_PINNING_AUTO_RATIO = 1.2


def exact_pinning_pays(pinned_bytes: int, expert_bytes: int, layer_bytes: int) -> bool:
    """Would vLLM's pinned copies (`uva_pinned_bytes`) plus one layer being re-homed hold more than
    `EXACT_PINNING_AUTO_RATIO` x the expert bytes? (`--reap-exact-pinning auto`)"""
    return max(pinned_bytes, expert_bytes) + layer_bytes > EXACT_PINNING_AUTO_RATIO * expert_bytes


def mem_available_bytes(meminfo: str) -> int | None:
    """MemAvailable from the text of /proc/meminfo (kB there), or None when it is not listed."""
    for line in meminfo.splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "MemAvailable":
            return int(rest.split()[0]) * 1024
    return None


def pow2_ceil(n: int) -> int:
    """The block PyTorch's caching host allocator pins for an n-byte request (c10::llvm::PowerOf2Ceil)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def round_threshold_bytes(alloc_conf: str | None) -> int | None:
    """Above this size pinned blocks are not rounded (`pinned_max_round_threshold_mb` or the smaller
    `pinned_max_cached_size_mb` in the allocator settings); None: always rounded."""
    pattern = r"pinned_max_(?:round_threshold|cached_size)_mb\s*:\s*(\d+)"
    found = [int(m) for m in re.findall(pattern, alloc_conf or "")]
    return min(found) * 2**20 if found else None


def alloc_conf(environ) -> str | None:
    """The allocator settings torch reads: PYTORCH_ALLOC_CONF first, PYTORCH_CUDA_ALLOC_CONF as its older
    fallback (torch 2.9+, c10/core/AllocatorConfig)."""
    return environ.get("PYTORCH_ALLOC_CONF") or environ.get("PYTORCH_CUDA_ALLOC_CONF")


def uva_pinned_bytes(
    w13_bytes: int, w2_bytes: int, experts: int, moe_layers: int, tp: int = 1, threshold: int | None = None
) -> int:
    """What vLLM's UVA offload pins for the experts: per MoE layer and TP rank, `w13_weight` and `w2_weight`
    ([E, ...] each, one expert's bytes given) as two `pin_memory()` blocks, each rounded up to a power of
    two unless above `threshold`."""

    def block(n: int) -> int:
        return n if threshold is not None and n > threshold else pow2_ceil(n)

    tp = max(tp, 1)
    return moe_layers * tp * (block(experts * w13_bytes // tp) + block(experts * w2_bytes // tp))


@dataclass(frozen=True)
class HostMemoryNeed:
    """What loading the model's experts into pinned host memory needs, against what is free."""

    expert_bytes: int  # every routed expert of every MoE layer (all TP ranks together)
    layer_bytes: int  # one layer's experts: the engine's copy of a layer before vLLM's is returned
    available_bytes: int  # MemAvailable before loading
    # what the experts take pinned: vLLM's UVA copies are rounded (uva_pinned_bytes); None = exact
    pinned_bytes: int | None = None
    in_flight: str = "one layer being re-homed"  # what `layer_bytes` is, for the refusal's sentence

    @property
    def held_bytes(self) -> int:
        return self.expert_bytes if self.pinned_bytes is None else max(self.pinned_bytes, self.expert_bytes)

    @property
    def needed_bytes(self) -> int:
        return self.held_bytes + self.layer_bytes + PROCESS_MARGIN_BYTES

    def refusal(self) -> str | None:
        """None when the host can hold it, else a sentence with the numbers."""
        if self.needed_bytes <= self.available_bytes:
            return None
        return (
            f"this host cannot hold the model's experts in pinned memory: they need "
            f"{self.held_bytes / GIB:.1f} GiB{self._rounding()} + {self.layer_bytes / GIB:.1f} GiB ({self.in_flight}) + {PROCESS_MARGIN_BYTES / GIB:.0f} GiB for the process = "
            f"{self.needed_bytes / GIB:.1f} GiB, and {self.available_bytes / GIB:.1f} GiB is available "
            f"(MemAvailable); choose a smaller model or a host with more memory, or pass --cpu-offload-gb "
            f"yourself to take over the offload sizing"
        )

    def _rounding(self) -> str:
        if self.held_bytes == self.expert_bytes:
            return ""
        return (
            f" ({self.expert_bytes / GIB:.1f} GiB of experts as vLLM's UVA offload pins them: PyTorch rounds "
            f"each pinned tensor up to a power of two)"
        )
