"""The server-side cache in accounting mode: stepping = replaying (the simulator's counts exactly),
slots, swap pinning, disengagement, the worker's per-step feed from counter deltas, settings."""

import numpy as np
import pytest
import torch

from reap_swap.cache.accounting import CacheAccounting
from reap_swap.cache.mechanism import LayerSteps, replay_layer
from reap_swap.cache.replay import _policy, simulate
from reap_swap.cache.stepper import LayerCache, StepperError
from reap_swap.cache.trace import load_trace
from reap_swap.config import flags
from reap_swap.config import settings as reap_settings
from reap_swap.engine import wire
from reap_swap.engine.counting import counters
from reap_swap.engine.residency.accounting import AccountingResidency
from reap_swap.engine.worker_core import WorkerCore
from reap_swap.plan.document import load_plan

PLAN = "plans/reap-mini-moe.plan.json"
TRACE = "data/traces/mini-moe-heldout.npz"
ONLINE = [p for p in ("static", "lru", "lru-seeded", "lfu", "lfu-seeded", "lfru", "lfru-seeded", "core+lfu")]


@pytest.fixture(scope="module")
def plan():
    return load_plan(PLAN)


@pytest.fixture(scope="module")
def trace():
    t = load_trace(TRACE)
    # the first 6 requests keep the test quick; the equivalence is per step
    end = int(t.request_offsets[6])
    return t, {l: t.step_counts(l)[:end] for l in t.layers}, t.request_first_steps()[:6]


@pytest.mark.parametrize("name", ONLINE)
def test_stepping_equals_replay_layer(plan, trace, name):
    t, counts, starts = trace
    for l in t.layers:
        cap = len(plan.layers[l].core) + 3
        steps = LayerSteps.from_counts(l, counts[l], starts)
        want = replay_layer(_policy(name, l, plan, None, 0.8), steps, cap)
        cache = LayerCache(_policy(name, l, plan, None, 0.8), l, t.num_experts, cap)
        for i, row in enumerate(counts[l]):
            cache.step(row, bool(steps.request_start[i]))
        assert cache.counts.to_dict(1) == want.to_dict(1), (name, l)


def test_offline_policies_refused(plan):
    with pytest.raises(StepperError):
        LayerCache(_policy("belady", 0, plan, None, 0.8), 0, 16, 8)


# (seed, simulator policy, tail slots the simulator gets for --reap-cache-slots 6 over 4 layers):
# pinned runs the device's core+dlfu on 6 // 4 = 1 slot per layer (the device drops the remainder)
@pytest.mark.parametrize("seed, sim, tail", [("pinned", "core+dlfu", 4), ("seeded", "dlfu-seeded", 6)])
def test_accounting_equals_simulate_on_the_trace(plan, trace, seed, sim, tail):
    """The worker-side object (all layers, the device's slots) == simulate(); lfu is the device's
    core+dlfu by default and its dlfu-seeded with --reap-cache-seed seeded."""
    t, counts, starts = trace
    acc = CacheAccounting.build(plan, "lfu", 6, {l: 16 for l in t.layers}, {}, top_k=2, seed=seed)
    start_set = set(int(s) for s in starts)
    for i in range(len(counts[t.layers[0]])):
        acc.step({l: counts[l][i] for l in t.layers}, i in start_set)
    core = sum(len(plan.layers[l].core) for l in t.layers)
    budget = f"{(core + tail) * t.per_expert_bytes}B"
    from reap_swap.cache.trace import from_requests

    sub = from_requests(
        [
            [t.topk_ids[t.step_offsets[s] : t.step_offsets[s + 1]] for s in range(a, b)]
            for a, b in zip(t.request_offsets[:6], t.request_offsets[1:7], strict=True)
        ],
        layers=t.layers,
        model=t.model,
        num_experts=t.num_experts,
        top_k=t.top_k,
        per_expert_bytes=t.per_expert_bytes,
    )
    row = simulate(sub, plan, [budget], [sim])["rows"][0]
    assert {int(k): v for k, v in row["slots"].items()} == acc.slots
    tot = row["totals"]
    got = acc.totals()
    assert got["hits"] == tot["selection_hits"] and got["misses"] == tot["selection_misses"]
    assert got["expert_misses"] == tot["expert_misses"] and got["promotions"] == tot["admitted"]
    assert got["read_through_steps"] == tot["read_through_steps"]
    assert got["evictions"] == tot["admitted"] + tot["start_resident"] - sum(
        len(c.resident) for c in acc.caches.values()
    )
    assert got["misses"] > 0 and got["promotions"] > 0 and got["evictions"] > 0
    st = acc.status()
    assert st["engaged"] and st["policy"] == st["device_policy"] == sim and "note" not in st
    assert all(v["occupied"] <= v["slots"] for v in st["layers"].values())


def test_swap_pins_its_set_and_the_tail_yields(plan):
    acc = CacheAccounting.build(plan, "lru", 8, {l: 16 for l in plan.layers}, {}, top_k=2)
    cap = acc.slots[0]
    swapped = frozenset(range(16 - cap + 1, 16))  # cap - 1 experts: one tail slot left
    acc.pin({0: swapped})
    c0 = acc.caches[0]
    assert swapped <= c0.resident and len(c0.resident) <= cap and c0.tail_slots == 1
    row = np.zeros(16, dtype=np.int64)
    for e in (0, 1, 2):  # decode steps routing outside the pinned set: they share one tail slot
        row[:] = 0
        row[e], row[15] = 1, 1
        acc.step({l: row for l in plan.layers}, False)
        assert swapped <= c0.resident
    assert c0.counts.prefetched > 0
    big = frozenset(range(cap + 2))  # larger than the slots: takes them all, no tail
    acc.pin({0: big})
    assert c0.resident == big and c0.tail_slots == 0


def test_disengaged_layers_and_reasons(plan):
    args = (plan, "lfu", 0, {0: 16, 1: 16}, {2: "x", 3: "y"})
    acc = CacheAccounting.build(*args, top_k=64, seed="seeded")
    st = acc.status()
    assert not st["layers"]["2"]["engaged"] and "not counted" in st["layers"]["2"]["reason"]
    assert "too few slots" in st["layers"]["0"]["reason"]
    # pinned (core+dlfu): 0 slots is the device's refusal, so no cache at all (as on CUDA)
    none = CacheAccounting.build(*args, top_k=2).status()
    assert not none["engaged"] and none["reason"].startswith("--reap-cache-slots is 0"), none
    off = CacheAccounting.disengaged("--reap-cache off").status()
    assert off == {"engaged": False, "reason": "--reap-cache off"}
    wire.CacheStatus.model_validate(st)


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        counters.register_counters(self, 16, False)
        self.top_k = 2


def test_worker_core_feeds_counter_deltas_and_records(plan):
    layers = {l: _Layer() for l in plan.layers}
    acc = CacheAccounting.build(plan, "lfu", 4, {l: 16 for l in layers}, {}, top_k=2, record_steps=2)
    core = WorkerCore(plan, layers, AccountingResidency(plan.core_sets(), 1, "test"), 0, {}, cache=acc)
    ids = torch.tensor([[0, 1], [1, 5]])
    for step in range(3):
        core.cache_before_step()
        for m in layers.values():
            counters.record_torch(m, ids, torch.ones_like(ids, dtype=torch.float32))
        core.cache_after_step(step == 0)
    assert acc.steps == 3
    assert acc.caches[0].counts.selections == 12  # 4 selections a step, deltas not cumulative sums
    reply = wire.CacheTraceReply.model_validate(core.cache_trace({"reset": True}))
    assert reply.recording == 2 and len(reply.steps) == 2  # bounded
    assert reply.steps[0]["layers"]["0"][:6] == [1, 2, 0, 0, 0, 1]
    assert core.cache_trace({})["steps"] == []
    status = wire.StatusReply.model_validate(core.status())
    assert status.cache.engaged and status.cache.totals["hits"] > 0
    core.cache_before_step()  # an empty step (nothing routed) is not a cache step
    core.cache_after_step(False)
    assert acc.steps == 3


def test_cache_settings():
    r = flags.resolve({"plan_file": "p"}, {})
    assert (r.settings.cache.policy, r.settings.cache.slots, r.settings.cache.record_steps) == (
        "lfu",
        "auto",
        0,
    )
    r = flags.resolve({"plan_file": "p", "cache": "off", "cache_slots": "12"}, {"REAP_CACHE": "lru"})
    assert (r.settings.cache.policy, r.settings.cache.slots) == ("lru", 12)
    assert reap_settings.Settings.from_worker_config(r.settings.to_worker_config()).cache.slots == 12
    for bad in ({"cache_slots": "-1"}, {"cache_slots": "many"}, {"cache": "belady"}):
        with pytest.raises(reap_settings.SettingsError, match="--reap-cache"):
            flags.resolve({"plan_file": "p", **bad}, {})
    with pytest.raises(reap_settings.SettingsError, match="REAP_CACHE_SLOTS"):
        flags.resolve({"plan_file": "p"}, {"REAP_CACHE_SLOTS": "x"})


def test_surface_report_and_prometheus_deltas(plan):
    from reap_swap.server import cache_status as cache_surface

    acc = CacheAccounting.build(plan, "lfu", 4, {l: 16 for l in plan.layers}, {}, top_k=2)
    row = np.zeros(16, dtype=np.int64)
    row[[0, 9]] = 1
    acc.step({l: row for l in plan.layers}, True)

    class S:  # what report() reads of a wire.StatusReply
        def __init__(self, st):
            self.cache = wire.CacheStatus.model_validate(st)

    same = cache_surface.report([S(acc.status()), S(acc.status())])
    assert same["engaged"] and same["ranks_agree"]
    other = CacheAccounting.build(plan, "lfu", 4, {l: 16 for l in plan.layers}, {}, top_k=2)
    assert cache_surface.report([S(acc.status()), S(other.status())])["ranks_agree"] is False
    m = cache_surface.CacheMetrics()
    before = cache_surface.COUNTERS["misses"]._value.get()
    m.update(same)
    m.update(same)  # the same totals twice: counted once
    assert cache_surface.COUNTERS["misses"]._value.get() - before == same["totals"]["misses"] > 0


def test_startup_reset_zeroes_a_device_cache_counters_too(plan):
    """reset_stats (the controller's startup reset) also zeroes the device cache's own counters:
    vLLM's profile forward runs the device step (run 12 counted its 8192 dummy tokens)."""

    class _DeviceLike:
        caches: dict = {}  # noqa: RUF012 - no per-step stream, like DeviceCacheView
        resets = 0

        def reset_counters(self):
            self.resets += 1

    layers = {l: _Layer() for l in plan.layers}
    dev = _DeviceLike()
    core = WorkerCore(plan, layers, AccountingResidency(plan.core_sets(), 1, "test"), 0, {}, cache=dev)
    ids = torch.tensor([[0, 1], [1, 5]])
    for m in layers.values():
        counters.record_torch(m, ids, torch.ones_like(ids, dtype=torch.float32))
    core.reset_stats()
    assert dev.resets == 1
    assert all(sum(c["counts"]) == 0 for c in core.read_counters(False).values())
    core.zero_counters()  # what a swap's stats read does: the router counters only
    assert dev.resets == 1
