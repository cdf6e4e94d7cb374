"""A size-bounded mapping that forgets the least recently used entry.

Every per-request map in a long-running server (refresh counts, statistics, forensic records)
is keyed by client-chosen request ids; without a bound it grows for as long as the server runs.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

DEFAULT_MAX_ENTRIES = 4096


class LRUDict(OrderedDict, Generic[K, V]):
    """OrderedDict with move-to-end on read and write and eviction beyond ``max_entries``."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES):
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        super().__init__()
        self.max_entries = max_entries

    def __getitem__(self, key: K) -> V:
        value = super().__getitem__(key)
        self.move_to_end(key)
        return value

    def get(self, key: K, default=None):
        return self[key] if key in self else default

    def __setitem__(self, key: K, value: V) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.max_entries:
            self.popitem(last=False)
