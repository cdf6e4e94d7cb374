"""The device cache's serving shell on CPU tensors: settings -> CacheConfig (default off on CUDA,
lru refused by name, N over layers / auto), the status and totals in cache_accounting's shape,
on_swap after a swap (pinned experts leave the slots)."""

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from reap_swap.residency.device_cache import DeviceCache, LayerStep  # noqa: E402
from reap_swap.residency.device_cache_copy import copy_units_torch, unit_view  # noqa: E402
from reap_swap.residency.device_cache_serving import (  # noqa: E402
    DeviceCacheView,
    cache_config_for,
    on_swap,
)

PLAN = SimpleNamespace(layers={0: SimpleNamespace(core=[0, 1]), 1: SimpleNamespace(core=[2])})


def _s(**kw):
    return SimpleNamespace(**{"cache": "lfu", "cache_slots": "auto", "cache_device": "on", **kw})


def test_config_from_settings():
    assert cache_config_for(_s(cache_device="off"), PLAN)[1].startswith("device cache off")
    assert "lfu (dlfu) only" in cache_config_for(_s(cache="lru"), PLAN)[1]
    assert cache_config_for(_s(cache="off"), PLAN) == (None, "--reap-cache off")
    cfg, why = cache_config_for(_s(cache_slots=9), PLAN)
    assert why is None and cfg.slots_per_layer == 4 and not cfg.auto and cfg.caches.fused
    auto = cache_config_for(_s(), PLAN)[0]
    assert auto.split(11, 2, {0: [0, 1], 1: [2]}) == 3 and auto.slots_per_layer == 4  # (11-3)//2
    full = cache_config_for(_s(), PLAN)[0]  # every pooled expert pinned (issue 17's decode guard)
    assert full.split(3, 2, {0: [0, 1], 1: [2]}) == 3 and full.slots_per_layer == 0
    assert full.refusal == (
        "--reap-cache-slots auto: 0 pool slot(s) beyond the pinned set, fewer than one per layer "
        "(2 layers, pool 3)"
    )


def test_view_status_totals_and_on_swap():
    cfg = cache_config_for(_s(cache_slots=8), PLAN)[0]
    units = unit_view(torch.zeros(12 * 64, dtype=torch.uint8), 12, 64)
    cfg.caches.layers[0] = LayerStep(DeviceCache(8, 4, "cpu"), units, copy_units_torch)
    cfg.caches.refuse(1, "test refusal")
    cfg.caches.layers[0](torch.tensor([[1, 5], [5, 7]], dtype=torch.int32))
    view = DeviceCacheView(cfg)
    st = view.status()
    assert (
        st["engaged"]
        and st["mode"] == "device"
        and st["layers"]["1"] == {"engaged": False, "reason": "test refusal"}
    )
    t = view.totals()
    assert (
        t["hits"] + t["misses"] == 4 and t["promotions"] == 3 and st["layers"]["0"]["resident"] == [1, 5, 7]
    )
    on_swap(cfg.caches, {0: [5]})
    assert view.status()["layers"]["0"]["resident"] == [1, 5, 7]  # 5 pinned now, not in a slot
    view.reset_counters()  # the controller's startup reset (vLLM's profile forward ran the step)
    assert all(v == 0 for v in view.totals().values())
    assert view.status()["layers"]["0"]["resident"] == [1, 5, 7]  # the state stays
    assert 5 not in cfg.caches.layers[0].cache.slot_expert.tolist()


def _seeded(**kw):  # --reap-cache-seed seeded with the opt-in (the mechanics tests below)
    return _s(cache_seed="seeded", cache_seed_unverified=True, **kw)


@pytest.mark.parametrize("env", [None, "0", "false"])
def test_seeded_is_refused_on_cuda_without_the_opt_in(caplog, env):
    """Run 12 (H200): seeded served text unequal to stock, so without REAP_SWAP_UNVERIFIED_SEEDED_CACHE=1
    the server serves the pinned form (core+dlfu) and says why in the log and in /reap/status."""
    from reap_swap.residency.device_cache_serving import SEEDED_OPT_IN
    from reap_swap.settings import resolve

    environ = {"REAP_PLAN_FILE": "p.json", "REAP_CACHE_SEED": "seeded", "REAP_CACHE_DEVICE": "on"}
    if env is not None:
        environ[SEEDED_OPT_IN] = env
    settings = resolve({}, environ).settings
    assert settings.cache_seed == "seeded" and not settings.cache_seed_unverified
    with caplog.at_level("ERROR", logger="reap_swap.cache"):
        cfg, why = cache_config_for(settings, PLAN)
    assert why is None and not cfg.seed_core and cfg.layer_slots is None and cfg.auto  # pinned form
    assert "refused on CUDA" in cfg.seed_refusal and "run 12" in cfg.seed_refusal
    assert SEEDED_OPT_IN in cfg.seed_refusal and "seedfix" in cfg.seed_refusal
    assert any("refused on CUDA" in r.getMessage() for r in caplog.records)
    assert cfg.split(11, 2, {0: [0, 1], 1: [2]}) == 3 and cfg.slots_per_layer == 4  # as pinned auto
    st = DeviceCacheView(cfg).status()
    assert st["policy"] == "core+dlfu"
    assert st["seed"] == {"requested": "seeded", "served": "pinned", "refused": cfg.seed_refusal}
    pinned = cache_config_for(_s(cache_seed="pinned"), PLAN)[0]
    assert pinned.seed_refusal is None
    assert DeviceCacheView(pinned).status()["seed"] == {"requested": "pinned", "served": "pinned"}


@pytest.mark.parametrize("how", ["env", "flag"])
def test_seeded_opt_in_serves_seeded_and_says_unverified(how):
    from reap_swap.settings import resolve

    environ = {"REAP_PLAN_FILE": "p.json", "REAP_CACHE_SEED": "seeded", "REAP_CACHE_DEVICE": "on"}
    if how == "env":
        settings = resolve({}, {**environ, "REAP_SWAP_UNVERIFIED_SEEDED_CACHE": "1"}).settings
    else:
        settings = resolve({"cache_seed_unverified": True}, environ).settings
    assert settings.cache_seed_unverified
    cfg, why = cache_config_for(settings, PLAN)
    assert why is None and cfg.seed_core and cfg.seed_refusal is None
    seed = DeviceCacheView(cfg).status()["seed"]
    assert seed == {"requested": "seeded", "served": "seeded", "unverified": True}


def test_seeded_config_splits_like_accounting_mode():
    """--reap-cache-seed seeded: per-layer C_l = accounting's replay.layer_slots(core + tail,
    "core+tail"); auto lends the whole pool (K = 0); N is the tail beyond the core; too big refused."""
    from reap_swap.cache_policy.replay import layer_slots

    core = {0: [0, 1], 1: [2]}
    auto = cache_config_for(_seeded(), PLAN)[0]
    assert auto.seed_core and auto.split(11, 2, core) == 0 and auto.refusal is None
    fz = {l: frozenset(c) for l, c in core.items()}
    assert auto.layer_slots == layer_slots(11, [0, 1], fz, "core+tail", 99)[0] == {0: 6, 1: 5}
    assert auto.slots_of(0) == 6 and auto.slots_of(1) == 5
    n = cache_config_for(_seeded(cache_slots=4), PLAN)[0]
    assert n.split(11, 2, core) == 4 and n.layer_slots == {0: 4, 1: 3}  # core 3 + tail 4 of 11
    big = cache_config_for(_seeded(cache_slots=20), PLAN)[0]
    assert big.split(11, 2, core) == 11 and "23 slots > the pool's 11" in big.refusal
    pinned = cache_config_for(_s(cache_seed="pinned"), PLAN)[0]
    assert not pinned.seed_core and pinned.layer_slots is None  # the default: today's core+dlfu
    view = DeviceCacheView(auto)
    assert view.status()["policy"] == "dlfu-seeded" and "whole pool" in view.status()["tail_source"]


def test_seeded_refused_layers_before_any_lending_give_their_slots_back(monkeypatch):
    """A layer the cache refuses under seeded (e.g. an unsupported kernel) needs its core pinned by
    the swap table: while nothing is lent yet its share [K, K + C_l) is returned to the table."""
    from reap_swap.residency import device_cache_engine as dce
    from reap_swap.residency.slot_table import SlotTable

    cfg = cache_config_for(_seeded(), PLAN)[0]
    k = cfg.split(11, 2, {0: [0, 1], 1: [2]})
    st = SimpleNamespace(table=SlotTable(k), plan=PLAN, pool=SimpleNamespace(num_slots=11))
    monkeypatch.setattr(dce.moe_cache, "cache_refusal", lambda layer: "unsupported (test)")
    assert dce.rehome_layer(cfg, st, None, 0, None, None, 64) is None
    assert st.table.num_slots == 6 and cfg.caches.refused == {0: "unsupported (test)"}
    assert dce.rehome_layer(cfg, st, None, 1, None, None, 64) is None
    assert st.table.num_slots == 11 and not cfg.lent  # every layer refused: the plain engine's pool


def test_seeded_share_is_capped_at_the_layers_experts(monkeypatch):
    """A share beyond the layer's E (accounting's layer_slots caps it too) lends only E slots."""
    from reap_swap.residency import device_cache_engine as dce
    from reap_swap.residency.slot_table import SlotTable

    cfg = cache_config_for(_seeded(), PLAN)[0]
    assert cfg.split(11, 2, {0: [0, 1], 1: [2]}) == 0 and cfg.layer_slots[0] == 6
    st = SimpleNamespace(table=SlotTable(0), plan=PLAN, pool=SimpleNamespace(num_slots=11))
    monkeypatch.setattr(dce.moe_cache, "cache_refusal", lambda layer: None)
    seen = {}
    monkeypatch.setattr(
        dce,
        "rehome_with_slots",
        lambda w13, w2, unit, n, dev, handles: seen.update(n=n) or ("r", "b", ("a", "c"), "x"),
    )
    st.pool.slot_handle, st.device = (lambda s: s), 0
    dce.rehome_layer(cfg, st, None, 0, torch.zeros(4, 2, 2), None, 64)
    assert seen["n"] == 4 and cfg.lent_slots == {0: 4} and cfg.lent == {0: 0}
