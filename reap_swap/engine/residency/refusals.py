"""The layers the CUDA engine left on vLLM's stock path, each with its reason.

Why a record: a refused layer keeps working (vLLM's own expert path), so nothing fails; the
refusal must still be visible in status, and the worker must know whether that layer's experts
sit in HBM (stock placement) or in host memory (vLLM's UVA offload) when it reports residency.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger("reap_swap.engine.residency")


class NothingRehomed(RuntimeError):
    """The engine re-homed no MoE layer: each one was refused by name (or never left meta)."""


@dataclass
class LayerRefusals:
    reasons: dict[str, str] = field(default_factory=dict)  # layer name -> reason
    on_hbm: dict[int, bool] = field(default_factory=dict)  # refused layer index -> experts in HBM

    def refuse(self, name: str, index: int | None, reason: str, on_hbm: bool) -> None:
        """Record (and log) that layer `name` keeps vLLM's stock expert path."""
        self.reasons[name] = reason
        if index is not None:
            self.on_hbm[index] = on_hbm
        logger.warning("reap-swap: layer %s keeps vLLM's stock expert path: %s", name, reason)

    def summary(self) -> str:
        return "; ".join(f"{k}: {v}" for k, v in self.reasons.items())
