"""The plan-aware device policies (cache/prior.py): admission control and the transition prior."""

import numpy as np
import pytest
from cache_cases import layer_steps, online_counts, stepped, tiny_trace, traces
from hypothesis import given, settings

from reap_swap.cache.belady import Belady
from reap_swap.cache.device import DLFU
from reap_swap.cache.mechanism import replay_layer
from reap_swap.cache.prior import DLFUAdmit, DLFUMarkov, transition_table
from reap_swap.cache.replay import POLICIES, SimulationError, simulate
from reap_swap.cache.trace import from_requests
from reap_swap.plan.document import load_plan

PLAN = "plans/reap-mini-moe.plan.json"


def new_policies(ls, core):
    table = transition_table(ls, 16.0)
    return [DLFUAdmit("dlfu-admit-seeded", seed=core), DLFUMarkov("dlfu-markov-seeded", table, seed=core)]


@settings(max_examples=150, deadline=None)
@given(traces())
def test_no_new_policy_reads_fewer_experts_than_belady(case):
    e, cap, steps, core = case
    core = frozenset(sorted(core)[:cap])
    ls = layer_steps(steps, e, starts=range(0, len(steps), 5))
    bound = replay_layer(Belady(), ls, cap).host_reads
    for policy in new_policies(ls, core):
        c = replay_layer(policy, ls, cap)  # replay_layer also checks the mechanism's rules every step
        assert c.host_reads >= bound, policy.name
        assert c.expert_hits + c.expert_misses == c.experts


@settings(max_examples=60, deadline=None)
@given(traces())
def test_stepping_online_equals_replay(case):
    """The server's accounting mode (stepper.LayerCache) gives the simulator's counts exactly."""
    e, cap, steps, core = case
    core = frozenset(sorted(core)[:cap])
    ls = layer_steps(steps, e, starts=range(0, len(steps), 5))
    for fresh, again in zip(new_policies(ls, core), new_policies(ls, core), strict=True):
        want = replay_layer(fresh, ls, cap)
        assert stepped(online_counts(again, ls, e, cap)) == stepped(want)


def test_admission_keeps_the_hotter_resident():
    # expert 0 routed 5 times, then a one-off 1 routed with 0 absent: dlfu admits 1 (evicting 0),
    # dlfu-admit reads 1 through and keeps 0, so the next use of 0 is a hit
    ls = layer_steps([{0}] * 5 + [{1}, {0}], 3)
    plain, admit = replay_layer(DLFU("dlfu"), ls, 1), replay_layer(DLFUAdmit("a"), ls, 1)
    assert plain.expert_hits == 4 and admit.expert_hits == 5
    assert admit.bypassed == 1 and admit.admitted == 1


def test_transition_table_counts_decode_pairs_only():
    # request 0: steps 0 (prefill), 1, 2; request 1: steps 3 (prefill), 4. Decode pairs: (1 -> 2) only
    ls = layer_steps([{0, 1, 2}, {0}, {2}, {1}, {1}], 3, starts=(0, 3))
    table = transition_table(ls, 1.0)
    assert table.dtype == np.int64 and table.shape == (3, 3)
    one = 1 << 16
    assert table[0, 2] == round(one * 1.1 / 1.3) and table[0, 0] == round(one * 0.1 / 1.3)
    assert table[1, 1] == round(one / 3)  # no pair from 1: the smoothing alone, uniform
    with pytest.raises(ValueError, match=">= 0"):
        transition_table(ls, -1.0)


def test_markov_prior_admits_the_predicted_expert():
    # the table says 0 is followed by 2; after 0, 1 and 2 compete for the one slot left ...
    ls = layer_steps([{0}, {1}, {0}, {2}, {0}], 3)
    table = np.zeros((3, 3), dtype=np.int64)
    table[0, 2] = 8 << 16
    assert replay_layer(DLFUMarkov("m", table), ls, 2).admitted >= 2
    with pytest.raises(ValueError, match="square"):
        DLFUMarkov("m", np.zeros((2, 3)))


def test_simulate_registers_and_refuses_by_name():
    assert {"dlfu-admit-seeded", "dlfu-markov-seeded"} <= set(POLICIES)
    trace, prior, plan = tiny_trace(0), tiny_trace(1), load_plan(PLAN)
    names = ["dlfu-seeded", "dlfu-admit-seeded", "dlfu-markov-seeded", "belady"]
    rows = {r["policy"]: r for r in simulate(trace, plan, ["0.5"], names)["rows"]}
    assert rows["dlfu-markov-seeded"]["status"] == "refused"
    assert "--prior-trace" in rows["dlfu-markov-seeded"]["reason"]
    rep = simulate(trace, plan, ["0.5"], names, prior_trace=prior)
    rows = {r["policy"]: r["totals"] for r in rep["rows"]}
    assert rep["prior_trace"]["markov_weight"] == 16.0
    assert all(rows[p]["host_reads"] >= rows["belady"]["host_reads"] for p in names)
    wrong = from_requests(
        [[np.array([[[0, 1], [0, 1]]])]],
        layers=[0, 1],
        model="m",
        num_experts=8,
        top_k=2,
        per_expert_bytes=73728,
    )
    with pytest.raises(SimulationError, match="--prior-trace"):
        simulate(trace, plan, ["0.5"], names, prior_trace=wrong)
