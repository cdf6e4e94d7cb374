"""The learned reuse-score policy (cache/learned.py): integer features, the fit, the rules."""

import numpy as np
import pytest
from cache_cases import layer_steps, online_counts, stepped, tiny_trace, traces
from hypothesis import given, settings

from reap_swap.cache.belady import Belady
from reap_swap.cache.learned import FEATURES, ONE, DLearn, Features, decode_rates, fit_layer, reuse_targets
from reap_swap.cache.mechanism import replay_layer
from reap_swap.cache.online import LRU
from reap_swap.cache.replay import POLICIES, simulate
from reap_swap.plan.document import load_plan

PLAN = "plans/reap-mini-moe.plan.json"


def test_features_are_exact_integers():
    table = np.arange(9, dtype=np.int64).reshape(3, 3)
    glob = np.array([1, 2, 3], dtype=np.int64)
    f = Features(table, glob)
    a = f.step(np.array([0, 2]), np.array([3, 1]), request_start=True)  # a prefill: shares 3/4, 1/4
    assert a.dtype == np.int64 and a.shape == (3, len(FEATURES))
    assert list(a[:, 0]) == [3 * ONE // 4, 0, ONE // 4]  # fast = share
    assert list(a[:, 2]) == list(a[:, 0]) and not a[:, 3].any() and not a[:, 5].any()  # request; reset
    b = f.step(np.array([1]), np.array([1]), request_start=False)  # a decode step routing 1
    assert b[0, 0] == (3 * ONE // 4 * 52429) >> 16 and b[1, 0] == ONE
    assert b[0, 1] == (3 * ONE // 4 * 63570) >> 16
    assert list(b[:, 2]) == list(a[:, 2])  # the request's prefill share is held
    assert list(b[:, 3]) == [0, ONE, 0] and list(b[:, 4]) == [0, ONE, 0]
    assert list(b[:, 5]) == list(table[1]) and list(b[:, 6]) == [1, 2, 3] and (b[:, 7] == ONE).all()
    with pytest.raises(ValueError, match="need"):
        Features(np.zeros((2, 3)), glob)


def test_reuse_targets_and_rates():
    ls = layer_steps([{0, 1}, {0}, {1}, {0}], 3, starts=(0,))
    y = reuse_targets(ls, 0.5)
    assert list(y[0]) == [1.0, 0.5, 0.0]  # 0 next at step 1 (d = 1), 1 at step 2 (d = 2), 2 never
    assert list(y[3]) == [0.0, 0.0, 0.0]
    assert list(decode_rates(ls)) == [round(ONE * 2 / 3), round(ONE / 3), 0]


def test_fit_learns_an_alternating_pattern():
    # decode alternates {1, 2} / {0, 3} with 2 slots: always admitting (LRU) never hits; the
    # fitted score predicts "not routed last step", so it keeps one pair and hits half the time
    seq = [{0, 1, 2, 3}] + [{0, 3} if t % 2 else {1, 2} for t in range(60)]
    ls = layer_steps(seq, 4, starts=(0,))
    model = fit_layer(ls)
    assert model["weights"].dtype == np.int64 and model["weights"].shape == (len(FEATURES),)
    learned = replay_layer(DLearn("d", model), ls, 2)
    assert replay_layer(LRU("lru"), ls, 2).decode_expert_hits <= 1  # one, right after the prefill
    assert learned.decode_expert_hits >= 0.45 * learned.decode_experts
    only = fit_layer(ls, features=("fast", "one"))
    assert (only["weights"][[FEATURES.index(f) for f in FEATURES if f not in ("fast", "one")]] == 0).all()
    with pytest.raises(ValueError, match="unknown features"):
        fit_layer(ls, features=("nope",))
    with pytest.raises(ValueError, match="experts"):
        DLearn("x", model).start(layer_steps([{0}], 5), 1)


@settings(max_examples=100, deadline=None)
@given(traces())
def test_rules_belady_bound_and_online_stepping(case):
    """Every step obeys the mechanism (replay_layer checks), never fewer host reads than Belady,
    and the server's accounting stepper gives the replay's counts exactly (request flags too)."""
    e, cap, steps, core = case
    core = frozenset(sorted(core)[:cap])
    ls = layer_steps(steps, e, starts=range(0, len(steps), 5))
    model = fit_layer(ls)
    want = replay_layer(DLearn("dlearn-seeded", model, seed=core), ls, cap)
    assert want.host_reads >= replay_layer(Belady(), ls, cap).host_reads
    got = online_counts(DLearn("dlearn-seeded", model, seed=core), ls, e, cap)
    assert stepped(got) == stepped(want)


def test_simulate_registers_dlearn_and_refuses_without_prior():
    assert "dlearn-seeded" in POLICIES
    trace, plan = tiny_trace(0), load_plan(PLAN)
    names = ["dlearn-seeded", "belady"]
    rows = {r["policy"]: r for r in simulate(trace, plan, ["0.5"], names)["rows"]}
    assert rows["dlearn-seeded"]["status"] == "refused" and "--prior-trace" in rows["dlearn-seeded"]["reason"]
    rows = {
        r["policy"]: r["totals"]
        for r in simulate(trace, plan, ["0.5"], names, prior_trace=tiny_trace(1))["rows"]
    }
    assert rows["dlearn-seeded"]["host_reads"] >= rows["belady"]["host_reads"]
    assert rows["dlearn-seeded"]["expert_hits"] > 0
