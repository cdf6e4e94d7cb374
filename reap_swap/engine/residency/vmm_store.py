"""swap.ExpertStore over an engine state's VMM ranges and HBM slot pool (the CUDA data path)."""

from __future__ import annotations

from typing import Any

import torch

from reap_swap.engine import vmm
from reap_swap.engine.residency import swap


class StoreBase:
    """What the per-expert and the grouped VMM stores share: the publish mode, where copies read
    from, and the copy stream's events (one event a copy: wait or poll)."""

    def __init__(self, st: Any, publish_every: int | None, bytes_per_unit: int) -> None:
        self.st = st
        # swap.py: overlapped publishes (0: only at the end); None: the state's, else swap.PUBLISH_EVERY
        self.publish_every = swap.publish_mode(publish_every, st)
        # remapping ahead needs copies that read the masters where no remap touches them
        self.copies_read_masters = swap.reads_masters(self.publish_every)
        # only the payload moves: a unit's padding to the mapping granularity is never read
        self.bytes_per_expert = bytes_per_unit

    def quiesce(self) -> None:
        torch.cuda.synchronize(self.st.device)

    def _landed_event(self) -> Any:
        """An event after every copy queued so far on the copy stream (the token of start_copy)."""
        event = torch.cuda.Event()
        event.record(self.st.copy_stream)
        return event

    def wait_copy(self, token: Any) -> None:
        token.synchronize()

    def copy_landed(self, token: Any) -> bool:
        return bool(token.query())


class VmmStore(StoreBase):
    """Evict = map the host master back; admit = copy host -> slot and map the slot (after the
    copy landed, or remapping ahead before: swap.py)."""

    def __init__(self, st: Any, publish_every: int | None = None) -> None:  # st: state.EngineState
        super().__init__(st, publish_every, next(iter(st.layers.values())).expert_bytes if st.layers else 0)

    def map_host(self, layer: int, expert: int) -> None:
        self.st.layers[layer].rng.map_host(expert, defer_access=True)

    def start_copy(self, layer: int, expert: int, slot: int) -> Any:
        pool, stream = self.st.pool, self.st.copy_stream
        rng = self.st.layers[layer].rng
        src = rng.master_address(expert) if self.copies_read_masters else rng.unit_address(expert)
        vmm.copy_async(pool.unit_address(slot), src, self.bytes_per_expert, stream.cuda_stream)
        return self._landed_event()

    def map_slot(self, layer: int, expert: int, slot: int) -> None:
        self.st.layers[layer].rng.map_device(expert, self.st.pool.slot_handle(slot), defer_access=True)

    def publish(self) -> None:
        """Set access on every pending remap; also called while later copies are in flight
        (swap.py's module docstring: the ranges touched are disjoint from those copies')."""
        for entry in self.st.layers.values():  # flush_access returns at once where nothing is pending
            entry.rng.flush_access()
