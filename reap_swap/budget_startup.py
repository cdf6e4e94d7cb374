"""The API process's half of `--reap-budget auto | GiB`: once, before serving, every worker
measures what it could add to its HBM pool; all then grow by the smallest answer (TP ranks keep
identical resident sets) and fill from the plan's ranked order. A refusal on any rank stops the
server before it serves, with that rank's numbers (residency/budget.py, memory_split.py)."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from pathlib import Path

from reap_swap import wire
from reap_swap.logs import get_logger
from reap_swap.memory_split import accounting_split_line

log = get_logger("reap_swap.budget")


# The load-time refusal happens in a worker (inside vLLM's load_model), where the launcher cannot
# catch it: the worker writes its message to this file (path in the environment, inherited by the
# engine and worker processes), the launcher prints it as its one error line and exits 1.
# Not REAP_* on purpose: settings.py refuses unknown REAP_* variables; this one is internal.
REFUSAL_ENV = "REAPSWAP_REFUSAL_FILE"


class BudgetRefused(RuntimeError):
    """--reap-budget cannot be served here; the message carries the numbers."""


def arm_refusal_file(run_dir: Path, environ: dict = os.environ) -> Path:  # noqa: B006 - the process env
    """Before the engine starts: where a worker's refusal will be written (an empty file now)."""
    path = Path(run_dir) / f"reap-swap-refusal-{os.getpid()}.txt"
    path.write_text("")
    environ[REFUSAL_ENV] = str(path)
    return path


def record_refusal(message: str, environ: dict = os.environ) -> None:  # noqa: B006
    """In a worker: append the refusal for the launcher (no-op when no launcher armed the file)."""
    path = environ.get(REFUSAL_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(message.replace("\n", " ") + "\n")


def read_refusal(path: Path | None) -> str | None:
    """In the launcher, after the engine failed: the first refusal a worker wrote, else None."""
    try:
        lines = [line for line in Path(path).read_text().splitlines() if line.strip()] if path else []
    except OSError:
        return None
    return lines[0] if lines else None


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
