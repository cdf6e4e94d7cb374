"""`--reap-cache-slots swaps` (issue 17, "all three"): the launcher turns it into the slot count the
bench's plan-swap+cache arm passes (cache_tail.plan_swap_split), so per-request swaps keep room
beside the cache tail; with `auto` the tail takes everything beyond the core and no swap beyond it
fits (research.md "acctail"). Checked against what accounting mode and the CUDA engine's split
(CacheConfig.split) then do with that count."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from reap_swap.config.flags import resolve, split_argv
from reap_swap.config.settings import Settings, SettingsError
from reap_swap.plan.document import load_plan
from reap_swap.server.launcher import LaunchError, resolve_cache_slots
from reap_swap.sizing.cache_tail import plan_swap_split
from tests.test_cache_device_form import _fake_plan as _fake_layers
from tests.test_cache_swap_capacity import MINI, accounting, cuda_swap_slots

PLAN = {"REAP_PLAN_FILE": "/plans/p.json"}
MINI_SHAPE = SimpleNamespace(top_k=2)  # models/reap-mini-moe: num_experts_per_tok 2


def _fake_plan(budget_slots: int, cores: dict[int, int], experts: int = 16) -> SimpleNamespace:
    """test_cache_device_form's stand-in plan (100-byte experts) with Plan.core_bytes."""
    plan = _fake_layers(budget_slots, cores, experts)
    plan.core_bytes = lambda: sum(cores.values()) * plan.per_expert_bytes
    return plan


def _resolved(argv: list[str], env: dict | None = None) -> Settings:
    ns, rest = split_argv(argv)
    assert rest == []
    return resolve(ns, {**PLAN, **(env or {})}).settings


def test_swaps_is_a_value_of_the_flag_and_the_variable():
    assert _resolved(["--reap-cache-slots", "swaps", "--reap-cache-device", "on"]).cache.slots == "swaps"
    assert _resolved([], {"REAP_CACHE_SLOTS": " Swaps "}).cache.slots == "swaps"
    assert _resolved(["--reap-cache-slots", "12"]).cache.slots == 12
    with pytest.raises(SettingsError, match=r"--reap-cache-slots: .*expected auto, swaps or an integer"):
        _resolved(["--reap-cache-slots", "swap"])


@pytest.mark.parametrize(
    "argv, why",
    [
        (["--reap-cache", "off"], "--reap-cache-slots swaps with --reap-cache off: there is no cache tail"),
        (["--reap-cache-seed", "seeded"], "--reap-cache-slots swaps with --reap-cache-seed seeded"),
        (
            ["--reap-budget", "auto"],
            "--reap-cache-slots swaps with --reap-budget auto: the split is computed",
        ),
    ],
)
def test_swaps_refuses_settings_it_cannot_serve(argv, why):
    with pytest.raises(SettingsError) as exc:
        _resolved(["--reap-cache-slots", "swaps", *argv])
    assert why in str(exc.value)
    with pytest.raises(SettingsError, match="REAP_CACHE_SLOTS swaps"):  # named as the user gave it
        _resolved(argv, {"REAP_CACHE_SLOTS": "swaps"})


def test_the_launcher_resolves_swaps_to_the_bench_split_and_both_residencies_keep_k():
    plan = load_plan(MINI)  # pool 32, core 24, 4 layers, top-2: 2 per layer beyond the core
    split = plan_swap_split(plan, 2)
    assert (split.pool, split.core, split.per_layer, split.kept, split.why) == (32, 24, 1, 28, None)
    settings = resolve_cache_slots(
        Settings(plan_file=MINI, cache_slots="swaps", cache_device="on"), plan, MINI_SHAPE
    )
    assert settings.cache.slots == split.cache_slots == 4
    s = Settings(cache="lfu", cache_slots=settings.cache.slots, cache_device="on", cache_seed="pinned")
    acc = accounting(plan, s)
    assert acc.reason is None and acc.swap_slots == split.kept == cuda_swap_slots(plan, s) == 28
    auto = s.updated(cache_slots="auto")  # what swaps is for: auto leaves K = the core
    assert accounting(plan, auto).swap_slots == cuda_swap_slots(plan, auto) == 24


@pytest.mark.parametrize(
    "budget, cores, top_k, per_layer", [(100, {0: 5, 1: 5}, 8, 16), (62, {0: 4, 1: 4, 2: 4, 3: 4}, 2, 4)]
)
def test_the_tail_is_at_most_two_top_k_and_half_of_what_lies_beyond(budget, cores, top_k, per_layer):
    plan = _fake_plan(budget, cores, experts=64)
    split = plan_swap_split(plan, top_k)
    assert split.per_layer == per_layer and split.kept == budget - per_layer * len(cores)
    s = Settings(cache="lfu", cache_slots=split.cache_slots, cache_device="on", cache_seed="pinned")
    assert accounting(plan, s).swap_slots == cuda_swap_slots(plan, s) == split.kept


def test_no_room_for_both_is_refused_before_the_engine_starts():
    plan = _fake_plan(27, {0: 8, 1: 7, 2: 5, 3: 4})  # 3 beyond the core over 4 layers: 0 per layer
    with pytest.raises(LaunchError, match=r"--reap-cache-slots swaps: the pool's 27 slots leave 0 per layer"):
        resolve_cache_slots(Settings(plan_file=MINI, cache_slots="swaps"), plan, MINI_SHAPE)


@pytest.mark.parametrize("slots", ["auto", 0, 12])
def test_other_values_pass_through(slots):
    settings = Settings(plan_file=MINI, cache_slots=slots)
    assert resolve_cache_slots(settings, load_plan(MINI), MINI_SHAPE) is settings


def test_a_worker_refuses_an_unresolved_swaps():
    with pytest.raises(ValueError, match="reached a worker unresolved"):
        Settings.from_worker_config({"plan_file": MINI, "cache_slots": "swaps"})
    assert Settings.from_worker_config({"plan_file": MINI, "cache_slots": 4}).cache.slots == 4
