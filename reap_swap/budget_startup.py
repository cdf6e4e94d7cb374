"""The API process's half of `--reap-budget auto | GiB`: once, before serving, every worker
measures what it could add to its HBM pool; all then grow by the smallest answer (TP ranks keep
identical resident sets) and fill from the plan's ranked order. A refusal on any rank stops the
server before it serves, with that rank's numbers (residency/budget.py, memory_split.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from reap_swap import wire
from reap_swap.logs import get_logger

log = get_logger("reap_swap.budget")


class BudgetRefused(RuntimeError):
    """--reap-budget cannot be served here; the message carries the numbers."""


async def fill_budget(rpc: Callable[..., Awaitable[list]]) -> dict:
    """Probe, agree, grow, fill. Returns rank 0's report (or why the budget is inactive)."""
    probes = list(await rpc(wire.FILL_BUDGET))
    errors = [p["error"] for p in probes if p.get("error")]
    if errors:
        raise BudgetRefused(
            "; ".join(f"rank {p.get('rank')}: {p['error']}" for p in probes if p.get("error"))
        )
    active = [p for p in probes if p.get("active")]
    if not active:
        reason = probes[0].get("reason", "inactive") if probes else "no workers"
        if "--reap-budget plan" not in reason:
            log.warning("reap-swap: %s", reason)
        return {"active": False, "reason": reason}
    extra = min(int(p["extra_slots"]) for p in active)
    done = list(await rpc(wire.FILL_BUDGET, extra_slots=extra))
    errors = [f"rank {d.get('rank')}: {d['error']}" for d in done if d.get("error")]
    if errors:
        raise BudgetRefused("; ".join(errors))
    log.info("%s", done[0].get("line", "reap-swap memory split: ?"))
    return done[0]
