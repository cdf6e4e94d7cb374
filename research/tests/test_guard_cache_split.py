"""gpu_guards' cache arm through the engine's own split (CPU, no GPU): the tail plan's pool, the
settings' CacheConfig, and CacheConfig.split keep every expert for the swap table (the pinned core)
and lend exactly N per layer -- so on the H200 the cache engages instead of run 12's "0 pool slot(s)
beyond the pinned set". The seeded variant: every pool slot is a cache slot, E per layer."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from harness_modules import load_script

from reap_swap.config.settings import Settings
from reap_swap.engine.device_cache.serving import cache_config_for
from reap_swap.plan.document import load_plan
from reap_swap.sizing.model_shape import read_model_shape
from reap_swap.sizing.quant.budget import pool_slots

DATA = Path(__file__).resolve().parents[2] / "tests" / "data"


def _setup(tmp_path, slots_per_layer=2, seed="pinned"):
    guards = load_script("gpu_guards")
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(DATA / "mixtral_tiny_cpu_config.json", model / "config.json")
    cmds = guards.commands(model, tmp_path, 2.0, 0.3, slots_per_layer=slots_per_layer, seed=seed)
    argv = cmds["reap-cache"]
    shape = read_model_shape(model)
    plan = load_plan(argv[argv.index("--reap-plan") + 1], shape)
    settings = Settings(
        cache=argv[argv.index("--reap-cache") + 1],
        cache_device=argv[argv.index("--reap-cache-device") + 1],
        cache_slots=argv[argv.index("--reap-cache-slots") + 1],
        cache_seed=argv[argv.index("--reap-cache-seed") + 1] if "--reap-cache-seed" in argv else "pinned",
    )
    return shape, plan, settings


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_pinned_tail_engages_with_every_expert_pinned(tmp_path, n):
    shape, plan, settings = _setup(tmp_path, slots_per_layer=n)
    cfg, why = cache_config_for(settings, plan)
    assert why is None and cfg.slots_per_layer == n and not cfg.seed_core
    slots = pool_slots(plan.swappable_budget_bytes, plan.per_expert_bytes)
    layers = len(plan.layers)
    assert slots == shape.num_experts * layers + n * layers
    core = {l: p.core for l, p in plan.layers.items()}
    kept = cfg.split(slots, layers, core)
    assert cfg.refusal is None
    assert kept == shape.num_experts * layers == sum(len(c) for c in core.values())  # the core, all pinned


def test_run12_arm_would_still_refuse(tmp_path):
    """The old arm (auto on the budget-1.0 plan) refuses with run 12's reason: the check is real."""
    shape, plan, settings = _setup(tmp_path)
    settings = settings.updated(cache_slots="auto")
    plan = load_plan(tmp_path / "plan-all-resident.json", shape)
    cfg, why = cache_config_for(settings, plan)
    assert why is None
    slots = pool_slots(plan.swappable_budget_bytes, plan.per_expert_bytes)
    cfg.split(slots, len(plan.layers), {l: p.core for l, p in plan.layers.items()})
    assert "0 pool slot(s) beyond the pinned set" in cfg.refusal


def test_seeded_variant_makes_every_slot_a_cache_slot(tmp_path):
    shape, plan, settings = _setup(tmp_path, seed="seeded")
    cfg, why = cache_config_for(settings, plan)
    assert why is None and cfg.seed_core and cfg.auto
    # the launcher's own parse of the arm's argv (no opt-in since run 23) gives the same seeded form
    from reap_swap.config.flags import resolve, split_argv

    argv = load_script("gpu_guards").commands(tmp_path / "model", tmp_path, 2.0, 0.3, seed="seeded")[
        "reap-cache"
    ]
    ns, vllm_argv = split_argv(argv[argv.index("reap_swap.server") + 1 :])
    assert not [a for a in vllm_argv if a.startswith("--reap-")]
    launched = resolve(ns, {}).settings
    assert launched.cache.seed == "seeded" and launched.cache.device == "on"
    assert cache_config_for(launched, plan)[0].seed_core
    slots = pool_slots(plan.swappable_budget_bytes, plan.per_expert_bytes)
    kept = cfg.split(slots, len(plan.layers), {l: p.core for l, p in plan.layers.items()})
    assert cfg.refusal is None and kept == 0
    assert set(cfg.layer_slots.values()) == {shape.num_experts}
