"""Accounting mode's swap capacity is the CUDA server's (issue 17, branch acctail): with the device's
pinned form lent a tail (--reap-cache lfu, --reap-cache-device on), the swap table keeps
K = pool - layers x N and a swap wider than K is refused before anything changes, with CUDA's
numbers and sentence (PoolCapacityError, cache_tail.swap_table_refusal); the seeded device (served
on CUDA whenever asked since run 23) refuses a layer's set wider than its C_l slots
(SeededCapacityError, the same text); with the device cache off (CUDA's default) or lru the CUDA
server lends nothing and the whole pool stays the capacity. CPU only: the CUDA side is the pure
code CUDA runs (cache_config_for, CacheConfig.split, SlotTable.plan), no GPU."""

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from reap_fakes import PLAN as TINY
from reap_fakes import FakeEngine

from reap_swap.cache.accounting import CacheAccounting
from reap_swap.cache.slot_table import PoolCapacityError, SlotTable
from reap_swap.config.settings import Settings
from reap_swap.engine import wire
from reap_swap.engine.device_cache.lending import CacheConfig, swap_table
from reap_swap.engine.residency.accounting import AccountingResidency
from reap_swap.engine.worker_core import WorkerCore
from reap_swap.plan.active_set import SwapRequest as SwapRequestModel
from reap_swap.plan.document import load_plan
from reap_swap.server.controller import SwapController
from reap_swap.server.routes import api_key_digests, endpoint_plugin

pytest.importorskip("torch")

from reap_swap.engine.device_cache.api import DeviceCaches  # noqa: E402
from reap_swap.engine.device_cache.serving import cache_config_for  # noqa: E402
from tests import test_cache_device_form as device_form  # noqa: E402

MINI = "plans/reap-mini-moe.plan.json"


def settings(slots, device="on", seed="pinned", cache="lfu"):
    return Settings(cache=cache, cache_slots=slots, cache_device=device, cache_seed=seed)


def accounting(plan, s, layers=None):
    layers = layers or {l: p.num_experts for l, p in plan.layers.items()}
    return CacheAccounting.build(
        plan, s.cache.policy, s.cache.slots, layers, {}, top_k=2, seed=s.cache.seed,
        cache_device=s.cache.device,
    )  # fmt: skip


def cuda_table(plan, s) -> SlotTable:
    """The swap table as the CUDA engine builds it: cache_config_for(settings) then swap_table
    (CacheConfig.split) on the pool of the plan budget (engine._ensure_pool), or the whole pool when
    no cache is configured."""
    pool = int(plan.swappable_budget_bytes) // int(plan.per_expert_bytes)
    cfg, _why = cache_config_for(s, plan)
    return swap_table(cfg, pool, plan)


def cuda_swap_slots(plan, s) -> int:
    """K as the CUDA engine gets it (cuda_table)."""
    return cuda_table(plan, s).num_slots


fake_plan = device_form._fake_plan
CASES = [*device_form.CASES, (64, {0: 8, 1: 7, 2: 5, 3: 4})]  # + the mini model's every expert


@pytest.mark.parametrize("budget, cores", CASES)
@pytest.mark.parametrize("slots", ["auto", 0, 1, 3, 4, 6, 8, 10, 13, 30, 40, 48, 200])
def test_swap_slots_are_the_cuda_tables(budget, cores, slots):
    """Parity, pinned form: accounting's K == the CUDA SlotTable's size (CacheConfig.split) for
    every plan and setting where the device lends."""
    plan = fake_plan(budget, cores)
    s = settings(slots)
    acc, k = accounting(plan, s), cuda_swap_slots(plan, s)
    if acc.reason is not None:  # the device refuses the cache: nothing lent, the whole pool
        assert k == budget and acc.swap_slots is None, (acc.reason, k)
        return
    assert acc.swap_slots == k and not acc.seeded_swaps, (acc.swap_slots, k, acc.swap_source)


@pytest.mark.parametrize("budget, cores", CASES)
@pytest.mark.parametrize("slots", ["auto", 0, 1, 3, 4, 6, 8, 10, 13, 30, 40, 48, 200])
def test_seeded_swap_capacity_is_the_cuda_seeded_devices(budget, cores, slots):
    """Parity, seeded form (served on CUDA whenever asked since run 23, no opt-in): where the CUDA
    split (CacheConfig.split_seeded) lends, accounting checks each layer's set against the C_l the
    device lends it (its share, at most the layer's E: rehome_layer), and the swap table keeps only
    the pool's rest; where the device refuses the split (core + tail beyond the pool), nothing is
    lent on either side: the whole pool, no per-layer check."""
    plan = fake_plan(budget, cores)
    s = settings(slots, seed="seeded")
    acc = accounting(plan, s)
    cfg, why = cache_config_for(s, plan)
    assert why is None and cfg.seed_core
    k = swap_table(cfg, budget, plan).num_slots
    assert acc.reason is None and acc.policy == "dlfu-seeded"
    if cfg.refusal:
        assert k == budget and acc.swap_slots is None and not acc.seeded_swaps
        assert (
            acc.swap_source
            == f"the CUDA device cache would be refused ({cfg.refusal}): nothing lent, the whole pool"
        )
        acc.check_swap({l: frozenset(range(16)) for l in plan.layers})  # any set: no per-layer check
        return
    assert acc.seeded_swaps and acc.swap_slots is None, acc.swap_source
    lent = {l: min(n, plan.layers[l].num_experts) for l, n in cfg.layer_slots.items()}
    assert lent == acc.slots, (lent, acc.slots)
    assert k == budget - sum(cfg.layer_slots.values())


@pytest.mark.parametrize("slots", ["auto", 4, 8])
def test_no_lending_no_limit(slots):
    """--reap-cache-device off (CUDA's default) and lru: the CUDA server lends nothing (K = pool)."""
    plan = fake_plan(32, {0: 8, 1: 7, 2: 5, 3: 4})
    for s in (settings(slots, device="off"), settings(slots, cache="lru")):
        acc = accounting(plan, s)
        assert acc.swap_slots is None and not acc.seeded_swaps and cuda_swap_slots(plan, s) == 32
        acc.check_swap({l: frozenset(range(8)) for l in plan.layers})  # 32 experts: the pool, fits
        assert acc.status()["swap_slots"] is None and acc.status()["swap_source"]


def _core(plan, acc, layers=None):
    return WorkerCore(plan, layers or {}, AccountingResidency(plan.core_sets(), 1, "t"), 0, {}, cache=acc)


def _with(plan, extra: int) -> dict:
    """The core plus ``extra`` more experts (lowest ids outside the core, layer by layer)."""
    out = {l: set(p.core) for l, p in plan.layers.items()}
    for l, p in plan.layers.items():
        for e in range(p.num_experts):
            if extra and e not in out[l]:
                out[l].add(e)
                extra -= 1
    assert extra == 0
    return {l: sorted(v) for l, v in out.items()}


@pytest.mark.parametrize("slots, k", [(4, 28), ("auto", 24), (8, 24)])
def test_boundary_through_worker_core(slots, k):
    """The mini plan (pool 32, core 24, 4 layers): a swap of exactly K fits, K + 1 is refused with
    CUDA's numbers and its very sentence (the pool, layers x N lent, the remedy), before anything
    changes (backend, cache, counters), dry runs too."""
    from reap_fakes import counting_layer

    from reap_swap.engine.counting import counters

    plan = load_plan(MINI)
    acc = accounting(plan, settings(slots))
    assert acc.reason is None and acc.swap_slots == k == cuda_swap_slots(plan, settings(slots))
    layers = {l: counting_layer(p.num_experts) for l, p in plan.layers.items()}
    core = _core(plan, acc, layers)
    for m in layers.values():  # router counts a refused swap must not zero
        getattr(m, counters.COUNTS)[3] = 5
    wide = _with(plan, k + 1 - 24)
    before = (core.backend.resident(), acc.status(), core.read_counters(reset=False))
    for dry in (False, True):
        reply = core.apply({"resident": wire.encode_resident_sets(wide), "dry_run": dry, "read_stats": True})
        cuda = cuda_table(plan, settings(slots))  # the CUDA table of K slots, planning the same target
        with pytest.raises(PoolCapacityError) as exc:
            cuda.plan(wide)
        assert reply["error"] == f"rank 0: PoolCapacityError: {exc.value}"
        n, fit = (32 - k) // 4, 32 - k - 1
        lend = (  # fewer than one slot a layer left: only --reap-cache off makes room
            f"lend at most {fit} (--reap-cache-slots N <= {fit})"
            if fit >= 4
            else "serve without the cache (--reap-cache off: it lends at least one slot a layer)"
        )
        assert str(exc.value) == (
            f"resident set needs {k + 1} expert slots but the swap table has {k} (overflow 1 experts): "
            f"the HBM pool of 32 slots less 4 layers x {n} = {32 - k} lent to the cache tails; ask for "
            f"at most {k} experts, {lend}, or serve a plan with a larger budget"
        )
        assert (exc.value.needed, exc.value.capacity) == (k + 1, k)
        assert (core.backend.resident(), acc.status(), core.read_counters(reset=False)) == before
    fits = _with(plan, k - 24)
    reply = core.apply({"resident": wire.encode_resident_sets(fits)})
    assert "error" not in reply, reply
    assert SlotTable(k).plan(fits).admit  # CUDA plans it too
    assert core.backend.resident() == {l: frozenset(v) for l, v in fits.items()}
    if k > 24:  # the swap changed the set: pinned beside the tail, which kept its slots
        assert all(acc.caches[l].pinned == frozenset(fits[l]) for l in plan.layers)


def test_seeded_device_refuses_a_layer_wider_than_its_slots():
    """--reap-cache-seed seeded (no opt-in since run 23): each layer's C_l (the CUDA split_seeded's),
    a set wider than C_l refused naming the layer with the text the device's SeededPins.plan raises
    (real DeviceCache state on CPU tensors), state unchanged; exactly C_l fits."""
    from reap_swap.engine.device_cache.layer import DeviceCache
    from reap_swap.engine.device_cache.seeded import SeededPins

    plan = load_plan(MINI)
    s = settings(4, seed="seeded")
    acc = accounting(plan, s)
    assert acc.policy == "dlfu-seeded" and acc.seeded_swaps and acc.swap_slots is None
    cfg, _ = cache_config_for(s, plan)
    cfg.split(32, 4, {l: p.core for l, p in plan.layers.items()})
    assert cfg.layer_slots == acc.slots  # C_l, the same on both
    layer = min(acc.slots, key=lambda l: acc.slots[l] - len(plan.layers[l].core))
    wide = {l: sorted(p.core) for l, p in plan.layers.items()}
    wide[layer] = list(range(acc.slots[layer] + 1))
    core = _core(plan, acc)
    before = (core.backend.resident(), acc.status())
    reply = core.apply({"resident": wire.encode_resident_sets(wide)})
    caches = SimpleNamespace(
        layers={l: SimpleNamespace(cache=DeviceCache(16, n, "cpu")) for l, n in acc.slots.items()}
    )
    with pytest.raises(PoolCapacityError) as exc:  # the seeded device's own check
        SeededPins(caches, None, None).plan(wide)
    assert reply["error"] == f"rank 0: {type(exc.value).__name__}: {exc.value}"
    assert f"layer {layer}: a swap set of {acc.slots[layer] + 1} experts is wider" in reply["error"]
    assert (core.backend.resident(), acc.status()) == before
    wide[layer] = list(range(acc.slots[layer]))  # exactly C_l: fits on both
    SeededPins(caches, None, None).plan(wide)
    assert "error" not in core.apply({"resident": wire.encode_resident_sets(wide)})


def _fill(plan, slots: dict) -> dict:
    """Each layer's core plus its lowest other experts, ``slots[l]`` in all."""
    out = {}
    for l, p in plan.layers.items():
        rest = [e for e in range(p.num_experts) if e not in p.core]
        out[l] = sorted(p.core) + rest[: slots[l] - len(p.core)]
    return out


def test_seeded_auto_swaps_fill_each_layers_slots_where_the_pinned_table_holds_only_the_core():
    """The mini plan (pool 32, core 24) at --reap-cache-slots auto: the pinned form's table is the
    core (K = 24), so no swap beyond it fits; seeded (its CUDA refusal lifted in run 23) lends every
    pool slot as C_l = {10, 9, 7, 6}, and a swap filling each layer's slots is applied, as CUDA's
    seeded device plans it; one more expert on a layer is refused naming that layer."""
    from reap_swap.engine.device_cache.layer import DeviceCache
    from reap_swap.engine.device_cache.seeded import SeededPins

    plan = load_plan(MINI)
    s = settings("auto", seed="seeded")
    acc = accounting(plan, s)
    assert acc.seeded_swaps and acc.swap_slots is None and "within its cache slots" in acc.swap_source
    cfg, _ = cache_config_for(s, plan)
    assert cfg.split(32, 4, {l: p.core for l, p in plan.layers.items()}) == 0  # every slot lent
    assert cfg.layer_slots == acc.slots == {0: 10, 1: 9, 2: 7, 3: 6}
    full = _fill(plan, acc.slots)  # 32 experts, 8 beyond the core
    pinned = accounting(plan, settings("auto"))
    assert pinned.swap_slots == 24
    with pytest.raises(PoolCapacityError):  # the pinned form: beyond K
        pinned.check_swap({l: frozenset(v) for l, v in full.items()})
    caches = SimpleNamespace(
        layers={l: SimpleNamespace(cache=DeviceCache(16, n, "cpu")) for l, n in cfg.layer_slots.items()}
    )
    SeededPins(caches, None, None).plan(full)  # CUDA's seeded device admits it
    core = _core(plan, acc)
    assert "error" not in core.apply({"resident": wire.encode_resident_sets(full)})
    assert core.backend.resident() == {l: frozenset(v) for l, v in full.items()}
    assert all(acc.caches[l].pinned == frozenset(full[l]) for l in plan.layers)
    wide = _fill(plan, {**acc.slots, 3: 7})
    reply = core.apply({"resident": wire.encode_resident_sets(wide)})
    assert "SeededCapacityError" in reply["error"] and "layer 3: a swap set of 7 experts" in reply["error"]
    assert core.backend.resident() == {l: frozenset(v) for l, v in full.items()}  # unchanged


def test_seeded_split_the_device_refuses_lends_nothing_so_the_whole_pool():
    """--reap-cache-slots 10 seeded on the mini plan: core 24 + 10 > the pool's 32, so the CUDA
    device refuses the split (nothing lent, its swap table the whole pool) and accounting holds
    swaps to the pool only: a layer far beyond its would-be C_l fits."""
    plan = load_plan(MINI)
    s = settings(10, seed="seeded")
    cfg, _ = cache_config_for(s, plan)
    assert cuda_swap_slots(plan, s) == 32
    cfg.split(32, 4, {l: p.core for l, p in plan.layers.items()})
    assert cfg.refusal == "--reap-cache-seed seeded: core + tail = 34 slots > the pool's 32"
    acc = accounting(plan, s)
    assert acc.swap_slots is None and not acc.seeded_swaps and cfg.refusal in acc.swap_source
    wide = _fill(plan, {0: 16, 1: 7, 2: 5, 3: 4})  # layer 0 every expert: 32, the pool
    acc.check_swap({l: frozenset(v) for l, v in wide.items()})
    assert SlotTable(32).plan(wide).admit


def test_refused_swap_is_422_capacity_exceeded_and_state_kept():
    """Over HTTP (routes + controller + fake workers, the tiny e2e plan: pool 62, core 16,
    --reap-cache-slots 10 lends 2 per layer, K = 54): 55+ experts -> 422 capacity_exceeded naming
    active_set and the numbers (500 worker_failed until run 26), signature and cache unchanged,
    not counted as a failed swap; exactly 54 -> 200."""
    engine = FakeEngine(tp_size=1)
    for w in engine.workers:
        w.core.cache = accounting(TINY, settings(10))
        assert w.core.cache.swap_slots == 54 == cuda_swap_slots(TINY, settings(10))
    ctl = SwapController(TINY, engine.rpc, cartridges={})
    asyncio.run(ctl.start())
    app = FastAPI()
    endpoint_plugin().attach_router(app)
    app.state.reap, app.state.reap_api_keys = ctl, api_key_digests(SimpleNamespace(api_key=None))
    every = {f"layer_{l}": [s.slice_id for s in p.slices] for l, p in TINY.layers.items()}
    with TestClient(app) as c:
        before = c.get("/reap/status").json()
        cache_before = engine.workers[0].core.cache.status()
        r = c.post("/swap_active_set", json={"request_id": "wide", "active_set": every})
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["type"] == "capacity_exceeded" and err["field"] == "active_set"
        assert err["needed"] == 62 and err["capacity"] == 54 and err["failed_ranks"] == [0]
        assert err["message"] == (
            "active_set: resident set needs 62 expert slots but the swap table has 54 (overflow 8 "
            "experts): the HBM pool of 62 slots less 4 layers x 2 = 8 lent to the cache tails; ask for "
            "at most 54 experts, serve without the cache (--reap-cache off: it lends at least one slot a "
            "layer), or serve a plan with a larger budget"
        )
        after = c.get("/reap/status").json()
        assert after["signature"] == before["signature"] == err["signature"]
        assert engine.workers[0].core.cache.status() == cache_before
        assert ctl.failed_count == 0  # a refusal, not a failed swap
        # 16 core + 36 (every slice of layers 0-2) + layer 3's 2-expert slice = 54 = K: fits
        fit = dict(every, layer_3=[x.slice_id for x in TINY.layers[3].slices if len(x.experts) == 2])
        r = c.post("/swap_active_set", json={"request_id": "k", "active_set": fit})
        assert r.status_code == 200, r.text
        assert r.json()["validation"]["resident_experts"] == 54


def test_seeded_wide_swap_pins_by_the_plan_rank_and_lists_the_rest():
    """A swap wider than a layer's seeded cache slots is served, not refused (issue 42): the tiny e2e
    plan, --reap-cache-slots 10 seeded (C_l = 7, 7, 6, 6), every slice on every layer -> 200; each
    layer pins its core then the plan's fill order up to C_l, the response lists per layer what was
    left to the cache, and the workers hold exactly the pinned sets. A set that fits is unchanged."""
    engine = FakeEngine(tp_size=1)
    for w in engine.workers:
        w.core.cache = accounting(TINY, settings(10, seed="seeded"))
        assert w.core.cache.seeded_swaps and w.core.cache.slots == {0: 7, 1: 7, 2: 6, 3: 6}
    ctl = SwapController(TINY, engine.rpc, cartridges={})
    asyncio.run(ctl.start())
    assert ctl.pin_capacity == {0: 7, 1: 7, 2: 6, 3: 6}  # read from the workers' cache status
    app = FastAPI()
    endpoint_plugin().attach_router(app)
    app.state.reap, app.state.reap_api_keys = ctl, api_key_digests(SimpleNamespace(api_key=None))
    every = {f"layer_{l}": [s.slice_id for s in p.slices] for l, p in TINY.layers.items()}
    order = TINY.fill_order()[0]
    with TestClient(app) as c:
        assert c.get("/reap/status").json()["cache"]["pin_capacity"] == {"0": 7, "1": 7, "2": 6, "3": 6}
        r = c.post("/swap_active_set", json={"request_id": "wide", "active_set": every})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["unpinned"] == body["validation"]["unpinned"]
        assert body["validation"]["resident_experts"] == 7 + 7 + 6 + 6
        for l, cap in {0: 7, 1: 7, 2: 6, 3: 6}.items():
            core = TINY.core_sets()[l]
            asked = core | {e for sl in TINY.layers[l].slices for e in sl.experts}
            pinned = engine.workers[0].core.cache.caches[l].pinned
            left = body["unpinned"][f"layer_{l}"]
            assert len(pinned) == cap and core <= pinned, (l, pinned)
            assert pinned | set(left) == asked and not pinned & set(left) and left == sorted(left)
            ranked = [e for layer, e in order if layer == l and e in asked - core]
            assert pinned - core == set(ranked[: cap - len(core)]), (l, pinned, ranked)
        fit = {"layer_3": [x.slice_id for x in TINY.layers[3].slices if len(x.experts) == 2]}
        r = c.post("/swap_active_set", json={"request_id": "k", "active_set": fit})
        assert r.status_code == 200, r.text
        assert "unpinned" not in r.json() and r.json()["validation"]["resident_experts"] == 18
        assert engine.workers[0].core.cache.caches[3].pinned == TINY.core_sets()[3] | {12, 13}
        bad = c.post("/swap_active_set", json={"request_id": "b", "active_set": {"layer_0": [999]}})
        assert bad.status_code == 422 and bad.json()["error"]["field"].startswith("active_set")


def test_pin_within_keeps_sets_that_fit_and_cuts_by_rank():
    from reap_swap.plan.active_set import pin_within, resident_sets

    every = {l: frozenset(e for s in p.slices for e in s.experts) for l, p in TINY.layers.items()}
    full = resident_sets(TINY, every)
    same, left = pin_within(TINY, full, {l: len(v) for l, v in full.items()})
    assert same == full and left == {}
    assert pin_within(TINY, full, {}) == (full, {})
    cut, left = pin_within(TINY, full, {0: len(TINY.core_sets()[0])})  # room for the core only
    assert cut[0] == TINY.core_sets()[0] and left[0] == sorted(full[0] - TINY.core_sets()[0])
    assert all(cut[l] == full[l] for l in (1, 2, 3)) and set(left) == {0}


def test_cache_refused_when_the_table_cannot_hold_the_core():
    """New in the shared rule: a lending that leaves the swap table fewer slots than the plan core
    is refused on both (before: accounting ran it; CUDA failed its load on the core swap)."""
    plan = load_plan(MINI)
    acc = accounting(plan, settings(12))
    assert acc.reason.startswith("4 layers x 3 cache slots = 12 leave 20 of the pool's 32 for swaps")
    cfg = CacheConfig(DeviceCaches(decay=0.8), 0, slots_setting=12)
    assert cfg.split(32, 4, {l: p.core for l, p in plan.layers.items()}) == 32 and cfg.refusal
    big = dataclasses.replace(plan, swappable_budget_bytes=36 * plan.per_expert_bytes)
    assert accounting(big, settings(12)).swap_slots == 24  # 36 - 12: the core exactly


def _capacity_ctl(tp_size: int = 2, **kw) -> tuple[SwapController, dict]:
    """A controller over `tp_size` fake ranks whose accounting caches lend 2 per layer (K = 54),
    and the set of every slice (62 experts), too wide for K."""
    engine = FakeEngine(tp_size=tp_size)
    for w in engine.workers:
        w.core.cache = accounting(TINY, settings(10))
    ctl = SwapController(TINY, engine.rpc, cartridges={}, **kw)
    asyncio.run(ctl.start())
    every = {f"layer_{l}": [s.slice_id for s in p.slices] for l, p in TINY.layers.items()}
    return ctl, every


def test_capacity_refusal_only_when_every_failure_is_one():
    from reap_swap.server.swap_failure import CapacityExceeded, capacity_refusal

    def reply(rank, error=None, capacity=None):
        return wire.ApplyReply(
            rank=rank, tp_rank=rank, signature="s", resident_experts=1,
            dry_run=False, error=error, capacity=capacity,
        )  # fmt: skip

    ok = reply(0)
    wide = reply(
        1, "rank 1: PoolCapacityError: resident set needs 9 expert slots",
        {"needed": 9, "capacity": 5, "message": "resident set needs 9 expert slots"},
    )  # fmt: skip
    seeded = reply(
        2, "rank 2: SeededCapacityError: layer 0: a swap set of 8",
        {"needed": 8, "capacity": 4, "message": "layer 0: a swap set of 8"},
    )  # fmt: skip
    broken = reply(3, "rank 3: SwapStepFailed: copy failed")
    assert capacity_refusal([ok]) is None and capacity_refusal([wide, broken]) is None
    assert capacity_refusal([ok, wide]) is None  # rank 0 applied: its set moved, so no 422
    assert capacity_refusal([ok, wide], dry_run=True) is not None  # a dry run moved nothing anywhere
    got = capacity_refusal([seeded, wide])
    assert isinstance(got, CapacityExceeded) and got.field == "active_set"
    assert (got.needed, got.capacity, got.failed_ranks) == (9, 5, [1, 2])  # the lowest rank's pair
    assert str(got) == "active_set: layer 0: a swap set of 8; resident set needs 9 expert slots"


def test_capacity_refused_on_every_tp_rank_changes_nothing_and_is_no_failure():
    from reap_swap.server.swap_failure import CapacityExceeded

    ctl, every = _capacity_ctl(tp_size=2)
    before = ctl.sig
    with pytest.raises(CapacityExceeded) as exc:
        asyncio.run(ctl.swap(SwapRequestModel(request_id="w", active_set=every)))
    assert exc.value.failed_ranks == [0, 1] and (exc.value.needed, exc.value.capacity) == (62, 54)
    assert ctl.sig == before and ctl.failed_count == 0 and ctl.swap_count == 0


def test_capacity_refusal_with_a_failed_rollback_stays_a_500():
    from reap_swap.server.swap_failure import WorkerSwapFailed

    ctl, every = _capacity_ctl(tp_size=1)

    async def failing_rollback(old):
        return False, "rollback broke", []

    ctl.all_workers.rollback = failing_rollback  # the state is unknown: not a clean refusal
    with pytest.raises(WorkerSwapFailed) as exc:
        asyncio.run(ctl.swap(SwapRequestModel(request_id="w", active_set=every)))
    assert exc.value.rolled_back is False and "PoolCapacityError" in str(exc.value)
    assert ctl.failed_count == 1


def test_capacity_refusal_in_validate_only_mode_is_the_same_422():
    from reap_swap.server.swap_failure import CapacityExceeded

    ctl, every = _capacity_ctl(tp_size=1, validate_only=True)
    with pytest.raises(CapacityExceeded, match="but the swap table has 54"):
        asyncio.run(ctl.swap(SwapRequestModel(request_id="w", active_set=every)))


def test_a_capacity_refusal_on_one_pipeline_stage_while_the_other_applied_is_a_500():
    """PP = 2, seeded caches (C_l = 7, 7, 6, 6): layer 0 (stage 0) asked wider than its 7 slots while
    layer 3 (stage 1) changes within its 6: stage 1 applied (set and counters moved), so the answer is
    500 worker_failed after the rollback, not 422 "before anything moved" (review of run 26's change)."""
    from reap_swap.server.swap_failure import WorkerSwapFailed

    engine = FakeEngine(tp_size=1, pp_size=2)
    for w in engine.workers:
        w.core.cache = accounting(TINY, settings(10, seed="seeded"))
    ctl = SwapController(TINY, engine.rpc, cartridges={})
    asyncio.run(ctl.start())
    assert ctl.pin_capacity == {0: 7, 1: 7, 2: 6, 3: 6}  # both stages' layers
    # the workers' own refusal, for a controller that does not know their capacity (the cut below
    # is what it does when it knows: test_seeded_wide_swap_pins_by_the_plan_rank_and_lists_the_rest)
    ctl.pin_capacity = {}
    before = ctl.sig
    wide = {
        "layer_0": [s.slice_id for s in TINY.layers[0].slices],
        "layer_3": [x.slice_id for x in TINY.layers[3].slices if len(x.experts) == 2],
    }
    with pytest.raises(WorkerSwapFailed) as exc:
        asyncio.run(ctl.swap(SwapRequestModel(request_id="w", active_set=wide)))
    assert exc.value.rolled_back is True and exc.value.failed_ranks == [0]
    assert "SeededCapacityError: layer 0" in str(exc.value)
    assert ctl.sig == before and ctl.failed_count == 1
    ctl.validate_only = True  # a dry run moves nothing on either stage: the same set is a 422 there
    from reap_swap.server.swap_failure import CapacityExceeded

    with pytest.raises(CapacityExceeded):
        asyncio.run(ctl.swap(SwapRequestModel(request_id="w", active_set=wide)))
