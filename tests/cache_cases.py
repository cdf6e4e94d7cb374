"""Shared set-up of the cache-policy tests (test_simulate, test_cache_prior, test_cache_learned):
one layer's steps from expert sets, the hypothesis strategy of random small traces, a tiny
skewed multi-layer trace, and the accounting stepper driven over a layer's steps."""

import numpy as np
from hypothesis import strategies as st

from reap_swap.cache.mechanism import LayerSteps
from reap_swap.cache.stepper import LayerCache
from reap_swap.cache.trace import from_requests


def layer_steps(steps, num_experts, starts=(0,)) -> LayerSteps:
    """One layer's steps, each a set of experts (selected once) or a dict expert -> selections."""
    counts = np.zeros((len(steps), num_experts), dtype=np.int32)
    for t, s in enumerate(steps):
        for e, c in s.items() if isinstance(s, dict) else ((e, 1) for e in s):
            counts[t, e] = c
    return LayerSteps.from_counts(0, counts, np.asarray(starts))


def traces(min_steps: int = 2):
    """(experts e, capacity 1..e, 1..3 experts per step for min_steps..40 steps, a core set)."""
    return st.integers(2, 8).flatmap(
        lambda e: st.tuples(
            st.just(e),
            st.integers(1, e),
            st.lists(
                st.frozensets(st.integers(0, e - 1), min_size=1, max_size=min(e, 3)),
                min_size=min_steps,
                max_size=40,
            ),
            st.frozensets(st.integers(0, e - 1), max_size=e),
        )
    )


def tiny_trace(seed):
    """4 layers x 16 experts (top-2, skewed), 3 requests: a prefill of 5..29 tokens, 12 decodes."""
    rng = np.random.default_rng(seed)
    p = np.arange(16, 0, -1) / 136

    def tokens(n):
        return np.array([[rng.choice(16, 2, replace=False, p=p) for _ in range(4)] for _ in range(n)])

    reqs = [[tokens(int(rng.integers(5, 30)))] + [tokens(1) for _ in range(12)] for _ in range(3)]
    return from_requests(
        reqs, layers=[0, 1, 2, 3], model="m", num_experts=16, top_k=2, per_expert_bytes=73728
    )


def online_counts(policy, ls: LayerSteps, num_experts: int, capacity: int):
    """The server's accounting stepper (stepper.LayerCache) driven step by step over `ls`: its counts."""
    cache = LayerCache(policy, 0, num_experts, capacity)
    for t in range(ls.num_steps):
        row = np.zeros(num_experts, dtype=np.int64)
        row[ls.needed[t]] = ls.counts[t]
        cache.step(row, bool(ls.request_start[t]))
    return cache.counts


def stepped(counts) -> tuple:
    """What stepping and replay must agree on: expert and selection hits, admissions, bypasses."""
    return counts.expert_hits, counts.selection_hits, counts.admitted, counts.bypassed
