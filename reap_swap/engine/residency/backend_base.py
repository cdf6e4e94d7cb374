"""What the two CUDA residency backends share (`cuda_backend.CudaResidency`, private units, and
`grouped_backend.GroupedResidency`, grouped layers): the test constructor over any state and
store, the common attributes, the refusal of layers whose tensors left the engine's ranges, and
how refused layers are reported in `resident()`.

Torch-free on purpose: grouped_backend imports no torch at module level and must stay so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Self

from reap_swap.engine.residency.refusals import LayerRefusals
from reap_swap.engine.residency.swap import ExpertStore


def refuse_misplaced(layers: Mapping[int, Any], misplaced: Callable[[Any], list[str]], ranges: str) -> None:
    """Raise when a layer's re-homed tensors no longer point into the engine's `ranges`: swaps
    would then remap pages the kernel never reads."""
    moved = {i: misplaced(e) for i, e in layers.items() if misplaced(e)}
    if moved:
        raise RuntimeError(
            f"layers {moved}: these expert tensors no longer point into the engine's {ranges} "
            "(something replaced them after re-homing); swaps would move bytes the kernel never reads"
        )


class ResidencyBase:
    """The shared constructor seam and refused-layer reporting of the CUDA residency backends."""

    residency_mode = "cuda"

    @classmethod
    def over(cls, st: Any, store: ExpertStore, refusals: LayerRefusals | None = None) -> Self:
        """The backend over any state and store (tests: a fake store, no GPU, no pointer checks)."""
        backend = object.__new__(cls)
        backend._init(st, store, refusals or LayerRefusals())
        return backend

    def _init(self, st: Any, store: ExpertStore, refusals: LayerRefusals) -> None:
        self.st = st
        self.device_caches = None
        self.seeded = None  # cuda_backend: device_cache_seeded.SeededPins with --reap-cache-seed seeded
        self.store = store  # the data path; fault.FaultInjectingBackend may wrap it for one apply
        self.refusals = refusals

    def with_refused(self, out: dict[int, frozenset[int]]) -> dict[int, frozenset[int]]:
        """Add each refused layer not in `out`: all its experts if they sit in HBM, none if on host."""
        plan = self.st.plan
        for index, on_hbm in self.refusals.on_hbm.items():
            if index not in out:
                num = plan.layers[index].num_experts if plan and index in plan.layers else 0
                out[index] = frozenset(range(num)) if on_hbm else frozenset()
        return out
