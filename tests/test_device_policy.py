"""The device cache's policy (residency.device_cache, torch ops on CPU tensors) against the
simulator's ``dlfu`` (cache_policy.device), step by step on the committed traces; the integer
policy against the float ``lfu``; the cache's mechanics (slots, remap, pins, yields)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from reap_swap.cache import simulate  # noqa: E402
from reap_swap.cache.device import DLFU, SCORE_MAX, decay_numerator, update_scores  # noqa: E402
from reap_swap.cache.replay import POLICIES  # noqa: E402
from reap_swap.cache.trace import load_trace  # noqa: E402
from reap_swap.engine.device_cache.layer import DeviceCache, remap_ids, step_counts  # noqa: E402
from reap_swap.engine.device_cache.replay import Variant, compare_layer  # noqa: E402
from reap_swap.plan.document import load_plan  # noqa: E402
from reap_swap.sizing.cache_tail import layer_slots  # noqa: E402

HELDOUT = "data/traces/mini-moe-heldout.npz"
CALIB = "data/traces/mini-moe-calibration.npz"
PLANS = {"0.25": "research-notes/cache-sim/plan-0.25.json", "0.5": "plans/reap-mini-moe.plan.json"}


def test_registered_and_fixed_point_spec():
    assert {"dlfu", "dlfu-seeded", "core+dlfu"} <= set(POLICIES)
    assert decay_numerator(0.8) == 52429 and decay_numerator(1.0) == 1 << 16
    s = update_scores(np.array([0, 1 << 16, SCORE_MAX], dtype=np.int64), np.array([1, 0, 1 << 31]), 52429)
    assert s.tolist() == [1 << 16, 52429, SCORE_MAX]
    with pytest.raises(ValueError):
        DLFU("dlfu", decay=0.0)


def test_dlfu_counts_equal_float_lfu_on_the_mini_trace():
    """Same decisions as the float policy here (the fixed point changes no tie on this trace)."""
    trace = load_trace(HELDOUT)
    rep = simulate(
        trace, load_plan(PLANS["0.5"]), ["0.5"], ["lfu-seeded", "dlfu-seeded", "core+lfu", "core+dlfu"]
    )
    t = {r["policy"]: r["totals"] for r in rep["rows"]}
    for a, b in (("lfu-seeded", "dlfu-seeded"), ("core+lfu", "core+dlfu")):
        assert t[a]["expert_misses"] == t[b]["expert_misses"] and t[a]["admitted"] == t[b]["admitted"]


def _slots(trace, plan, budget):
    total = int(float(budget) * len(trace.layers) * trace.num_experts)
    core = {l: plan.layers[l].core for l in trace.layers}
    return layer_slots(total, trace.layers, core, "core+tail", trace.num_experts)[0], core


@pytest.mark.parametrize("budget", ["0.25", "0.5"])
@pytest.mark.parametrize("policy", ["dlfu", "dlfu-seeded", "core+dlfu"])
def test_device_step_equals_simulator_every_step(budget, policy):
    trace = load_trace(HELDOUT)
    slots, core = _slots(trace, load_plan(PLANS[budget]), budget)
    for layer in trace.layers:
        got = compare_layer(trace, layer, Variant.of(policy, frozenset(core[layer])), slots[layer])
        assert got["steps"] == trace.num_steps and got["admitted"] > 0


def test_device_step_equals_simulator_other_trace_and_decay():
    trace = load_trace(CALIB)
    for layer, cap in ((0, 3), (3, 9)):
        compare_layer(trace, layer, Variant.of("dlfu", frozenset()), cap, decay=0.5)


def test_slots_remap_and_copy_list():
    c = DeviceCache(8, 3, "cpu")
    ids = torch.tensor([[1, 5], [5, 7]], dtype=torch.int32)
    table = c.step(step_counts(ids, 8))
    assert c.slot_expert.tolist() == [1, 5, 7] and c.copy_expert.tolist() == [1, 5, 7]
    assert remap_ids(ids, table).tolist() == [[8, 9], [9, 10]] and remap_ids(ids, table).dtype == torch.int32
    # next step needs 2 and 5: 5 stays (hit), 2 is admitted where 1 or 7 was (lower score: 1 and 7
    # tie at one selection; the lower id ranks higher, so 7 goes), nothing the step needs is evicted
    c.step(step_counts(torch.tensor([[2, 5]]), 8))
    assert c.slot_expert.tolist() == [1, 5, 2] and c.copy_expert.tolist() == [-1, -1, 2]
    r = c.read_counters()
    assert (r["experts"], r["expert_hits"], r["admitted"], r["evicted"]) == (5, 1, 4, 1)


def test_padding_rows_are_not_counted_and_ids_outside_stay():
    c = DeviceCache(4, 2, "cpu")
    ids = torch.tensor([[0, 1], [2, 3]])
    table = c.step(step_counts(ids, 4, valid_rows=torch.tensor([True, False])))
    assert c.resident_experts()[0] == {0, 1}
    assert remap_ids(torch.tensor([[0, 3, -1]]), table).tolist() == [[4, 3, -1]]


def test_read_through_when_the_step_is_wider_than_the_free_slots():
    c = DeviceCache(8, 2, "cpu")
    c.step(step_counts(torch.tensor([[0, 1, 2, 3]]), 8))
    r = c.read_counters()
    assert r["read_through_steps"] == 1 and r["admitted"] == 2 and r["bypassed"] == 2
    assert c.resident_experts()[0] == {0, 1}  # equal scores: the lowest ids win the slots


def test_a_swap_pins_its_set_and_the_tail_yields():
    c = DeviceCache(8, 4, "cpu")
    c.seed([0, 1, 2, 3])
    emptied = c.set_pinned({1, 6}, active_slots=2)  # 1 is now in its own unit; the tail shrinks to 2
    assert sorted(emptied) == [1, 2, 3]
    slots, pinned = c.resident_experts()
    assert slots == {0} and pinned == {1, 6}
    table = c.step(step_counts(torch.tensor([[1, 6], [4, 5]]), 8))
    assert table[1] == 1 and table[6] == 6  # pinned: read in their own units, never cached
    # the step routed 4 and 5: both outrank the seeded, never-routed 0, which is evicted
    assert c.slot_expert.tolist() == [4, 5, -1, -1]  # slots beyond the active tail stay empty
    r = c.read_counters()
    assert (r["expert_hits"], r["admitted"], r["evicted"], r["read_through_steps"]) == (2, 2, 1, 0)


def test_seed_and_set_pinned_refuse_bad_input():
    c = DeviceCache(4, 1, "cpu")
    with pytest.raises(ValueError, match="no free slot"):
        c.seed([0, 1])
    with pytest.raises(ValueError, match="active_slots"):
        c.set_pinned([], active_slots=5)
    with pytest.raises(ValueError, match="outside"):
        c.set_pinned([4])


@pytest.mark.parametrize("compiled", [False, True])
def test_layer_step_chain_is_bitwise_equal_on_a_toy_kernel(compiled):
    """step -> copy -> remap -> a kernel over E + N units, on CPU: the slot units hold the bytes
    of the experts the remapped ids name, so a toy MoE gives bitwise the stock result."""
    from reap_swap.engine.device_cache.copy import copy_units_torch, unit_view
    from reap_swap.engine.device_cache.layer import LayerStep

    E, N, H = 12, 4, 16
    gen = torch.Generator().manual_seed(1)
    raw = torch.zeros((E + N) * H * H * 4, dtype=torch.uint8)
    w = raw.view(torch.float32).view(E + N, H, H)
    w[:E] = torch.randn(E, H, H, generator=gen)
    stock = w[:E].clone()
    units = unit_view(raw, E + N, H * H * 4)
    layer = LayerStep(
        DeviceCache(E, N, "cpu"), units, copy_units_torch, step="compiled" if compiled else "torch"
    )
    for t in range(60):
        rows = 1 + t % 5
        ids = torch.multinomial(torch.linspace(1, 3, E), 2 * rows, generator=gen).view(rows, 2)
        x = torch.randn(rows, H, generator=gen)
        got = torch.einsum("rkij,rj->ri", w[layer(ids)], x)
        want = torch.einsum("rkij,rj->ri", stock[ids], x)
        assert torch.equal(got, want), t
    r = layer.cache.read_counters()
    assert r["admitted"] > N and r["evicted"] > 0 and r["expert_hits"] > 0 and r["read_through_steps"] > 0


def test_the_step_compiles_whole_and_equals_eager():
    """torch.compile(fullgraph=True) takes the step without a graph break (the fused candidate
    that research/gpu/bench_device_cache.py times on the GPU) and gives the same state and ids."""

    def one(cache, ids):
        return remap_ids(ids, cache.step(step_counts(ids, cache.num_experts)))

    gen = torch.Generator().manual_seed(0)
    compiled, eager = DeviceCache(32, 8, "cpu"), DeviceCache(32, 8, "cpu")
    fn = torch.compile(one, dynamic=False, fullgraph=True)
    for _ in range(20):
        ids = torch.topk(torch.randn(4, 32, generator=gen) + torch.linspace(3, 0, 32), 4).indices
        assert torch.equal(fn(compiled, ids), one(eager, ids))
        assert all(
            torch.equal(a, b) for a, b in zip(compiled.state_tensors(), eager.state_tensors(), strict=True)
        )
