"""Fake vLLM workers for the controller and route tests: the real worker logic (WorkerCore and the
WorkerRpc methods) over plain torch modules carrying the real counters and the real accounting
backend, replicated like tensor-parallel ranks. Failures go through the real seam
(reap_arm_swap_fault) and come back as the real {"error": ...} reply."""

import asyncio
from pathlib import Path

import torch
from script_modules import load_script

from reap_swap.engine.counting import counters
from reap_swap.engine.residency.accounting import AccountingResidency
from reap_swap.engine.worker_core import WorkerCore, WorkerRpc
from reap_swap.plan.document import load_plan

E = 16


def tiny_plan_doc() -> dict:
    mod = load_script("make_tiny_moe")
    return mod.build_plan(mod.RECIPE, "tiny")


PLAN = load_plan(tiny_plan_doc())


def counting_layer(num_experts: int = E) -> torch.nn.Module:
    """A module with the counters' buffers, as ReapRoutedExperts registers them (CPU)."""
    module = torch.nn.Module()
    counters.register_counters(module, num_experts, coactivation=False)
    return module


def stage_layers(plan, pp_rank: int, pp_size: int) -> list[int]:
    """The plan layers pipeline stage `pp_rank` holds (contiguous, like vLLM's get_pp_indices)."""
    every = sorted(plan.layers)
    per = -(-len(every) // pp_size)
    return every[pp_rank * per : (pp_rank + 1) * per]


def make_core(rank: int, tp_size: int, plan=PLAN, pp_size: int = 1) -> WorkerCore:
    """Global rank -> (pp_rank, tp_rank) as vLLM lays them out: tp fastest."""
    pp_rank, tp_rank = divmod(rank, tp_size)
    mine = stage_layers(plan, pp_rank, pp_size)
    other = [l for l in plan.layers if l not in mine]
    layers = {layer: counting_layer(plan.layers[layer].num_experts) for layer in mine}
    core = {l: v for l, v in plan.core_sets().items() if l in mine}
    backend = AccountingResidency(core, plan.per_expert_bytes, "fake")
    ranks = {"tp_rank": tp_rank, "tp_size": tp_size, "pp_rank": pp_rank, "pp_size": pp_size, "dp_rank": 0}
    return WorkerCore(plan, layers, backend, rank, ranks, other_stage=other)


class FakeWorker(WorkerRpc):
    def __init__(self, rank: int, tp_size: int, pp_size: int = 1):
        self.rank = rank
        self.core = make_core(rank, tp_size, pp_size=pp_size)
        self.fail_apply = 0  # how many of the next non-dry-run applies fail (armed through the seam)
        self.calls: list[tuple[str, dict]] = []

    def _reap_core(self) -> WorkerCore:
        return self.core

    @property
    def backend(self):
        return self.core.backend

    @property
    def counts(self) -> dict[int, list[int]]:
        return {l: getattr(m, counters.COUNTS).tolist() for l, m in self.core.layers.items()}

    def reap_apply_residency(self, **request) -> dict:
        if self.fail_apply and not request.get("dry_run"):
            self.fail_apply -= 1
            self.reap_arm_swap_fault(self.rank)
        return super().reap_apply_residency(**request)


class FakeEngine:
    """collective_rpc over replicated workers; one call at a time (like the engine core)."""

    def __init__(self, tp_size: int = 2, pp_size: int = 1):
        self.workers = [FakeWorker(r, tp_size, pp_size) for r in range(tp_size * pp_size)]
        self.in_flight = 0
        self.max_in_flight = 0
        self.raise_next: str | None = None  # the next call raises this (an RPC failing outright)

    async def rpc(self, method, **kwargs):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0)  # let other coroutines run, as a real RPC would
            if self.raise_next is not None:
                message, self.raise_next = self.raise_next, None
                raise RuntimeError(message)
            results = []
            for w in self.workers:
                w.calls.append((method, kwargs))
                results.append(getattr(w, method)(**kwargs))
            return results
        finally:
            self.in_flight -= 1

    def route(self, layer: int, experts: list[int]):
        """One token per expert routed with gate weight 0.5, on every rank (TP ranks see identical
        routing), recorded by the real counters; under PP only the stage holding the layer."""
        ids = torch.tensor([[e] for e in experts], dtype=torch.int64)
        weights = torch.full((len(experts), 1), 0.5)
        for w in self.workers:
            if layer in w.core.layers:
                counters.record(w.core.layers[layer], ids, weights)


def build_tiny_model(out: Path) -> Path:
    """The e2e tiny MoE (scripts/make_tiny_moe.py) built into `out`."""
    return load_script("make_tiny_moe").build(out)
