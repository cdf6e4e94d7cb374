"""The strategies by name: one interface over selection's static / prior / probe choices.

Callers (the client flows, the CLI, the bench config) pick a strategy by its name and ask it for a
:class:`~reap_swap.client.selection.Selection`; ``needs_probe`` tells them whether to run the
core-only prefill pass first. The registry lives apart from the greedy fill in selection.py so
that the selection logic stays free of naming and dispatch, and a new strategy is one entry here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from reap_swap.client.selection import (
    Selection,
    SelectionError,
    select_prior,
    select_probe,
    select_static,
)
from reap_swap.client.slice_values import MissedMass
from reap_swap.plan.document import Plan

STRATEGIES = ("static", "prior", "probe")


class Strategy(Protocol):
    name: str
    needs_probe: bool  # True: select() wants the misses of a core-only prefill pass

    def select(
        self,
        plan: Plan,
        prompt: str | Sequence[Mapping[str, Any]],
        *,
        budget_bytes: int | None = None,
        probe: MissedMass | None = None,
        capacity: Mapping[int, int] | None = None,
    ) -> Selection: ...


@dataclass(frozen=True)
class _Static:
    name: str = "static"
    needs_probe: bool = False

    def select(self, plan, prompt, *, budget_bytes=None, probe=None, capacity=None) -> Selection:
        return select_static(plan, budget_bytes)  # the core alone: within any layer's capacity


@dataclass(frozen=True)
class _Prior:
    name: str = "prior"
    needs_probe: bool = False

    def select(self, plan, prompt, *, budget_bytes=None, probe=None, capacity=None) -> Selection:
        return select_prior(plan, prompt, budget_bytes, capacity)


@dataclass(frozen=True)
class _Probe:
    name: str = "probe"
    needs_probe: bool = True

    def select(self, plan, prompt, *, budget_bytes=None, probe=None, capacity=None) -> Selection:
        if probe is None:
            raise SelectionError("strategy 'probe' needs the router misses of a core-only prefill pass")
        return select_probe(plan, probe, prompt, budget_bytes, capacity)


_REGISTRY: dict[str, Strategy] = {"static": _Static(), "prior": _Prior(), "probe": _Probe()}


def get_strategy(name: str) -> Strategy:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise SelectionError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}") from None


def select(
    plan: Plan,
    strategy: str,
    prompt: str | Sequence[Mapping[str, Any]],
    *,
    budget_bytes: int | None = None,
    probe: MissedMass | None = None,
    capacity: Mapping[int, int] | None = None,
) -> Selection:
    return get_strategy(strategy).select(
        plan, prompt, budget_bytes=budget_bytes, probe=probe, capacity=capacity
    )


__all__ = ["STRATEGIES", "Strategy", "get_strategy", "select"]
