"""--reap-cache-seed seeded (engine/device_cache/seeded.py): a per-request swap pinned inside the
seeded device cache's slots, on CPU tensors with a fake range, against accounting mode's
LayerCache (dlfu-seeded + pin) step by step; bytes checked in every slot and every pinned unit."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from reap_swap.cache.device import DLFU  # noqa: E402
from reap_swap.cache.slot_table import PoolCapacityError  # noqa: E402
from reap_swap.cache.stepper import LayerCache  # noqa: E402
from reap_swap.engine.device_cache.layer import DeviceCache, LayerStep  # noqa: E402
from reap_swap.engine.device_cache.seeded import SeededPins, plan_pin  # noqa: E402

E, C, K, B = 16, 6, 2, 8  # experts, cache slots (core + tail), top-k, unit elements


class FakeRange:
    """map_device/map_host/flush_access recorded: unit -> the slot handle it reads (None: host)."""

    def __init__(self):
        self.mapped: dict[int, object] = {}
        self.pending = 0

    def map_device(self, unit, handle, *, defer_access=False):
        self.mapped[unit] = handle
        self.pending += 1

    def map_host(self, unit, *, defer_access=False):
        self.mapped.pop(unit, None)
        self.pending += 1

    def flush_access(self):
        self.pending = 0


class Caches:  # the DeviceCaches surface SeededPins uses
    def __init__(self, step):
        self.layers = {0: step}


def _setup(core, fused=False):
    masters = torch.arange(E * B, dtype=torch.float32).reshape(E, B)
    units = torch.zeros(E + C, B)
    units[:E] = masters
    step = LayerStep(DeviceCache(E, C, "cpu", 0.8), units, step="triton" if fused else "torch")
    step.seed(core)
    rng = FakeRange()
    pins = SeededPins(Caches(step), lambda l: rng, lambda l, s: ("slot", l, s))
    return masters, step, rng, pins


def _device_state(step, pins, rng, masters):
    """The device's resident set, after checking every slot's and every pinned unit's bytes."""
    cache, units = step.cache, step.units
    held = {}
    for s, e in enumerate(cache.slot_expert.tolist()):
        if e >= 0:
            assert s < int(cache.active) and torch.equal(units[E + s], masters[e]), (s, e)
            held[e] = s
    for e, s in pins.pinned.get(0, {}).items():
        assert rng.mapped[e] == ("slot", 0, s) and s >= int(cache.active)
        assert torch.equal(units[E + s], masters[e]), (s, e)  # what the kernel reads through unit e
    assert set(rng.mapped) == set(pins.pinned.get(0, {}))
    pinned = {int(e) for e in torch.nonzero(cache.pinned).flatten().tolist()}
    assert pinned == set(pins.pinned.get(0, {}))
    return frozenset(held) | frozenset(pinned)


def test_seeded_swaps_agree_with_accounting_step_by_step():
    agreement(fused=False)


def agreement(fused: bool) -> None:
    """The seeded device cache (torch step, or the fast Triton step with ``fused``) with swaps
    pinned in its slots vs accounting's LayerCache(dlfu-seeded) + pin: sets and counters per step."""
    core = [1, 3, 5, 7]
    masters, step, rng, pins = _setup(core, fused)
    acc = LayerCache(DLFU("dlfu-seeded", seed=frozenset(core)), 0, E, C)
    g = np.random.default_rng(3)
    swaps = {5: [2, 3], 11: [0, 2, 9, 11], 17: [], 23: [4, 5, 6, 7, 8, 9], 30: [10]}
    for t in range(40):
        if t in swaps:
            acc.pin(swaps[t])
            pins.apply({0: swaps[t]})
        tokens = int(g.integers(1, 4))
        p = np.arange(E, 0, -1, dtype=float) ** 2
        ids = np.stack([g.choice(E, K, replace=False, p=p / p.sum()) for _ in range(tokens)])
        row = np.bincount(ids.reshape(-1), minlength=E)
        acc.step(row, request_start=t in swaps)
        out = step(torch.tensor(ids, dtype=torch.int32))
        assert _device_state(step, pins, rng, masters) == acc.resident, t
        c, a = step.cache.read_counters(), acc.counts
        assert (c["selections"], c["selection_hits"]) == (a.selections, a.selection_hits), t
        assert (c["experts"], c["expert_hits"], c["admitted"]) == (a.experts, a.expert_hits, a.admitted), t
        assert c["read_through_steps"] == a.read_through_steps, t
        table = step.cache.table.tolist()
        assert out.tolist() == [[table[int(e)] for e in r] for r in ids]


def test_yield_keeps_best_scored_and_copies_only_what_moves():
    masters, step, rng, pins = _setup([0, 1, 2, 3])
    step(torch.tensor([[3, 2]], dtype=torch.int32))  # scores: 2, 3 above 0, 1
    pin = plan_pin(step.cache, {}, [0, 9])
    assert pin.active == C - 2 and pin.pinned == {0: 4, 9: 5}
    assert set(pin.tail.values()) == {1, 2, 3}  # 0 leaves the tail (pinned), 1..3 kept, slot 0 free
    copied, admitted = pins.apply({0: [0, 9]})
    assert admitted == 2 and copied == 2 * B * 4  # 0 and 9 into their slots; the kept ones stay put
    _device_state(step, pins, rng, masters)
    pins.apply({0: []})  # back to no swap: the whole C slots are the tail again
    assert int(step.cache.active) == C and not rng.mapped
    assert _device_state(step, pins, rng, masters) >= {2, 3}


def test_wider_than_the_slots_is_refused_before_anything_moves():
    masters, step, rng, pins = _setup([0, 1])
    before = step.cache.slot_expert.clone()
    with pytest.raises(PoolCapacityError) as exc:
        pins.apply({0: list(range(C + 1))})
    assert str(exc.value).startswith("layer 0: a swap set of 7 experts is wider than the layer's 6 cache")
    assert exc.value.needed == C + 1 and exc.value.layer == 0
    assert torch.equal(step.cache.slot_expert, before) and not rng.mapped and not pins.pinned
    with pytest.raises(ValueError):
        pins.apply({0: [E]})


class _Store:  # swap.ExpertStore fake: records what the SlotTable path moved
    bytes_per_expert = 10

    def __init__(self):
        self.calls = []

    def quiesce(self):
        self.calls.append("quiesce")

    def map_host(self, layer, expert):
        self.calls.append(("host", layer, expert))

    def start_copy(self, layer, expert, slot):
        self.calls.append(("copy", layer, expert, slot))
        return None

    def wait_copy(self, token):
        pass

    def map_slot(self, layer, expert, slot):
        self.calls.append(("slot", layer, expert, slot))

    def publish(self):
        pass


def test_cuda_backend_routes_seeded_layers_to_the_cache_and_the_rest_to_the_table():
    """CudaResidency.apply with --reap-cache-seed seeded: cached layers pin in their slots (bytes
    counted), an uncached layer goes through the SlotTable's K slots; resident() answers the core
    before any swap; a swap to the same sets is a no-op; a too-wide set is refused before the
    table moves; dry runs validate both."""
    from types import SimpleNamespace

    from reap_swap.cache.slot_table import SlotTable
    from reap_swap.engine.residency.cuda_backend import CudaResidency

    masters, step, rng, pins = _setup([1, 3])
    pins.core = {0: frozenset({1, 3})}
    layers = {0: SimpleNamespace(num_experts=E), 1: SimpleNamespace(num_experts=E)}
    plan = SimpleNamespace(layers=layers, per_expert_bytes=10)
    st = SimpleNamespace(
        plan=plan, table=SlotTable(2), layers={0: None, 1: None}, swaps=0, bytes_copied_total=0
    )
    store = _Store()
    backend = CudaResidency.over(st, store)
    backend.seeded = pins
    assert backend.resident() == {0: frozenset({1, 3}), 1: frozenset()}
    assert backend.apply({0: [1, 3], 1: []})["bytes_copied"] == 0  # nothing changes: no-op
    with pytest.raises(PoolCapacityError):
        backend.apply({0: list(range(C + 1)), 1: [4]})
    assert not store.calls and not pins.pinned  # refused before the table moved
    dry = backend.apply({0: [2, 3], 1: [4]}, dry_run=True)
    assert dry["admitted"] == 1 and not pins.pinned
    out = backend.apply({0: [2, 3], 1: [4]})
    assert out["bytes_copied"] == 10 + 2 * B * 4 and out["admitted"] == 3  # 4 via the table; 2, 3 pinned
    assert ("copy", 1, 4, 0) in store.calls
    assert backend.resident() == {0: frozenset({2, 3}), 1: frozenset({4})}
    assert _device_state(step, pins, rng, masters) >= {2, 3}
    assert backend.capacity_bytes() == (2 + C) * 10  # K + the seeded layer's C slots


def test_a_change_on_an_uncached_layer_pins_the_cached_ones_too():
    """As accounting's WorkerCore rule: a swap that changes the set anywhere pins every layer, so
    the cached layer's unchanged set is pinned (it stops being evictable) when layer 1 changes."""
    from types import SimpleNamespace

    from reap_swap.cache.slot_table import SlotTable
    from reap_swap.engine.residency.cuda_backend import CudaResidency

    masters, step, rng, pins = _setup([1, 3])
    pins.core = {0: frozenset({1, 3})}
    layers = {0: SimpleNamespace(num_experts=E), 1: SimpleNamespace(num_experts=E)}
    st = SimpleNamespace(
        plan=SimpleNamespace(layers=layers, per_expert_bytes=10),
        table=SlotTable(2),
        layers={0: None, 1: None},
        swaps=0,
        bytes_copied_total=0,
    )
    backend = CudaResidency.over(st, _Store())
    backend.seeded = pins
    backend.apply({0: [1, 3], 1: [4]})
    assert pins.pinned == {0: {1: C - 2, 3: C - 1}} and int(step.cache.active) == C - 2
    _device_state(step, pins, rng, masters)


def test_a_grown_or_shrunk_swap_copies_only_the_experts_that_move():
    """Pins keep their slots while those stay in the pinned range, so a swap that adds one expert to
    the set copies that expert (not the whole set again), and the bytes stay right throughout."""
    masters, step, rng, pins = _setup([0, 1])
    unit = B * 4
    assert pins.apply({0: [2, 3]}) == (2 * unit, 2)  # slots 4, 5
    assert pins.pinned[0] == {2: 4, 3: 5}
    _device_state(step, pins, rng, masters)
    copied, admitted = pins.apply({0: [2, 3, 8]})  # range [3, 6): 2 and 3 stay, 8 takes slot 3
    assert pins.pinned[0] == {2: 4, 3: 5, 8: 3} and admitted == 1
    assert copied == unit  # only expert 8 (slot 3 held no tail expert: the tail kept 0, 1 in 0..2)
    _device_state(step, pins, rng, masters)
    copied, _ = pins.apply({0: [3, 8]})  # range [4, 6): 3 stays in 5, 8 leaves slot 3 for slot 4
    assert pins.pinned[0] == {3: 5, 8: 4} and copied >= unit
    _device_state(step, pins, rng, masters)
