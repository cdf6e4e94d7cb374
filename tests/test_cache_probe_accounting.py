"""All three (plan-swap+cache): the simulator's ``probe+lfu`` / ``probe+dlfu`` / ``probe+core+dlfu``
and the servable split ``probe+core+dlfu-split`` equal the server's accounting mode
(WorkerCore.apply pinning each swap, CacheAccounting stepping the counter stream) on the same trace
and the same per-request sets, count for count; the split never holds more than the budget's slots."""

import dataclasses

import numpy as np
import pytest

from reap_swap.cache.accounting import CacheAccounting
from reap_swap.cache.hybrid import SPLIT, TAILS, SwapPinned, swap_points
from reap_swap.cache.mechanism import LayerSteps, replay_layer
from reap_swap.cache.probe import _probe_sets, servable_split, split_probe_sets
from reap_swap.cache.replay import _policy, simulate
from reap_swap.cache.stepper import LayerCache
from reap_swap.cache.trace import from_requests, load_trace
from reap_swap.engine import wire
from reap_swap.engine.residency.accounting import AccountingResidency
from reap_swap.engine.worker_core import WorkerCore
from reap_swap.plan.document import load_plan

PLAN = "plans/reap-mini-moe.plan.json"
TRACE = "data/traces/mini-moe-heldout.npz"
REQUESTS = 10


@pytest.fixture(scope="module")
def plan():
    return load_plan(PLAN)


@pytest.fixture(scope="module")
def sub():
    """The first REQUESTS requests of the held-out trace, as a trace of their own."""
    t = load_trace(TRACE)
    reqs = [
        [t.topk_ids[t.step_offsets[s] : t.step_offsets[s + 1]] for s in range(a, b)]
        for a, b in zip(t.request_offsets[:REQUESTS], t.request_offsets[1 : REQUESTS + 1], strict=True)
    ]
    return from_requests(
        reqs,
        layers=t.layers,
        model=t.model,
        num_experts=t.num_experts,
        top_k=t.top_k,
        per_expert_bytes=t.per_expert_bytes,
    )


def server_replay(plan, trace, tail, sets, name):
    """The worker in accounting mode: before each request's prefill the client's swap goes through
    WorkerCore.apply (which pins only a changing swap); every step's counter rows are fed to the
    cache. ``sets``: request's first step -> {layer: set}. Returns the CacheAccounting."""
    layers = {l: trace.num_experts for l in trace.layers}
    if name == "probe+core+dlfu":  # the default --reap-cache lfu: the device's pinned form, as served
        # the mini plan's pool (32) cannot lend 12 beside its 24-expert core (CUDA would refuse the
        # cache): the simulator's probe+core+dlfu holds |set| + N per layer, beyond the budget; here
        # a pool of the whole model (64) with --reap-cache-device on keeps 52 for swaps, enough for
        # every probe set (at most core + 12 = 36)
        big = dataclasses.replace(plan, swappable_budget_bytes=64 * plan.per_expert_bytes)
        acc = CacheAccounting.build(big, "lfu", tail, layers, {}, top_k=trace.top_k, cache_device="on")
        assert acc.policy == "core+dlfu" and acc.device_form and acc.swap_slots == 52
    else:  # the seeded slots (core + tail spread) with TAILS[name] as the tail policy
        acc = CacheAccounting.build(plan, "lfu", tail, layers, {}, top_k=trace.top_k, seed="seeded")
        acc.caches = {
            l: LayerCache(_policy(TAILS[name], l, plan, None, 0.8), l, e, acc.slots[l])
            for l, e in layers.items()
        }
    return drive(plan, trace, acc, sets)


def drive(plan, trace, acc, sets):
    """WorkerCore.apply for each request's swap (refusing the test on an error reply, e.g. a swap
    over the swap table K), then every step's counter rows into ``acc``."""
    core = WorkerCore(plan, {}, AccountingResidency(plan.core_sets(), 1, "test"), 0, {}, cache=acc)
    counts = {l: trace.step_counts(l) for l in trace.layers}
    starts = {int(s) for s in trace.request_first_steps()}
    for t in range(trace.num_steps):
        if t in starts:
            reply = core.apply({"resident": wire.encode_resident_sets(sets[t])})
            assert "error" not in reply, reply
        acc.step({l: counts[l][t] for l in trace.layers}, t in starts)
    return acc


@pytest.mark.parametrize("name", sorted(TAILS))
def test_simulate_equals_server_accounting(plan, sub, name):
    tail = 12  # 36 slots over 4 layers (core 24): the probe sets leave a tail in some layers
    budget = (sum(len(plan.layers[l].core) for l in sub.layers) + tail) * sub.per_expert_bytes
    row = simulate(sub, plan, [f"{budget}B"], [name])["rows"][0]
    assert row["status"] == "ok", row
    slots = {int(k): v for k, v in row["slots"].items()}
    counts = {l: sub.step_counts(l) for l in sub.layers}
    probe = _probe_sets(plan, sub, counts, budget, slots)  # the client's sets, per layer
    sets = {t: {l: probe[l][t] for l in sub.layers} for t in probe[sub.layers[0]]}
    acc = server_replay(plan, sub, tail, sets, name)
    assert acc.slots == slots
    for l in sub.layers:
        want = row["layers"][str(l)]
        got = acc.caches[l].counts.to_dict(sub.per_expert_bytes)
        assert got | {"steps": want["steps"]} == want, (name, l)
        assert acc.caches[l].counts.steps == want["steps"]
    tot = row["totals"]
    assert tot["prefetched"] > 0 and tot["admitted"] > 0 and tot["selection_misses"] > 0
    assert acc.totals()["misses"] == tot["selection_misses"]
    assert acc.totals()["promotions"] == tot["admitted"]


def _steps(rows, starts, e=8):
    c = np.zeros((len(rows), e), dtype=np.int64)
    for i, r in enumerate(rows):
        for x in r:
            c[i, x] += 1
    return c


def test_pins_follow_the_worker_rule():
    """Startup swap to the core: no pin (the core stays evictable); a swap changing one layer pins
    every layer; a repeated swap is a no-op. Checked against LayerCache.pin on a handmade stream
    (the worker's own rule, WorkerCore.apply, is what the test above drives)."""
    core = {0: frozenset({0, 1}), 1: frozenset({2, 3})}
    a = {0: frozenset({0, 1, 5}), 1: frozenset({2, 3})}
    starts = [0, 3, 6, 9]
    sets = {0: core, 3: a, 6: a, 9: core}
    rows = [[6, 7], [6, 7], [6, 4], [5, 0], [6, 7], [4, 6], [2, 3], [7, 6], [6, 5], [1, 4], [6, 7], [7, 6]]
    assert swap_points({l: {t: s[l] for t, s in sets.items()} for l in core}, core) == [3, 9]
    cap = 4
    for l in core:
        steps = LayerSteps.from_counts(l, _steps(rows, starts), np.array(starts))
        swaps = {t: sets[t][l] for t in (3, 9)}
        from reap_swap.cache.online import LFU

        got = replay_layer(SwapPinned("probe+lfu", LFU("x", seed=core[l]), swaps), steps, cap)
        server = LayerCache(LFU("x", seed=core[l]), l, 8, cap)
        pinned_after = []
        for t in range(len(rows)):
            if t in swaps:
                server.pin(swaps[t])
            pinned_after.append(server.pinned)
            server.step(_steps(rows, starts)[t], t in starts)
        assert got.to_dict(1) == server.counts.to_dict(1) | {"steps": got.steps}
        assert pinned_after[0] == frozenset()  # the startup core is not pinned
        assert pinned_after[3] == a[l] and pinned_after[9] == core[l]
    # layer 1's set never changes, yet the worker pins it at step 3 (the swap changed layer 0)
    assert swap_points({0: {0: core[0], 3: a[0]}, 1: {0: core[1], 3: core[1]}}, core) == [3]


def _with_pool(plan, pool):
    return dataclasses.replace(plan, swappable_budget_bytes=pool * plan.per_expert_bytes)


@pytest.mark.parametrize("pool", [32, 40])  # the mini plan's own budget (n = 1, K = 28); n = 2, K = 32
def test_split_equals_server_accounting(plan, sub, pool):
    """The servable split through accounting mode as the bench serves it: --reap-cache lfu (pinned
    form), --reap-cache-device on, --reap-cache-slots L x n, the client's sets selected within K.
    Every swap passes check_swap (the CUDA swap table's capacity rule) and the counts equal the
    simulator's row."""
    plan = _with_pool(plan, pool)
    layout, why = servable_split(plan, sub, pool * sub.per_expert_bytes)
    assert why is None and layout.pool == pool
    n, layers = layout.tail_per_layer, len(sub.layers)
    assert (n, layout.swap_slots) == {32: (1, 28), 40: (2, 32)}[pool]
    row = simulate(sub, plan, [f"{pool * sub.per_expert_bytes}B"], [SPLIT])["rows"][0]
    assert row["status"] == "ok", row
    assert row["split"]["reap_cache_slots"] == n * layers and row["split"]["swap_slots"] == layout.swap_slots
    acc = CacheAccounting.build(
        plan,
        "lfu",
        n * layers,
        {l: sub.num_experts for l in sub.layers},
        {},
        top_k=sub.top_k,
        cache_device="on",
    )
    assert acc.policy == "core+dlfu" and acc.device_form and acc.swap_slots == layout.swap_slots
    assert acc.slots == layout.slots == {int(k): v for k, v in row["slots"].items()}
    counts = {l: sub.step_counts(l) for l in sub.layers}
    probe = split_probe_sets(plan, sub, counts, layout)
    sets = {t: {l: probe[l][t] for l in sub.layers} for t in probe[sub.layers[0]]}
    assert any(sum(map(len, s.values())) > layout.core for s in sets.values())  # swaps add experts
    drive(plan, sub, acc, sets)  # no swap refused: each set fits K
    for l in sub.layers:
        want = row["layers"][str(l)]
        got = acc.caches[l].counts.to_dict(sub.per_expert_bytes)
        assert got | {"steps": want["steps"]} == want, l
    tot = row["totals"]
    assert tot["prefetched"] > 0 and tot["admitted"] > 0
    assert acc.totals()["promotions"] == tot["admitted"]


class _Held:
    """A policy wrapper recording the layer's resident count after each prefetch and each step."""

    def __init__(self, policy, log):
        self.policy, self.log = policy, log

    def __getattr__(self, name):  # prefetches, resizes, capacity, name: the wrapped policy's
        return getattr(self.policy, name)

    def start(self, steps, capacity):
        out = self.policy.start(steps, capacity)
        self.log.append(("start", -1, len(out)))
        return out

    def prefetch(self, t, resident):
        out = self.policy.prefetch(t, resident)
        self.log.append(("prefetch", t, len(frozenset(out))))
        return out

    def choose(self, t, resident, needed, counts):
        out = self.policy.choose(t, resident, needed, counts)
        self.log.append(("choose", t, len(frozenset(out))))
        return out


@pytest.mark.parametrize("pool", [32, 40])
def test_split_never_holds_more_than_the_budget(plan, pool):
    """On the whole mini held-out trace: at every step (after each swap, after each admission) the
    layers together hold at most the pool's slots; each request's sets fit K. probe+core+dlfu on
    the same budget does exceed it (acctail), so the check is not vacuous."""
    trace, plan = load_trace(TRACE), _with_pool(plan, pool)
    layout, _ = servable_split(plan, trace, pool * trace.per_expert_bytes)
    counts = {l: trace.step_counts(l) for l in trace.layers}
    sets = split_probe_sets(plan, trace, counts, layout)
    assert all(sum(len(sets[l][t]) for l in trace.layers) <= layout.swap_slots for t in sets[0])
    core = {l: plan.layers[l].core for l in trace.layers}
    points = swap_points(sets, core)
    starts = trace.request_first_steps()
    held, row = {}, simulate(trace, plan, [f"{pool * trace.per_expert_bytes}B"], [SPLIT])["rows"][0]
    for l in trace.layers:
        log = []
        policy = _Held(_policy(SPLIT, l, plan, {l: {t: sets[l][t] for t in points}}, 0.8), log)
        c = replay_layer(policy, LayerSteps.from_counts(l, counts[l], starts), layout.slots[l])
        assert c.to_dict(trace.per_expert_bytes) == row["layers"][str(l)]  # the simulator's replay
        held[l] = log
    events = [e[:2] for e in held[0]]
    assert all([e[:2] for e in log] == events for log in held.values())  # the layers in lockstep
    totals = [sum(held[l][i][2] for l in trace.layers) for i in range(len(events))]
    assert max(totals) <= layout.pool
    assert max(totals) > layout.core  # the tail and the swaps did hold beyond the core
    unsplit = simulate(trace, plan, [f"{pool * trace.per_expert_bytes}B"], ["probe+core+dlfu"])["rows"][0]
    slots = {int(k): v for k, v in unsplit["slots"].items()}
    full = _probe_sets(plan, trace, counts, pool * trace.per_expert_bytes, slots)
    over = max(
        sum(min(trace.num_experts, len(full[l][t]) + slots[l] - len(core[l])) for l in trace.layers)
        for t in full[0]
    )
    assert over > layout.pool


def test_split_refused_where_the_bench_skips_the_arm(plan, sub):
    """Too few slots beyond the core to split (the bench skips plan-swap+cache): refused, named."""
    rows = simulate(sub, _with_pool(plan, 28), [f"{28 * sub.per_expert_bytes}B"], [SPLIT])["rows"]
    assert rows[0]["status"] == "refused" and "the bench skips the arm" in rows[0]["reason"]
