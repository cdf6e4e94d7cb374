"""What the API process reports when a swap fails on the workers (HTTP 5xx, routes.py), or when
the workers refuse it for capacity before moving anything (HTTP 422, `CapacityExceeded`).

Why its own module: routes.py maps it to a response and the controller raises it; neither the
failure's shape nor its rank parsing is swap logic.
"""

from __future__ import annotations

import re

_RANK_RE = re.compile(r"\brank (\d+)\b")


def stages_agree(ranks: list[tuple[int, str | None]]) -> bool:
    """(pp_rank, signature) of every rank -> one signature per pipeline stage (a stage's tensor-
    and data-parallel ranks hold the same layers' set; without PP: one signature for all ranks).
    False for no ranks."""
    seen: dict[int, set] = {}
    for pp_rank, sig in ranks:
        seen.setdefault(int(pp_rank), set()).add(sig)
    return bool(seen) and all(len(sigs) == 1 for sigs in seen.values())


class WorkerSwapFailed(RuntimeError):
    """A worker call failed; `rolled_back` says whether the previous resident set was restored.

    `failed_ranks`: the ranks that reported the failure (best effort when the RPC itself raised:
    read from "rank N" in the text); `workers`: each rank's brief after the rollback.
    """

    def __init__(
        self,
        message: str,
        rolled_back: bool,
        rollback_error: str | None = None,
        failed_ranks: list[int] | None = None,
        workers: list[dict] | None = None,
    ):
        super().__init__(message)
        self.rolled_back = rolled_back
        self.rollback_error = rollback_error
        self.failed_ranks = failed_ranks or []
        self.workers = workers or []

    @property
    def workers_consistent(self) -> bool | None:
        """Do the ranks report one signature (per pipeline stage) after the rollback (None: no
        per-rank replies)?"""
        if not self.workers:
            return None
        return stages_agree([(w.get("pp_rank", 0), w.get("signature")) for w in self.workers])


def ranks_named_in(text: str) -> list[int]:
    """Ranks a failure message names ("rank 1: ..."): vLLM relays only the worker's message."""
    return sorted({int(m) for m in _RANK_RE.findall(text)})


class CapacityExceeded(ValueError):
    """The workers refused the resident set for capacity before anything moved: wider than the
    swap table the device cache's lent tails leave (K), than a seeded layer's cache slots, or than
    the pool in groups (PoolCapacityError on CUDA and in accounting mode alike). A client error:
    the request asked for more than this server holds, as `budget_exceeded` is for the plan's
    budget; 500 was answered before (runs to 26). ``field`` is always ``active_set``."""

    field = "active_set"
    error_type = "capacity_exceeded"  # the HTTP error's type (routes.py)

    def __init__(self, message: str, needed: int, capacity: int, failed_ranks: list[int]) -> None:
        super().__init__(f"active_set: {message}")
        self.needed, self.capacity, self.failed_ranks = needed, capacity, failed_ranks

    def numbers(self) -> dict:
        return {"needed": self.needed, "capacity": self.capacity, "failed_ranks": self.failed_ranks}


def capacity_refusal(replies: list, dry_run: bool = False) -> CapacityExceeded | None:
    """The refusal when every reply (wire.ApplyReply) is a capacity refusal, else None: a rank that
    applied (a pipeline stage with room) changed its set and its counters, so that swap is a 500 after
    the rollback. In a dry run nothing changes anywhere, so the failed replies alone decide.
    `needed` / `capacity` are the lowest failing rank's pair, in its units (expert slots, a seeded
    layer's slots, or group slots with --reap-group-size); the message has every distinct sentence."""
    failed = [r for r in replies if r.error]
    if not failed or any(r.capacity is None for r in failed) or (len(failed) < len(replies) and not dry_run):
        return None
    first = min(failed, key=lambda r: r.rank).capacity
    text = "; ".join(dict.fromkeys(r.capacity.message for r in failed))  # one sentence per kind
    return CapacityExceeded(text, first.needed, first.capacity, sorted(r.rank for r in failed))
