"""Accounting mode's swap capacity is the CUDA server's (issue 17, branch acctail): with the device's
pinned form lent a tail (--reap-cache lfu, --reap-cache-device on), the swap table keeps
K = pool - layers x N and a swap wider than K is refused before anything changes, with CUDA's
numbers and sentence (PoolCapacityError, memory_split.swap_table_refusal); the seeded device refuses a layer's set wider than its C_l slots
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

from reap_swap import wire
from reap_swap.cache_accounting import CacheAccounting
from reap_swap.controller import SwapController
from reap_swap.plan import load_plan
from reap_swap.residency.accounting import AccountingResidency
from reap_swap.residency.device_cache_engine import CacheConfig, swap_table
from reap_swap.residency.slot_table import PoolCapacityError, SlotTable
from reap_swap.routes import api_key_digests, endpoint_plugin
from reap_swap.worker_core import WorkerCore

pytest.importorskip("torch")

from reap_swap.residency.device_cache_api import DeviceCaches  # noqa: E402
from reap_swap.residency.device_cache_serving import cache_config_for  # noqa: E402
from tests import test_cache_device_form as device_form  # noqa: E402

MINI = "plans/reap-mini-moe.plan.json"


def settings(slots, device="on", seed="pinned", unverified=False, cache="lfu"):
    return SimpleNamespace(
        cache=cache, cache_slots=slots, cache_device=device, cache_seed=seed, cache_seed_unverified=unverified
    )


def accounting(plan, s, layers=None):
    layers = layers or {l: p.num_experts for l, p in plan.layers.items()}
    return CacheAccounting.build(
        plan, s.cache, s.cache_slots, layers, {}, top_k=2, seed=s.cache_seed,
        cache_device=s.cache_device, seed_unverified=s.cache_seed_unverified,
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
    """Parity: accounting's K == the CUDA SlotTable's size (CacheConfig.split) for every plan and
    setting where the device lends (pinned; seeded falls back to pinned on CUDA without the opt-in)."""
    plan = fake_plan(budget, cores)
    for seed in ("pinned", "seeded"):
        s = settings(slots, seed=seed)
        acc, k = accounting(plan, s), cuda_swap_slots(plan, s)
        if acc.reason is not None:  # the device refuses the cache: nothing lent, the whole pool
            assert k == budget and acc.swap_slots is None, (acc.reason, k)
            continue
        if seed == "seeded" and acc.swap_slots is None:  # pinned rule refused; dlfu-seeded still runs
            assert k == budget
            continue
        assert acc.swap_slots == k, (seed, acc.swap_slots, k, acc.swap_source)


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

    from reap_swap.counting import counters

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
        n = (32 - k) // 4
        assert str(exc.value) == (
            f"resident set needs {k + 1} expert slots but the swap table has {k} (overflow 1 experts): "
            f"the HBM pool of 32 slots less 4 layers x {n} = {32 - k} lent to the cache tails; "
            "--reap-cache-slots swaps or a smaller N leaves more room for swaps"
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
    """--reap-cache-seed seeded with the opt-in: each layer's C_l (the CUDA split_seeded's), a set
    wider than C_l refused naming the layer with the text the device's SeededPins.plan raises
    (real DeviceCache state on CPU tensors), state unchanged; exactly C_l fits."""
    from reap_swap.residency.device_cache import DeviceCache
    from reap_swap.residency.device_cache_seeded import SeededPins

    plan = load_plan(MINI)
    s = settings(4, seed="seeded", unverified=True)
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


def test_seeded_without_opt_in_is_the_pinned_table():
    """CUDA serves the pinned form for seeded without the opt-in (seedfix): K by the pinned rule."""
    plan = load_plan(MINI)
    acc = accounting(plan, settings(4, seed="seeded"))
    assert acc.policy == "dlfu-seeded" and not acc.seeded_swaps and acc.swap_slots == 28
    assert "CUDA serves the pinned form" in acc.swap_source
    with pytest.raises(PoolCapacityError):
        acc.check_swap({l: frozenset(v) for l, v in _with(plan, 5).items()})


def test_refused_swap_is_500_worker_failed_and_state_kept():
    """Over HTTP (routes + controller + fake workers, the tiny e2e plan: pool 62, core 16,
    --reap-cache-slots 10 lends 2 per layer, K = 54): 55+ experts -> 500 worker_failed naming the
    numbers, rolled back, signature and cache unchanged; exactly 54 -> 200."""
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
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "worker_failed" and err["rolled_back"] is True and err["field"] is None
        assert (
            "PoolCapacityError: resident set needs 62 expert slots but the swap table has 54 (overflow 8 "
            "experts): the HBM pool of 62 slots less 4 layers x 2 = 8 lent to the cache tails; "
            "--reap-cache-slots swaps or a smaller N leaves more room for swaps"
        ) in err["message"]
        after = c.get("/reap/status").json()
        assert after["signature"] == before["signature"] == err["signature"]
        assert engine.workers[0].core.cache.status() == cache_before
        # 16 core + 36 (every slice of layers 0-2) + layer 3's 2-expert slice = 54 = K: fits
        fit = dict(every, layer_3=[x.slice_id for x in TINY.layers[3].slices if len(x.experts) == 2])
        r = c.post("/swap_active_set", json={"request_id": "k", "active_set": fit})
        assert r.status_code == 200, r.text
        assert r.json()["validation"]["resident_experts"] == 54


def test_cache_refused_when_the_table_cannot_hold_the_core():
    """New in the shared rule: a lending that leaves the swap table fewer slots than the plan core
    is refused on both (before: accounting ran it; CUDA failed its load on the core swap)."""
    plan = load_plan(MINI)
    acc = accounting(plan, settings(12))
    assert acc.reason.startswith("4 layers x 3 cache slots = 12 leave 20 of the pool's 32 for swaps")
    cfg = CacheConfig(DeviceCaches(decay=0.8, fused=False), 0, slots_setting=12)
    assert cfg.split(32, 4, {l: p.core for l, p in plan.layers.items()}) == 32 and cfg.refusal
    big = dataclasses.replace(plan, swappable_budget_bytes=36 * plan.per_expert_bytes)
    assert accounting(big, settings(12)).swap_slots == 24  # 36 - 12: the core exactly
