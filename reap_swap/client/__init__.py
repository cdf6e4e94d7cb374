"""The active-set client: per-prompt selection of slices, and the HTTP flows that pin them.

`ReapClient` / `AsyncReapClient` are the entry points (docs/api.md); selection.py and strategies.py
are the pure choice of slices they make per prompt.
"""

from reap_swap.client.reap_client import AsyncReapClient, ReapClient

__all__ = ["AsyncReapClient", "ReapClient"]
