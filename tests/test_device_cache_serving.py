"""The device cache's serving shell on CPU tensors: settings -> CacheConfig (default off on CUDA,
lru refused by name, N over layers / auto, seeded served whenever asked and its retired opt-in
ignored), the status and totals in cache_accounting's shape, on_swap after a swap (pinned experts
leave the slots)."""

import logging
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from reap_swap.config.settings import Settings  # noqa: E402
from reap_swap.engine.device_cache.copy import copy_units_torch, unit_view  # noqa: E402
from reap_swap.engine.device_cache.layer import DeviceCache, LayerStep  # noqa: E402
from reap_swap.engine.device_cache.serving import DeviceCacheView, cache_config_for, on_swap  # noqa: E402

PLAN = SimpleNamespace(layers={0: SimpleNamespace(core=[0, 1]), 1: SimpleNamespace(core=[2])})


def _s(**kw):
    return Settings(**{"cache": "lfu", "cache_slots": "auto", "cache_device": "on", **kw})


def test_config_from_settings():
    assert cache_config_for(_s(cache_device="off"), PLAN)[1].startswith("device cache off")
    assert "lfu (dlfu) only" in cache_config_for(_s(cache="lru"), PLAN)[1]
    assert cache_config_for(_s(cache="off"), PLAN) == (None, "--reap-cache off")
    cfg, why = cache_config_for(_s(cache_slots=9), PLAN)
    assert why is None and cfg.slots_per_layer == 4 and not cfg.auto and cfg.caches.step == "triton"
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


def _seeded(**kw):  # --reap-cache-seed seeded (served on CUDA whenever asked since run 23)
    return _s(cache_seed="seeded", **kw)


SEEDED_ENV = {"REAP_PLAN_FILE": "p.json", "REAP_CACHE_SEED": "seeded", "REAP_CACHE_DEVICE": "on"}


def test_seeded_is_served_on_cuda_without_any_opt_in(caplog):
    """Run 23 (H200): two serves of seeded bitwise equal to stock at every logprob, so
    --reap-cache-seed seeded builds the seeded CacheConfig on CUDA whenever asked: no fallback to
    the pinned form, no refusal or UNVERIFIED line in the log, /reap/status cache.seed says so."""
    from reap_swap.config.flags import resolve
    from reap_swap.config.settings import Settings

    assert "cache_seed_unverified" not in Settings.model_fields
    settings = resolve({}, SEEDED_ENV).settings
    assert settings.cache.seed == "seeded"
    with caplog.at_level("DEBUG", logger="reap_swap.cache"):
        cfg, why = cache_config_for(settings, PLAN)
    assert why is None and cfg.seed_core and cfg.auto and cfg.layer_slots == {}
    assert not hasattr(cfg, "seed_refusal")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [
        r.getMessage() for r in caplog.records
    ]
    assert cfg.split(11, 2, {0: [0, 1], 1: [2]}) == 0 and cfg.layer_slots == {0: 6, 1: 5}  # seeded's split
    st = DeviceCacheView(cfg).status()
    assert st["policy"] == "dlfu-seeded" and "whole pool" in st["tail_source"]
    assert st["seed"] == {"requested": "seeded", "served": "seeded"}
    pinned = cache_config_for(_s(cache_seed="pinned"), PLAN)[0]
    assert not pinned.seed_core
    assert DeviceCacheView(pinned).status()["seed"] == {"requested": "pinned", "served": "pinned"}
    default = cache_config_for(resolve({}, {**SEEDED_ENV, "REAP_CACHE_SEED": "pinned"}).settings, PLAN)[0]
    assert not default.seed_core and resolve({}, {"REAP_PLAN_FILE": "p.json"}).settings.cache.seed == "auto"


@pytest.mark.parametrize("value", ["1", "0", ""])
def test_the_retired_seeded_opt_in_variable_is_accepted_ignored_and_warned(caplog, value):
    """REAP_SWAP_UNVERIFIED_SEEDED_CACHE (retired in run 23): no error, a warning naming it and why,
    and the same settings and the same served seeded form as without it."""
    from reap_swap.config.flags import resolve

    env = "REAP_SWAP_UNVERIFIED_SEEDED_CACHE"
    with caplog.at_level("WARNING", logger="reap_swap.config.settings"):
        r = resolve({}, {**SEEDED_ENV, env: value})
    assert r.settings == resolve({}, SEEDED_ENV).settings
    warned = [rec.getMessage() for rec in caplog.records if env in rec.getMessage()]
    assert len(warned) == 1 and "is retired" in warned[0]
    assert "served on CUDA without an opt-in" in warned[0] and "ignored" in warned[0]
    assert "cache_seed_unverified" not in r.sources
    assert cache_config_for(r.settings, PLAN)[0].seed_core


def test_the_retired_seeded_opt_in_flag_is_accepted_ignored_warned_and_kept_from_vllm(caplog):
    from reap_swap.config.flags import RETIRED, resolve, split_argv

    flag = "--reap-unverified-seeded-cache"
    assert "research.md" in RETIRED[flag] and "without an opt-in" in RETIRED[flag]
    argv = [
        "org/m",
        "--reap-plan",
        "p.json",
        "--reap-cache-device",
        "on",
        flag,
        "--reap-cache-seed",
        "seeded",
    ]
    with caplog.at_level("WARNING", logger="reap_swap.config.settings"):
        ns, vllm_argv = split_argv([*argv, "--port", "8000"])
    assert vllm_argv == ["org/m", "--port", "8000"]  # vLLM never sees the retired flag
    warned = [r.getMessage() for r in caplog.records if flag in r.getMessage()]
    assert len(warned) == 1 and "without an opt-in" in warned[0] and "no longer needed" in warned[0]
    settings = resolve(ns, {}).settings
    assert (
        settings
        == resolve({"plan_file": "p.json", "cache_device": "on", "cache_seed": "seeded"}, {}).settings
    )
    assert "cache_seed_unverified" not in settings.to_worker_config()
    cfg, why = cache_config_for(settings, PLAN)
    assert why is None and cfg.seed_core  # seeded, as without the flag
    # with the default (pinned) it is ignored too: the flag never turned seeded on by itself
    assert resolve(split_argv(["--reap-plan", "p.json", flag])[0], {}).settings.cache.seed == "auto"


def test_seeded_config_splits_like_accounting_mode():
    """--reap-cache-seed seeded: per-layer C_l = accounting's cache_tail.layer_slots(core + tail,
    "core+tail"); auto lends the whole pool (K = 0); N is the tail beyond the core; too big refused."""
    from reap_swap.sizing.cache_tail import layer_slots

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
    from reap_swap.cache.slot_table import SlotTable
    from reap_swap.engine.device_cache import lending as dce

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
    from reap_swap.cache.slot_table import SlotTable
    from reap_swap.engine.device_cache import lending as dce

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


def test_a_unit_beyond_w13_and_w2_is_refused_by_name_not_silently(monkeypatch):
    """rehome_plain: a re-homed unit holding more than w13_weight + w2_weight (the slot copy moves
    only those) leaves the layer on the plain engine WITH a refusal in /reap/status, and in the
    seeded form gives its share back to the swap table as any refused layer does."""
    from reap_swap.cache.slot_table import SlotTable
    from reap_swap.engine.device_cache import lending as dce

    cfg = cache_config_for(_seeded(), PLAN)[0]
    k = cfg.split(11, 2, {0: [0, 1], 1: [2]})
    st = SimpleNamespace(table=SlotTable(k), plan=PLAN, pool=SimpleNamespace(num_slots=11))
    w = torch.zeros(4, 2, 2)
    tensors = {"w13_weight": w, "w2_weight": w, "w13_qzeros": w}
    bound = SimpleNamespace(aliases={}, layout=None)
    assert dce.rehome_plain(cfg, st, None, 0, tensors, bound) is None
    assert "w13_qzeros, w13_weight, w2_weight" in cfg.caches.refused[0]
    assert st.table.num_slots == k + 4  # the share (6, capped at the layer's 4 experts) given back

    aside = SimpleNamespace(aliases={}, layout=SimpleNamespace(offset_of=lambda name: 4096))
    assert dce.rehome_plain(cfg, st, None, 1, {"w13_weight": w, "w2_weight": w}, aside) is None
    assert "does not start right after w13_weight" in cfg.caches.refused[1]


def test_a_non_plain_unit_under_a_refused_split_gives_nothing_back():
    """With the whole cache refused (nothing lent), a non-plain layer records the cache's reason and
    the swap table keeps its size."""
    from reap_swap.cache.slot_table import SlotTable
    from reap_swap.engine.device_cache import lending as dce

    cfg = cache_config_for(_seeded(cache_slots=20), PLAN)[0]
    k = cfg.split(11, 2, {0: [0, 1], 1: [2]})
    assert k == 11 and cfg.refusal
    st = SimpleNamespace(table=SlotTable(k), plan=PLAN, pool=SimpleNamespace(num_slots=11))
    w = torch.zeros(4, 2, 2)
    bound = SimpleNamespace(aliases={}, layout=None)
    assert dce.rehome_plain(cfg, st, None, 0, {"w13_weight": w, "w13_qzeros": w}, bound) is None
    assert cfg.caches.refused[0] == cfg.refusal and st.table.num_slots == 11
