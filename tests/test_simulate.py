"""cache_policy: the mechanism's rules, each policy's definition, Belady = the brute-force optimum,
and no policy beating it; simulate() budgets, slots, refusals and the probe policy."""

import itertools
from functools import cache

import numpy as np
import pytest
from cache_cases import layer_steps, traces
from hypothesis import given, settings
from hypothesis import strategies as st

from reap_swap.cache.belady import Belady, BeladyAdmit
from reap_swap.cache.mechanism import PolicyError, replay_layer
from reap_swap.cache.online import LFRU, LFU, LRU, PerRequest, Static
from reap_swap.cache.replay import POLICIES, SimulationError, parse_budget, simulate
from reap_swap.cache.report import default_policy, layer_table, markdown_table
from reap_swap.cache.trace import from_requests
from reap_swap.plan.document import load_plan

PLAN = "plans/reap-mini-moe.plan.json"


def online(cap_core=frozenset()):
    """Every online policy (unseeded, seeded, pinned) for a core."""
    out = [LRU("lru"), LFU("lfu"), LFRU("lfru"), Static(cap_core)]
    if cap_core:
        out += [
            LRU("lru-seeded", seed=cap_core),
            LFU("lfu-seeded", seed=cap_core),
            LFRU("lfru-seeded", seed=cap_core),
            LRU("core+lru", seed=cap_core, pinned=cap_core),
            LFU("core+lfu", seed=cap_core, pinned=cap_core),
            LFRU("core+lfru", seed=cap_core, pinned=cap_core),
        ]
    return out


# ----------------------------------------------------------------------------- brute force


def optimum(step_sets, num_experts, capacity, prefetch=False) -> int:
    """Fewest host reads over every legal schedule: any startup fill, then per step keep what it
    needs, admit only what it routed (or, with ``prefetch``, anything, each costing one read)."""
    experts = range(num_experts)
    states = [frozenset(c) for k in range(capacity + 1) for c in itertools.combinations(experts, k)]
    needs = [frozenset(s) for s in step_sets]

    @cache
    def best(t: int, resident: frozenset) -> int:
        if t == len(needs):
            return 0
        need = needs[t]
        miss = len(need - resident)
        options = []
        for new in states:
            if not (resident & need) <= new:
                continue
            if not prefetch and not new <= resident | need:
                continue
            extra = len(new - resident - need) if prefetch else 0
            options.append(extra + best(t + 1, new))
        return miss + min(options)

    return min(best(0, s) for s in states)


step_lists = st.integers(2, 5).flatmap(
    lambda e: st.tuples(
        st.just(e),
        st.integers(1, e),
        st.lists(st.frozensets(st.integers(0, e - 1), min_size=1, max_size=e), min_size=1, max_size=7),
    )
)


@settings(max_examples=150, deadline=None)
@given(step_lists)
def test_belady_equals_brute_force_optimum(case):
    e, cap, steps = case
    got = replay_layer(Belady(), layer_steps(steps, e), cap).expert_misses
    assert got == optimum(steps, e, cap)


@settings(max_examples=60, deadline=None)
@given(step_lists)
def test_prefetching_cannot_beat_belady(case):
    e, cap, steps = case
    got = replay_layer(Belady(), layer_steps(steps, e), cap).expert_misses
    assert got == optimum(steps, e, cap, prefetch=True)


def test_brute_force_exhaustive_small():
    """Every trace of 4 steps over 3 experts, every capacity."""
    subsets = [frozenset(s) for k in (1, 2, 3) for s in itertools.combinations(range(3), k)]
    for steps in itertools.product(subsets, repeat=4):
        for cap in (1, 2, 3):
            assert replay_layer(Belady(), layer_steps(steps, 3), cap).expert_misses == optimum(steps, 3, cap)


def admit_optimum(step_sets, num_experts, capacity) -> int:
    """Fewest misses when every routed expert must be resident after its step (the soonest-wanted of
    a step wider than the slots) and the cache starts empty: the published residency studies' rule."""
    needs = [frozenset(s) for s in step_sets]

    @cache
    def best(t: int, resident: frozenset) -> int:
        if t == len(needs):
            return 0
        need = needs[t]
        miss = len(need - resident)
        if len(need) >= capacity:  # the step's residents stay, any choice of its others fills up
            forced = resident & need
            fill = capacity - len(forced)
            keeps = [forced | frozenset(c) for c in itertools.combinations(sorted(need - forced), fill)]
        else:
            others = sorted(resident - need)
            room = min(capacity - len(need), len(others))
            keeps = [need | frozenset(c) for c in itertools.combinations(others, room)]
        return miss + min(best(t + 1, k) for k in keeps)

    return best(0, frozenset())


@settings(max_examples=150, deadline=None)
@given(step_lists)
def test_belady_admit_equals_the_mandatory_admission_optimum(case):
    """belady-admit (the oracle of the OLMoE residency tables: every miss admitted, cold start) is
    that rule's optimum, and never below the mechanism's Belady (which may read a miss through)."""
    e, cap, steps = case
    got = replay_layer(BeladyAdmit(), layer_steps(steps, e), cap).expert_misses
    assert got == admit_optimum(steps, e, cap)
    assert got >= replay_layer(Belady(), layer_steps(steps, e), cap).expert_misses


# ----------------------------------------------------------------------------- properties


@settings(max_examples=120, deadline=None)
@given(traces(min_steps=1))
def test_no_policy_reads_fewer_experts_than_belady(case):
    e, cap, steps, core = case
    core = frozenset(sorted(core)[:cap])
    ls = layer_steps(steps, e, starts=range(0, len(steps), 5))
    bound = replay_layer(Belady(), ls, cap).host_reads
    sets = {t: frozenset(sorted(s)[:cap]) for t, s in enumerate(steps) if t % 5 == 0}
    for policy in online(core) + [PerRequest(core, sets)]:
        c = replay_layer(policy, ls, cap)
        assert c.host_reads >= bound, policy.name


@settings(max_examples=120, deadline=None)
@given(traces(min_steps=1))
def test_counts_are_consistent(case):
    e, cap, steps, core = case
    core = frozenset(sorted(core)[:cap])
    ls = layer_steps(steps, e)
    for policy in online(core) + [Belady()]:
        c = replay_layer(policy, ls, cap)
        assert c.experts == sum(len(s) for s in steps) == c.selections
        assert 0 <= c.expert_hits <= c.experts
        assert c.admitted + c.bypassed == c.expert_misses
        assert c.read_through_steps == sum(1 for s in steps if len(s) > cap)
        assert c.decode_experts == c.experts - len(steps[0])
        if policy.name in ("lru", "lfu", "lfru") or policy.name.endswith("seeded"):
            # demand admission: a step that fits the slots admits every miss
            fit = [t for t, s in enumerate(steps) if len(s) <= cap]
            assert c.bypassed <= sum(len(steps[t]) for t in range(len(steps)) if t not in fit)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 8), st.integers(1, 50), st.integers(0, 7))
def test_unseeded_lru_on_one_repeated_expert_misses_once(cap, n, expert):
    c = replay_layer(LRU("lru"), layer_steps([{expert}] * n, 8), cap)
    assert (c.expert_misses, c.admitted, c.selection_hits) == (1, 1, n - 1)


def test_everything_fits_only_cold_misses():
    steps = [{0, 1}, {2, 3}, {0, 3}, {1, 2}, {0, 1}]
    for policy in online():
        if policy.name != "static":
            assert replay_layer(policy, layer_steps(steps, 4), 4).expert_misses == 4
    assert replay_layer(Belady(), layer_steps(steps, 4), 4).expert_misses == 0  # startup fill


def test_lru_lfu_lfru_definitions():
    # cap 2: A A A B C B -> at C, LRU evicts A (oldest), LFU keeps A (used 3x) and evicts B
    steps = [{0}, {0}, {0}, {1}, {2}, {1}]
    lru = replay_layer(LRU("lru"), layer_steps(steps, 3), 2)
    lfu = replay_layer(LFU("lfu", decay=1.0), layer_steps(steps, 3), 2)
    assert (lru.expert_misses, lfu.expert_misses) == (3, 4)
    # LFRU: A's 3 selections aged 2 steps (3/3 = 1.0) vs B's 1 selection aged 1 step (1/2): evicts B
    assert replay_layer(LFRU("lfru"), layer_steps(steps, 3), 2).expert_misses == 4
    # with strong decay LFU forgets A's history and behaves like LRU here
    assert replay_layer(LFU("lfu", decay=0.1), layer_steps(steps, 3), 2).expert_misses == 3


def test_static_and_pinned_core():
    steps = [{0, 1}, {2}, {3}, {0, 2}]
    st_ = replay_layer(Static({0, 1}), layer_steps(steps, 4), 3)
    assert (st_.expert_hits, st_.admitted, st_.prefetched) == (3, 0, 0)
    pinned = replay_layer(LRU("core+lru", seed={0, 1}, pinned={0, 1}), layer_steps(steps, 4), 3)
    # tail of 1 slot: 2 admitted, then 3 evicts 2, then 2 misses again; 0 and 1 always hit
    assert (pinned.expert_misses, pinned.admitted) == (3, 3)


def test_read_through_step_keeps_what_it_needs():
    # cap 2, a prefill routing 4 experts: residents it needs stay, the free slot gets the busiest miss
    ls = layer_steps([{0: 1}, {0: 5, 1: 1, 2: 9, 3: 2}], 4)
    c = replay_layer(LFU("lfu"), ls, 2)
    assert (c.read_through_steps, c.admitted, c.bypassed) == (1, 2, 2)
    assert (c.selections, c.selection_hits) == (18, 5)


def test_rules_are_enforced():
    class Cheat(Static):
        def choose(self, t, resident, needed, counts):
            return resident | {3}  # admits an expert the step did not route

    with pytest.raises(PolicyError, match="did not route"):
        replay_layer(Cheat(frozenset()), layer_steps([{0}], 4), 2)

    class Evict(Static):
        def choose(self, t, resident, needed, counts):
            return frozenset()

    with pytest.raises(PolicyError, match="the step needs"):
        replay_layer(Evict({0}), layer_steps([{0}], 4), 2)
    with pytest.raises(PolicyError, match="starts with 3"):
        replay_layer(Static({0, 1, 2}), layer_steps([{0}], 4), 2)


def test_prefetch_counts_bytes_and_hits():
    steps = [{2, 3}, {2}, {0}, {1}]
    c = replay_layer(
        PerRequest({0}, {0: frozenset({0, 2}), 2: frozenset({0, 1})}), layer_steps(steps, 4, starts=[0, 2]), 2
    )
    assert (c.prefetched, c.expert_hits, c.admitted) == (2, 4, 0)


# ----------------------------------------------------------------------------- simulate()


def mini_trace(requests=4, seed=0):
    rng = np.random.default_rng(seed)
    p = np.arange(16, 0, -1) / 136

    def tokens(n):
        return np.array([[rng.choice(16, 2, replace=False, p=p) for _ in range(4)] for _ in range(n)])

    reqs = [[tokens(int(rng.integers(5, 30)))] + [tokens(1) for _ in range(12)] for _ in range(requests)]
    return from_requests(
        reqs, layers=[0, 1, 2, 3], model="m", num_experts=16, top_k=2, per_expert_bytes=73728
    )


def test_parse_budget_and_allocation():
    total = 64 * 73728
    assert parse_budget("0.25", total).bytes == 16 * 73728
    assert parse_budget("1MiB", total).bytes == 1 << 20
    for bad in ("0", "1.5", "lots", "2TB"):
        with pytest.raises(SimulationError, match="--budget"):
            parse_budget(bad, total)
    # per-layer slots are sizing/cache_tail.py's (tests/test_cache_tail.py); the flag is checked here
    with pytest.raises(SimulationError, match="--layer-slots even: choose one of core\\+tail, uniform"):
        simulate(mini_trace(), None, ["0.5"], ["lru"], allocation="even")


def test_simulate_all_policies_on_the_mini_plan():
    trace = mini_trace()
    rep = simulate(trace, load_plan(PLAN), ["0.125", "0.5"])
    rows = {(r["budget"], r["policy"]): r for r in rep["rows"]}
    assert len(rows) == 2 * len(POLICIES)
    for p in POLICIES:  # the core (24 experts) does not fit 8 slots: plan policies refused, by name
        r = rows[("0.125", p)]
        assert (r["status"] == "refused") == (p in ("static", "probe") or "seeded" in p or "+" in p)
        if r["status"] == "refused":
            assert "exceeds its 2 slots" in r["reason"]
    ok = [r for r in rep["rows"] if r["status"] == "ok"]
    for r in ok:
        t = r["totals"]
        assert t["selections"] == trace.num_tokens * trace.top_k * len(trace.layers)
        assert t["bytes_moved"] == (t["admitted"] + t["prefetched"]) * 73728
        assert sum(r["layers"][l]["experts"] for l in r["layers"]) == t["experts"]
    half = {p: rows[("0.5", p)]["totals"] for p in POLICIES if rows[("0.5", p)]["status"] == "ok"}
    assert set(POLICIES) - set(half) == {"dlfu-markov-seeded", "dlearn-seeded"}  # no --prior-trace
    assert all(half[p]["host_reads"] >= half["belady"]["host_reads"] for p in half)
    assert half["static"]["admitted"] == 0 and half["probe"]["prefetched"] > 0
    assert half["probe"]["expert_hit_rate"] >= half["static"]["expert_hit_rate"]
    assert "| 0.5 | 10/9/7/6 | belady |" in markdown_table(rep)
    assert "layer 3" in layer_table(rep)


def test_simulate_refuses_mismatched_inputs():
    t = from_requests(
        [[np.array([[[0, 1]]])]], layers=[9], model="m", num_experts=16, top_k=2, per_expert_bytes=73728
    )
    with pytest.raises(SimulationError, match="layers \\[9\\]"):
        simulate(t, load_plan(PLAN), ["0.5"])
    with pytest.raises(SimulationError, match="--policy nope"):
        simulate(mini_trace(1), None, ["0.5"], ["nope"])
    rep = simulate(mini_trace(1), None, ["0.5"], ["static", "lru"])
    assert rep["rows"][0]["status"] == "refused" and "needs --plan" in rep["rows"][0]["reason"]


def test_default_policy_rule():
    def report(values):
        return {
            "rows": [
                {"status": "ok", "budget": b, "policy": p, "totals": {"expert_hit_rate": v}}
                for b, row in values.items()
                for p, v in row.items()
            ]
        }

    rep = report(
        {"0.25": {"belady": 0.9, "lru": 0.88, "lfu": 0.86}, "0.5": {"belady": 0.95, "lru": 0.93, "lfu": 0.94}}
    )
    got = default_policy([rep], ["0.25", "0.5"], ["0.25", "0.5"], candidates=("lru", "lfu"))
    assert got["passing"] == []
    assert "below lfu" in got["failures"]["lru"][0]
    got = default_policy([rep], ["0.25"], ["0.25"], candidates=("lru", "lfu"))
    assert got["passing"] == ["lru"]
