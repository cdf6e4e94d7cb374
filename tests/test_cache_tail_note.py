"""The pinned cache form (core+dlfu) with fewer than 2 x top_k tail slots per layer: one WARNING with
the numbers and the remedy, and ``cache.tail_note`` in /reap/status (accounting mode and the CUDA
device view, the latter on CPU tensors: CPU-tested only)."""

import logging
from types import SimpleNamespace

import pytest

from reap_swap.cache.accounting import CacheAccounting
from reap_swap.config.settings import Settings
from reap_swap.engine import wire
from reap_swap.plan.document import load_plan
from reap_swap.sizing.cache_tail import small_tail_note

torch = pytest.importorskip("torch")

from reap_swap.engine.device_cache.copy import copy_units_torch, unit_view  # noqa: E402
from reap_swap.engine.device_cache.layer import DeviceCache, LayerStep  # noqa: E402
from reap_swap.engine.device_cache.serving import DeviceCacheView, cache_config_for  # noqa: E402

PLAN = "plans/reap-mini-moe.plan.json"  # 4 layers x 16 experts, top-2, pool 32 slots, core 24


def test_the_rule_and_its_numbers():
    assert small_tail_note(16, 8, 192, 0, 12) is None  # 2 x top_k: no note
    assert small_tail_note(0, 8, 144, 144, 12) is None  # no tail at all is a refusal, said apart
    note = small_tail_note(4, 8, 192, 144, 12)
    assert note.startswith("core+dlfu cache tail of 4 slot(s) per layer is below 2 x top_k = 16 (top_k 8;")
    assert "pool 192 slots, 144 of them the pinned plan core, 12 layers" in note
    assert "reap-swap plan --cache-tail auto" in note and "--reap-budget" in note
    assert "NOT yet verified on a GPU" in note


def test_accounting_pinned_form_warns_once_and_shows_the_note(caplog):
    plan = load_plan(PLAN)
    with caplog.at_level(logging.WARNING, logger="reap_swap.cache"):
        acc = CacheAccounting.build(plan, "lfu", "auto", {l: 16 for l in plan.layers}, {}, top_k=2)
    st = acc.status()
    # auto: (32 - 24) // 4 = 2 tail slots per layer < 2 x 2
    assert st["policy"] == "core+dlfu" and st["tail_slots"] == 8
    assert st["tail_note"] == small_tail_note(2, 2, 32, 24, 4)
    assert st["device_policy"] == "core+dlfu" and "note" not in st  # the lru note stays its own
    warned = [r for r in caplog.records if "below 2 x top_k" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    wire.CacheStatus.model_validate(st)
    # a tail of 2 x top_k or more: no note; top-1 routing wants 2
    assert (
        "tail_note"
        not in CacheAccounting.build(plan, "lfu", "auto", {l: 16 for l in plan.layers}, {}, 1).status()
    )


def test_no_note_outside_the_pinned_form_or_when_refused():
    plan = load_plan(PLAN)
    layers = {l: 16 for l in plan.layers}
    seeded = CacheAccounting.build(plan, "lfu", "auto", layers, {}, top_k=2, seed="seeded").status()
    assert seeded["policy"] == "dlfu-seeded" and "tail_note" not in seeded
    lru = CacheAccounting.build(plan, "lru", "auto", layers, {}, top_k=2).status()
    assert "tail_note" not in lru and "note" in lru
    refused = CacheAccounting.build(plan, "lfu", 3, layers, {}, top_k=2).status()
    assert not refused["engaged"] and "tail_note" not in refused
    explicit = CacheAccounting.build(plan, "lfu", 4, layers, {}, top_k=2).status()  # 1 per layer
    assert explicit["tail_note"] == small_tail_note(1, 2, 32, 24, 4)


def _settings(**kw):
    return Settings(**{"cache": "lfu", "cache_slots": "auto", "cache_device": "on", **kw})


DEVICE_PLAN = SimpleNamespace(layers={0: SimpleNamespace(core=[0, 1]), 1: SimpleNamespace(core=[2])})


def _engaged_view(cfg, top_k):
    units = unit_view(torch.zeros(12 * 64, dtype=torch.uint8), 12, 64)
    cfg.caches.layers[0] = LayerStep(DeviceCache(cfg.slots_per_layer, 4, "cpu"), units, copy_units_torch)
    cfg.caches.layers[1] = LayerStep(DeviceCache(cfg.slots_per_layer, 4, "cpu"), units, copy_units_torch)
    return DeviceCacheView(cfg, top_k)


def test_device_view_pinned_form_warns_once_and_shows_the_note(caplog):
    cfg = cache_config_for(_settings(), DEVICE_PLAN)[0]
    assert cfg.split(9, 2, {0: [0, 1], 1: [2]}) == 3 and cfg.slots_per_layer == 3  # (9 - 3) // 2
    assert (cfg.pool_slots, cfg.pinned_slots) == (9, 3)
    with caplog.at_level(logging.WARNING, logger="reap_swap.cache"):
        view = _engaged_view(cfg, top_k=2)
        st = view.status()
        view.status()
    assert st["tail_note"] == small_tail_note(3, 2, 9, 3, 2)
    assert len([r for r in caplog.records if "below 2 x top_k" in r.getMessage()]) == 1
    wire.CacheStatus.model_validate(st)
    big = cache_config_for(_settings(), DEVICE_PLAN)[0]
    big.split(11, 2, {0: [0, 1], 1: [2]})  # 4 per layer = 2 x top_k
    assert "tail_note" not in _engaged_view(big, top_k=2).status()


def test_device_view_no_note_before_the_split_for_seeded_or_refused():
    cfg = cache_config_for(_settings(), DEVICE_PLAN)[0]
    assert DeviceCacheView(cfg, 2).tail_note() is None  # the pool is not split yet
    refused = cache_config_for(_settings(), DEVICE_PLAN)[0]
    refused.split(3, 2, {0: [0, 1], 1: [2]})  # every pooled slot pinned: refused
    assert refused.refusal and DeviceCacheView(refused, 2).tail_note() is None
    seeded = cache_config_for(_settings(cache_seed="seeded"), DEVICE_PLAN)[0]  # served, no opt-in (run 23)
    assert seeded.split(9, 2, {0: [0, 1], 1: [2]}) == 0 and seeded.seed_core and seeded.refusal is None
    assert DeviceCacheView(seeded, 2).tail_note() is None
