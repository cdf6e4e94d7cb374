"""Fake vLLM workers for the controller and route tests: the worker RPC contract implemented with
the real accounting backend, replicated like tensor-parallel ranks."""

import asyncio
from pathlib import Path

from script_modules import load_script

from reap_swap.active_set import signature
from reap_swap.plan import load_plan
from reap_swap.residency.accounting import AccountingResidency

E = 16


def tiny_plan_doc() -> dict:
    mod = load_script("make_tiny_moe")
    return mod.build_plan(mod.RECIPE, "tiny")


PLAN = load_plan(tiny_plan_doc())


class FakeWorker:
    def __init__(self, rank: int, tp_size: int):
        self.rank, self.tp_size = rank, tp_size
        self.backend = AccountingResidency(PLAN.core_sets(), PLAN.per_expert_bytes, "fake")
        self.counts = {layer: [0] * E for layer in PLAN.layers}
        self.fail_apply = 0  # how many of the next non-dry-run applies fail
        self.calls: list[tuple] = []

    def header(self):
        return {"rank": self.rank, "tp_rank": self.rank, "tp_size": self.tp_size, "dp_rank": 0}

    def stats(self, reset: bool):
        out = {str(k): {"counts": list(v), "weights": [c * 0.5 for c in v]} for k, v in self.counts.items()}
        if reset:
            self.counts = {layer: [0] * E for layer in PLAN.layers}
        return out

    def reap_status(self):
        res = self.backend.resident()
        return {
            **self.header(),
            "mode": "accounting",
            "plan_identity": PLAN.identity,
            "layers": {str(k): sorted(v) for k, v in sorted(res.items())},
            "resident_bytes": 0,
            "signature": signature(res),
            "resident_experts": sum(len(v) for v in res.values()),
        }

    def reap_apply_residency(self, keep, dry_run=False, read_stats=False):
        from reap_swap.worker import _parse_keep  # imports vLLM: only when a swap runs

        if self.fail_apply and not dry_run:
            self.fail_apply -= 1
            raise RuntimeError(f"rank {self.rank}: injected failure")
        parsed = _parse_keep(PLAN, keep)
        stats = self.stats(reset=False) if read_stats and not dry_run else {}
        result = self.backend.apply(parsed, dry_run=dry_run)
        if read_stats and not dry_run:
            self.stats(reset=True)
        return {**self.header(), **result, "stats": stats, "signature": signature(self.backend.resident())}

    def reap_read_stats(self, reset=False):
        return {**self.header(), "layers": self.stats(reset)}

    def reap_reset_stats(self):
        self.stats(reset=True)
        return {"rank": self.rank}


class FakeEngine:
    """collective_rpc over replicated workers; one call at a time (like the engine core)."""

    def __init__(self, tp_size: int = 2):
        self.workers = [FakeWorker(r, tp_size) for r in range(tp_size)]
        self.in_flight = 0
        self.max_in_flight = 0

    async def rpc(self, method, *args):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0)  # let other coroutines run, as a real RPC would
            results = []
            for w in self.workers:
                w.calls.append((method, args))
                results.append(getattr(w, method)(*args))
            return results
        finally:
            self.in_flight -= 1

    def route(self, layer: int, experts: list[int]):
        for w in self.workers:  # TP ranks see identical routing
            for e in experts:
                w.counts[layer][e] += 1


def build_tiny_model(out: Path) -> Path:
    """The e2e tiny MoE (scripts/make_tiny_moe.py) built into `out`."""
    return load_script("make_tiny_moe").build(out)
