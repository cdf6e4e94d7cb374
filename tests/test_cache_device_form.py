"""Accounting mode runs the CUDA device's policy (issue 17, "Accounting mode on CPU"): the mapping
--reap-cache x --reap-cache-seed -> simulator policy, the tail slots per layer by the device's own
rule (CacheConfig.split after cache_config_for, the code CUDA runs), and the pinned form
``core+dlfu`` stepped by accounting (LayerCache with ``device_tail``) equal to the device's state
machine (residency.device_cache.DeviceCache on CPU tensors) step by step, swaps included."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from reap_swap.cache.accounting import NO_DEVICE_LRU, CacheAccounting, accounting_policy
from reap_swap.cache.replay import simulate
from reap_swap.cache.trace import load_trace
from reap_swap.config.settings import Settings
from reap_swap.engine.residency.accounting import AccountingResidency
from reap_swap.engine.worker_core import WorkerCore
from reap_swap.plan.document import load_plan

torch = pytest.importorskip("torch")

from reap_swap.engine.device_cache.layer import DeviceCache, step_counts  # noqa: E402
from reap_swap.engine.device_cache.serving import cache_config_for  # noqa: E402

PLAN = "plans/reap-mini-moe.plan.json"
TRACE = "data/traces/mini-moe-heldout.npz"
# the device's counters and the simulator's LayerCounts share these names
SAME = ("steps", "selections", "selection_hits", "experts", "expert_hits", "admitted", "bypassed")


@pytest.fixture(scope="module")
def plan():
    return load_plan(PLAN)


def test_mapping_is_the_devices():
    assert accounting_policy("lfu") == ("core+dlfu", None)
    assert accounting_policy("lfu", "pinned") == ("core+dlfu", None)
    assert accounting_policy("lfu", "seeded") == ("dlfu-seeded", None)
    assert accounting_policy("lru", "pinned") == ("lru-seeded", NO_DEVICE_LRU)
    assert accounting_policy("lru", "seeded") == ("lru-seeded", NO_DEVICE_LRU)
    # the device refuses lru by name: the note is true of the CUDA shell
    lru = Settings(cache="lru", cache_slots="auto", cache_device="on")
    assert "lfu (dlfu) only" in cache_config_for(lru, None)[1]


def test_status_names_the_policy_and_the_lru_gap(plan):
    layers = {l: 16 for l in plan.layers}
    st = CacheAccounting.build(plan, "lfu", "auto", layers, {}, top_k=2).status()
    assert st["policy"] == st["device_policy"] == "core+dlfu" and "note" not in st
    assert {v["pinned"] for v in st["layers"].values()} >= {4, 8}  # the plan core is pinned
    assert all(v["tail_slots"] == 2 for v in st["layers"].values())  # (32 - 24) // 4
    st = CacheAccounting.build(plan, "lru", "auto", layers, {}, top_k=2).status()
    assert st["policy"] == "lru-seeded" and st["device_policy"] is None and st["note"] == NO_DEVICE_LRU


def _fake_plan(budget_slots: int, cores: dict[int, int], experts: int = 16):
    layers = {l: SimpleNamespace(core=frozenset(range(n)), num_experts=experts) for l, n in cores.items()}
    return SimpleNamespace(layers=layers, swappable_budget_bytes=budget_slots * 100 + 7, per_expert_bytes=100)


CASES = [
    (62, {0: 4, 1: 4, 2: 4, 3: 4}),  # tests/e2e's tiny MoE plan
    (32, {0: 8, 1: 7, 2: 5, 3: 4}),  # the mini MoE plan
    (24, {0: 8, 1: 7, 2: 5, 3: 4}),  # every pooled slot pinned
    (27, {0: 8, 1: 7, 2: 5, 3: 4}),  # 3 beyond the core over 4 layers
    (40, {0: 14, 1: 2, 2: 9}),  # core + tail above E on layer 0
]


@pytest.mark.parametrize("budget, cores", CASES)
@pytest.mark.parametrize("setting", ["auto", 0, 1, 3, 4, 6, 10, 13, 30, 48, 200])
def test_tail_slots_are_the_devices(budget, cores, setting):
    """Per layer: CacheConfig.split on the pool of the plan budget (what CUDA lends) == accounting."""
    plan = _fake_plan(budget, cores)
    s = Settings(cache="lfu", cache_slots=setting, cache_device="on", cache_seed="pinned")
    cfg, why = cache_config_for(s, plan)
    assert why is None and not cfg.seed_core
    cfg.split(budget, len(plan.layers), {l: p.core for l, p in plan.layers.items()})
    acc = CacheAccounting.build(plan, "lfu", setting, {l: 16 for l in cores}, {}, top_k=1)
    if cfg.refusal:
        assert acc.reason is not None and acc.reason.startswith(cfg.refusal), (acc.reason, cfg.refusal)
        assert not acc.caches
        return
    assert acc.reason is None and acc.policy == "core+dlfu"
    for l, n in cores.items():
        cache = acc.caches[l]
        assert cache.device_tail == cfg.slots_of(l)  # the slot units the device lends this layer
        assert acc.slots[l] == min(16, n + cfg.slots_of(l))
        assert cache.pinned == plan.layers[l].core and cache.resident == cache.pinned


def _device(plan, layer, tail, device="cpu"):
    d = DeviceCache(plan.layers[layer].num_experts, tail, device, 0.8)
    d.set_pinned(plan.layers[layer].core)  # engage(): the core in its own units, the tail empty
    return d


def _check_equal(acc, devs, where):
    for l, d in devs.items():
        cache, c = acc.caches[l], d.read_counters()
        slots, pinned = d.resident_experts()
        assert cache.resident == slots | pinned and cache.pinned == pinned, (where, l)
        got = cache.counts
        assert {k: getattr(got, k) for k in SAME} == {k: c[k] for k in SAME}, (where, l)
        assert acc.evictions(l) == c["evicted"], (where, l)
        assert got.read_through_steps == c["read_through_steps"], (where, l)


def torch_step(d, ids):
    d.step(step_counts(ids, d.num_experts))


def drive(
    plan,
    tail,
    steps,
    seed,
    top_k=2,
    step_fn=torch_step,
    device="cpu",
    make_pin=None,
    wide=24,
    cache_device="off",
):
    """Random skewed routing (every 7th step up to ``wide`` tokens: wider than the slots) and a
    swap every 40 steps (a random set per layer, every other one the core back): accounting's
    core+dlfu (``make_pin(acc)``: how a swap reaches it, default acc.pin) and one device cache
    per layer (``step_fn``: the torch ops or the served Triton step) must agree after every step on
    the resident and pinned sets and every counter. Returns the CacheAccounting."""
    rng = np.random.default_rng(seed)
    layers = {l: p.num_experts for l, p in plan.layers.items()}
    e = max(layers.values())
    acc = CacheAccounting.build(
        plan, "lfu", tail * len(layers), layers, {}, top_k=top_k, cache_device=cache_device
    )
    assert acc.policy == "core+dlfu" and all(c.device_tail == tail for c in acc.caches.values())
    devs = {l: _device(plan, l, tail, device) for l in plan.layers}
    pin = make_pin(acc) if make_pin else acc.pin
    weights = np.linspace(3.0, 0.2, e)
    for t in range(steps):
        if t % 40 == 20:
            sets = {
                l: sorted(plan.layers[l].core)
                if t % 80 == 60
                else sorted(int(x) for x in rng.choice(e, int(rng.integers(1, e // 2 + 1)), replace=False))
                for l in plan.layers
            }
            pin(sets)
            for l, d in devs.items():  # cuda_backend.apply -> device_cache_serving.on_swap
                d.set_pinned(sets[l])
        tokens = int(rng.integers(1, 9 if t % 7 else wide + 1))
        ids = np.stack(
            [rng.choice(e, top_k, replace=False, p=weights / weights.sum()) for _ in range(tokens)]
        )
        ids = torch.tensor(ids, dtype=torch.int32)
        for d in devs.values():
            step_fn(d, ids.to(device))
        rows = step_counts(ids, e).numpy()
        acc.step({l: rows for l in plan.layers}, t % 9 == 0)
        _check_equal(acc, devs, t)
    tot = acc.totals()
    assert tot["misses"] > 0 and tot["promotions"] > 0 and tot["evictions"] > 0
    assert tot["read_through_steps"] > 0 and sum(c.counts.prefetched for c in acc.caches.values()) > 0
    return acc


@pytest.mark.parametrize("tail", [1, 2, 5, 8])  # 8: core + tail = E on layer 0
def test_device_form_equals_the_device_step_by_step_with_swaps(plan, tail):
    """The swaps go through WorkerCore.apply (which pins a changing set), as on a server, with
    --reap-cache-device on: the pool is the whole model's 64 experts (the mini plan's 32 could not
    lend tails 5 and 8 beside its 24-expert core, nor hold the random sets of up to 32 next to
    them: the swap table keeps 64 - 4 x tail >= 32, every swap fits)."""
    from reap_swap.engine import wire

    plan = dataclasses.replace(plan, swappable_budget_bytes=64 * plan.per_expert_bytes)

    def make_pin(acc):
        core = WorkerCore(plan, {}, AccountingResidency(plan.core_sets(), 1, "t"), 0, {}, cache=acc)

        def pin(sets):
            reply = core.apply({"resident": wire.encode_resident_sets(sets)})
            assert "error" not in reply, reply

        return pin

    acc = drive(plan, tail, 240, seed=tail, make_pin=make_pin, cache_device="on")
    assert acc.swap_slots == 64 - 4 * tail


def test_accounting_equals_simulate_core_dlfu_on_the_trace(plan):
    """Accounting's slots are the budget `simulate --policy core+dlfu` needs: core + layers x N//layers."""
    t = load_trace(TRACE)
    acc = CacheAccounting.build(plan, "lfu", 10, {l: 16 for l in t.layers}, {}, top_k=2)
    counts = {l: t.step_counts(l) for l in t.layers}
    starts = {int(s) for s in t.request_first_steps()}
    for i in range(t.num_steps):
        acc.step({l: counts[l][i] for l in t.layers}, i in starts)
    core = sum(len(plan.layers[l].core) for l in t.layers)
    row = simulate(t, plan, [f"{(core + 8) * t.per_expert_bytes}B"], ["core+dlfu"])["rows"][0]
    assert {int(k): v for k, v in row["slots"].items()} == acc.slots
    for l, sim in row["layers"].items():
        got = acc.caches[int(l)].counts.to_dict(t.per_expert_bytes)
        assert {k: got[k] for k in (*SAME, "read_through_steps")} == {
            k: sim[k] for k in (*SAME, "read_through_steps")
        }, l
    assert acc.totals()["misses"] == row["totals"]["selection_misses"] > 0
