"""The API process's half of `--reap-budget auto | GiB`: once, before serving, every worker
measures what it could add to its HBM pool; all then grow by the smallest answer (TP ranks keep
identical resident sets) and fill from the plan's ranked order. A refusal on any rank stops the
server before it serves, with that rank's numbers (engine/residency/budget.py, memory_split.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from reap_swap import get_logger
from reap_swap.engine import wire
from reap_swap.engine.refusal import BudgetRefused, record_refusal
from reap_swap.sizing.memory_split import accounting_split_line

log = get_logger("reap_swap.budget")


async def fill_budget(rpc: Callable[..., Awaitable[list]]) -> dict:
    """Probe, agree, grow, fill. Returns rank 0's report (or why the budget is inactive)."""
    probes = list(await rpc(wire.FILL_BUDGET))
    errors = [p["error"] for p in probes if p.get("error")]
    if errors:
        _refuse("; ".join(f"rank {p.get('rank')}: {p['error']}" for p in probes if p.get("error")))
    active = [p for p in probes if p.get("active")]
    if not active:
        reason = probes[0].get("reason", "inactive") if probes else "no workers"
        if "--reap-budget plan" not in reason:
            log.warning("reap-swap: %s", reason)
        kv = probes[0].get("kv") if probes else None
        if kv is None:
            return {"active": False, "reason": reason}
        line = accounting_split_line(
            budget=kv.get("budget"), pool_bytes=kv.get("pool_bytes", 0), kv_bytes=kv["kv_bytes"],
            kv_allocated=(kv.get("kv_allocated") or {}).get("bytes"), kv_source=kv.get("kv_source", "?"),
        )  # fmt: skip
        log.info("%s", line)
        return {"active": False, "reason": reason, **kv, "line": line}
    extra = min(int(p["extra_slots"]) for p in active)
    done = list(await rpc(wire.FILL_BUDGET, extra_slots=extra))
    errors = [f"rank {d.get('rank')}: {d['error']}" for d in done if d.get("error")]
    if errors:
        _refuse("; ".join(errors))
    log.info("%s", done[0].get("line", "reap-swap memory split: ?"))
    return done[0]


def _refuse(message: str) -> None:
    record_refusal(message)  # also seen by the launcher if vLLM wraps the exception on its way out
    raise BudgetRefused(message)
