"""Can this host hold the model's experts in pinned memory? Checked before vLLM loads anything.

On CUDA the launcher loads every expert into pinned host memory (stock UVA offload) and the
engine then copies each layer into its own host-backed range, returning vLLM's pinned copy
layer by layer (compat.moe.release_cached_pinned_memory). So the host must hold the expert set
once, plus one layer in flight, plus the process itself. Measured (research.md run 8, H200, vLLM
0.26.0): Qwen3.5-35B-A3B at full size, 60 GiB of bf16 experts, peaked at 67.2 GiB in use, i.e.
7.2 GiB above the experts (Python, CUDA context, compile workers, one 1.5 GiB layer in flight).
Quantized checkpoints (issue 16): the expert bytes are as the checkpoint stores them
(`ModelShape.expert_bytes`: FP8 one byte per weight); the launcher does not offload (so does not
check) formats the engine refuses (quant_budget.py). Online `--quantization fp8` of a bf16
checkpoint is checked at its bf16 bytes, an upper bound (vLLM loads bf16 and quantizes after).
Pure: the caller reads /proc/meminfo.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
# what a serving process needs beside the pinned experts (run 8: 7.2 GiB incl. one layer in flight)
PROCESS_MARGIN_BYTES = 6 * GIB


def mem_available_bytes(meminfo: str) -> int | None:
    """MemAvailable from the text of /proc/meminfo (kB there), or None when it is not listed."""
    for line in meminfo.splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "MemAvailable":
            return int(rest.split()[0]) * 1024
    return None


@dataclass(frozen=True)
class HostMemoryNeed:
    """What loading the model's experts into pinned host memory needs, against what is free."""

    expert_bytes: int  # every routed expert of every MoE layer (all TP ranks together)
    layer_bytes: int  # one layer's experts: the engine's copy of a layer before vLLM's is returned
    available_bytes: int  # MemAvailable before loading

    @property
    def needed_bytes(self) -> int:
        return self.expert_bytes + self.layer_bytes + PROCESS_MARGIN_BYTES

    def refusal(self) -> str | None:
        """None when the host can hold it, else a sentence with the numbers."""
        if self.needed_bytes <= self.available_bytes:
            return None
        return (
            f"this host cannot hold the model's experts in pinned memory: they need "
            f"{self.expert_bytes / GIB:.1f} GiB + {self.layer_bytes / GIB:.1f} GiB (one layer being "
            f"re-homed) + {PROCESS_MARGIN_BYTES / GIB:.0f} GiB for the process = "
            f"{self.needed_bytes / GIB:.1f} GiB, and {self.available_bytes / GIB:.1f} GiB is available "
            f"(MemAvailable); choose a smaller model or a host with more memory, or pass --cpu-offload-gb "
            f"yourself to take over the offload sizing"
        )
