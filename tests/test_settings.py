"""REAP settings: precedence env > flag > default, refusals, the flag/argv split."""

from pathlib import Path

import pytest

from reap_swap.config.flags import ENV_NAMES, resolve, split_argv
from reap_swap.config.settings import ROUTER_MASKS_REFUSED, Settings, SettingsError

PLAN = {"REAP_PLAN_FILE": "/plans/p.json"}


def test_defaults_with_only_a_plan():
    r = resolve({}, PLAN)
    assert r.settings == Settings(plan_file="/plans/p.json")
    assert r.settings.max_loaded_cartridges == 8 and r.settings.residency.backend == "auto"
    assert r.sources["plan_file"] == "env" and r.sources["validate_only"] == "default"
    assert r.overrides == []


def test_flags_apply_when_the_environment_is_silent():
    ns, rest = split_argv(
        ["--reap-plan", "a.json", "--reap-validate-only", "--reap-max-loaded-cartridges", "3"]
    )
    r = resolve(ns, {})
    assert rest == []
    assert r.settings.validate_only is True and r.settings.max_loaded_cartridges == 3
    assert str(r.settings.plan_file) == "a.json"
    assert r.sources["max_loaded_cartridges"] == "flag"


def test_environment_beats_flags_and_each_override_is_named():
    ns, _ = split_argv(
        ["--reap-plan", "flag.json", "--reap-max-loaded-cartridges", "3", "--reap-coactivation"]
    )
    r = resolve(ns, {"REAP_PLAN_FILE": "env.json", "REAP_MAX_LOADED_CARTRIDGES": "5"})
    assert str(r.settings.plan_file) == "env.json" and r.settings.max_loaded_cartridges == 5
    assert r.settings.coactivation is True  # flag only
    assert len(r.overrides) == 2
    assert any("REAP_PLAN_FILE" in o and "--reap-plan" in o for o in r.overrides)
    assert any("REAP_MAX_LOADED_CARTRIDGES" in o and "--reap-max-loaded-cartridges" in o for o in r.overrides)


@pytest.mark.parametrize(
    "raw,value",
    [
        ("1", True),
        ("true", True),
        ("yes", True),
        ("on", True),
        ("0", False),
        ("false", False),
        ("no", False),
        ("", False),
    ],
)
def test_boolean_environment_values(raw, value):
    assert resolve({}, {**PLAN, "REAP_SWAP_VALIDATE_ONLY": raw}).settings.validate_only is value


def test_unknown_reap_variable_is_refused_with_the_known_names():
    with pytest.raises(SettingsError) as exc:
        resolve({}, {**PLAN, "REAP_SWAP_VALIDATE_ONYL": "1", "OTHER": "x"})
    msg = str(exc.value)
    assert "REAP_SWAP_VALIDATE_ONYL" in msg and "OTHER" not in msg
    for name in ENV_NAMES:
        assert name in msg


@pytest.mark.parametrize(
    "env,needle",
    [
        ({"REAP_SWAP_VALIDATE_ONLY": "maybe"}, "REAP_SWAP_VALIDATE_ONLY"),
        ({"REAP_MAX_LOADED_CARTRIDGES": "0"}, "REAP_MAX_LOADED_CARTRIDGES"),
        ({"REAP_MAX_LOADED_CARTRIDGES": "many"}, "REAP_MAX_LOADED_CARTRIDGES"),
        ({"REAP_RESIDENCY": "gpu"}, "REAP_RESIDENCY"),
        ({"REAP_SWAP_PUBLISH": "fast"}, "REAP_SWAP_PUBLISH"),
        ({"REAP_SWAP_PUBLISH": "0"}, "REAP_SWAP_PUBLISH"),
        ({"REAP_SWAP_PUBLISH": "-2"}, "REAP_SWAP_PUBLISH"),
    ],
)
def test_bad_values_name_the_variable(env, needle):
    with pytest.raises(SettingsError, match=needle):
        resolve({}, {**PLAN, **env})


def test_bad_flag_value_names_the_flag():
    with pytest.raises(SettingsError, match="--reap-max-loaded-cartridges"):
        resolve({"max_loaded_cartridges": 0}, PLAN)


def test_router_masks_are_refused_by_env_or_flag():
    with pytest.raises(SettingsError) as exc:
        resolve({}, {**PLAN, "REAP_ENABLE_ROUTER_MASKS": "1"})
    assert str(exc.value) == ROUTER_MASKS_REFUSED
    with pytest.raises(SettingsError, match="destroy output quality"):
        resolve(split_argv(["--reap-enable-router-masks"])[0], PLAN)
    assert resolve({}, {**PLAN, "REAP_ENABLE_ROUTER_MASKS": "0"}).settings.router_masks is False


def test_a_plan_is_optional():
    """Without one the launcher writes a bare plan of the model (plan/bare.py; tests/test_server.py)."""
    assert resolve({}, {}).settings.plan_file is None


def test_split_argv_keeps_vllm_arguments_in_order():
    ns, rest = split_argv(
        [
            "org/model",
            "--port",
            "8000",
            "--reap-plan=p.json",
            "--api-key",
            "k",
            "--reap-residency",
            "accounting",
            "--enforce-eager",
        ]
    )
    assert rest == ["org/model", "--port", "8000", "--api-key", "k", "--enforce-eager"]
    assert ns.plan_file == "p.json" and ns.residency == "accounting"


def test_misspelled_reap_flag_is_refused():
    with pytest.raises(SettingsError, match="--reap-plna"):
        split_argv(["--reap-plna", "p.json"])


def test_worker_config_round_trip():
    s = resolve({}, {**PLAN, "REAP_COACTIVATION": "1"}).settings
    cfg = s.to_worker_config(plan_identity="abc")
    assert cfg["plan_identity"] == "abc" and cfg["plan_file"] == "/plans/p.json"
    assert Settings.from_worker_config(cfg) == s


def test_accounting_reason_is_the_one_residency_decision():
    from reap_swap.config.settings import CPU_REASON

    assert Settings().accounting_reason("cuda") is None
    assert Settings(residency="cuda").accounting_reason("cuda") is None
    assert Settings().accounting_reason("cpu") == CPU_REASON
    assert "tpu" in Settings().accounting_reason("tpu")
    assert Settings(masks_only=True).accounting_reason("cuda").startswith("REAP_SWAP_MASKS_ONLY")
    assert Settings(residency="accounting").accounting_reason("cuda") == "REAP_RESIDENCY=accounting"


def test_retired_settings_are_one_table_of_flags_and_variables_each_with_its_reason(caplog):
    import logging

    from reap_swap.config.flags import FLAG_NAMES, RETIRED

    flags = [k for k in RETIRED if k.startswith("--reap-")]
    envs = [k for k in RETIRED if k.startswith("REAP_")]
    assert flags and envs and len(flags) + len(envs) == len(RETIRED)
    assert not set(RETIRED) & (set(ENV_NAMES) | set(FLAG_NAMES))  # retired is not live
    with caplog.at_level(logging.WARNING, logger="reap_swap.config.settings"):
        ns, rest = split_argv(["m", *flags, "--reap-plan", "p.json", *flags, "--port", "1"])
        r = resolve(ns, {e: "1" for e in envs})
    assert rest == ["m", "--port", "1"] and str(r.settings.plan_file) == "p.json"
    messages = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING]
    for name in RETIRED:  # once each, repeated flags included, naming it and why
        assert sum(name in m and RETIRED[name] in m for m in messages) == 1, name
    with pytest.raises(SettingsError, match="REAP_TYPO"):  # the unknown-variable check still holds
        resolve(ns, {**{e: "1" for e in envs}, "REAP_TYPO": "1"})


def test_the_seeded_cache_opt_in_is_retired_since_run_23():
    """REAP_SWAP_UNVERIFIED_SEEDED_CACHE / --reap-unverified-seeded-cache: retired (CUDA serves
    --reap-cache-seed seeded whenever asked since run 23), no setting behind them; a worker config
    that still carries the old field loads without it."""
    from reap_swap.config.flags import FLAG_NAMES, RETIRED

    for name in ("REAP_SWAP_UNVERIFIED_SEEDED_CACHE", "--reap-unverified-seeded-cache"):
        assert name in RETIRED and name not in ENV_NAMES + FLAG_NAMES
        assert "without an opt-in" in RETIRED[name] and "ignored" in RETIRED[name]
    assert "cache_seed_unverified" not in Settings.model_fields
    old = {"plan_file": "p.json", "cache_seed": "seeded", "cache_seed_unverified": True}
    assert Settings.from_worker_config(old) == Settings(plan_file="p.json", cache_seed="seeded")


@pytest.mark.parametrize(
    "raw,value", [(None, "ahead"), ("ahead", "ahead"), ("IDLE", "idle"), ("end", "end"), ("8", 8)]
)
def test_swap_publish_names_a_mode_or_a_chunk_size_and_reaches_the_workers(raw, value):
    """--reap-swap-publish / REAP_SWAP_PUBLISH (run 24): ahead by default; the worker config carries it."""
    from reap_swap.engine.residency.swap import PUBLISH_AHEAD, PUBLISH_WHEN_IDLE, publish_every_of

    ns, _ = split_argv(["m", "--reap-plan", "p.json", *(["--reap-swap-publish", raw] if raw else [])])
    settings = resolve(ns, {}).settings
    assert settings.residency.swap_publish == value
    worker = Settings.from_worker_config(settings.to_worker_config())
    expected = {"ahead": PUBLISH_AHEAD, "idle": PUBLISH_WHEN_IDLE, "end": 0}.get(value, value)
    assert publish_every_of(worker.residency.swap_publish) == expected


# -- the device cache by default (issue 42): settings.cache_form ------------------------------------
def _form(platform="cuda", parallel=1, **env):
    from reap_swap.config.settings import cache_form

    s = resolve({}, {"REAP_PLAN_FILE": "p.json", **env}).settings
    out, why = cache_form(s, platform, parallel)
    return out.cache.device, out.cache.seed, why


def test_device_cache_is_the_default_on_cuda_in_the_seeded_form():
    assert _form() == ("on", "seeded", "device cache on (the default on CUDA), seeded form")


def test_cpu_keeps_accounting_as_before():
    device, seed, why = _form("cpu")
    assert (device, seed) == ("off", "pinned") and why.startswith("device cache off: accounting residency")


@pytest.mark.parametrize(
    ("env", "parallel", "blocker"),
    [
        ({"REAP_CACHE": "off"}, 1, "--reap-cache off"),
        ({"REAP_CACHE": "lru"}, 1, "implements lfu only"),
        ({}, 2, "tensor/pipeline parallelism"),
        ({"REAP_GROUP_SIZE": "auto"}, 1, "knows no groups"),
        ({"REAP_BUDGET": "auto"}, 1, "the plan's pool"),
        ({"REAP_RESIDENCY": "accounting"}, 1, "accounting residency"),
    ],
)
def test_where_the_device_cache_is_not_served_the_default_keeps_todays_path(env, parallel, blocker):
    device, seed, why = _form(parallel=parallel, **env)
    assert (device, seed) == ("off", "pinned") and why.startswith("device cache off: ") and blocker in why


def test_explicit_choices_are_kept():
    assert _form(REAP_CACHE_DEVICE="off")[:2] == ("off", "pinned")
    assert _form(REAP_CACHE_SEED="pinned")[:2] == ("on", "pinned")
    assert _form(REAP_CACHE_SLOTS="swaps")[:2] == ("on", "pinned")  # room kept for swaps: the pinned form
    assert _form("cpu", REAP_CACHE_DEVICE="on", REAP_CACHE_SEED="seeded")[:2] == ("on", "seeded")


def test_one_cache_switch_on_or_off():
    """--reap-cache on|off is the switch (on = the default lfu policy); lfu / lru stay accepted."""
    assert resolve({"plan_file": "p", "cache": "on"}, {}).settings.cache.policy == "lfu"
    assert resolve({}, {"REAP_PLAN_FILE": "p", "REAP_CACHE": "on"}).settings.cache.policy == "lfu"
    assert resolve({}, {"REAP_PLAN_FILE": "p", "REAP_CACHE": "off"}).settings.cache.policy == "off"
    ns, rest = split_argv(["m", "--reap-cache", "on"])
    assert resolve(ns, {"REAP_PLAN_FILE": "p"}).settings.cache.policy == "lfu" and rest == ["m"]
    with pytest.raises(SettingsError, match="REAP_CACHE"):
        resolve({}, {"REAP_PLAN_FILE": "p", "REAP_CACHE": "sometimes"})


def test_help_leaves_the_debug_settings_to_the_docs():
    from reap_swap.config.flags import DEBUG_SETTINGS, help_text

    text = help_text("prog")
    assert "--reap-cache on|off|lfu|lru" in text and "--reap-plan PATH" in text
    docs = (Path(__file__).resolve().parents[1] / "docs" / "settings.md").read_text()
    for flag in ("--reap-cache-device", "--reap-cache-seed", "--reap-cache-shadow", "--reap-swap-publish"):
        assert flag not in text and flag in docs
    assert "docs/settings.md" in text.splitlines()[-1]
    assert len(DEBUG_SETTINGS) == 4
