"""Launcher pieces that run before any engine: argument handling, refusals, plan validation,
installation of the worker extension / plugin / configuration. No engine is started here."""

import argparse
import json
import os
import re
import tempfile

import pytest
from reap_fakes import tiny_plan_doc

from reap_swap.config.settings import ADDITIONAL_CONFIG_KEY, Settings
from reap_swap.engine import plugins
from reap_swap.plan.document import load_plan
from reap_swap.server import launcher as server
from reap_swap.server import plan_source
from reap_swap.sizing.model_shape import read_model_shape


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from reap_fakes import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_prepare_installs_extension_plugin_and_configuration(tiny, monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    args, cmd = server.prepare(
        [
            str(tiny / "model"),
            "--reap-plan",
            str(tiny / "plan.json"),
            "--port",
            "8123",
            "--enforce-eager",
            "--additional-config",
            '{"other": 1}',
        ]
    )
    assert args.model == str(tiny / "model") and args.port == 8123 and args.enforce_eager is True
    assert args.worker_extension_cls == plugins.WORKER_EXTENSION_CLS
    cfg = args.additional_config[ADDITIONAL_CONFIG_KEY]
    assert args.additional_config["other"] == 1  # the user's additional config is kept
    assert cfg["plan_file"] == str((tiny / "plan.json").resolve()) and len(cfg["plan_identity"]) == 64
    assert Settings.from_worker_config(cfg).plan_file == (tiny / "plan.json").resolve()
    assert {"reap_swap", "reap_swap_layers"} <= set(os.environ["VLLM_PLUGINS"].split(","))
    assert type(cmd).__name__ == "ServeSubcommand"


def test_plugin_allowlist_keeps_what_loaded_before(monkeypatch):
    ours = "reap_swap,reap_swap_layers"
    assert plugins.vllm_plugins_allowlist("a,b") == f"a,b,{ours}"
    assert plugins.vllm_plugins_allowlist("reap_swap_layers,reap_swap") == "reap_swap_layers,reap_swap"
    installed = {
        "vllm.general_plugins": ["gen", "reap_swap_layers"],
        "vllm.platform_plugins": ["plat"],
        "vllm.endpoint_plugins": ["someone_elses_routes"],
    }
    monkeypatch.setattr(
        plugins, "entry_points", lambda group: [argparse.Namespace(name=n) for n in installed.get(group, [])]
    )
    # unset VLLM_PLUGINS loads every general/platform plugin: setting it must not drop them,
    # and must not opt other endpoint plugins in
    assert plugins.vllm_plugins_allowlist(None) == "gen,plat,reap_swap_layers,reap_swap"


@pytest.mark.parametrize(
    "attrs,needle",
    [
        ({"api_server_count": 2}, "--api-server-count"),
        ({"data_parallel_size": 2}, "--data-parallel-size"),
        ({"headless": True}, "--headless"),
        ({"worker_extension_cls": "x.Y"}, "--worker-extension-cls"),
    ],
)
def test_unsupported_topologies_are_refused(attrs, needle):
    args = argparse.Namespace(
        **{
            "headless": False,
            "grpc": False,
            "api_server_count": None,
            "data_parallel_size": 1,
            "worker_extension_cls": "",
            **attrs,
        }
    )
    with pytest.raises(server.LaunchError, match=needle):
        server.check_topology(args)


def test_invalid_plan_is_a_launch_error_with_the_report(tiny, tmp_path):
    doc = tiny_plan_doc()
    doc["perLayer"]["layer_0"]["coreExperts"].append(31)
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps(doc))
    args = argparse.Namespace(model=str(tiny / "model"), hf_config_path=None)
    with pytest.raises(server.LaunchError) as exc:
        plan_source.load_validated_plan(Settings(plan_file=bad), args)
    assert "invalid plan" in str(exc.value) and "31" in str(exc.value)


def test_plan_for_another_model_shape_is_refused(tiny, tmp_path):
    cfg = json.loads((tiny / "model" / "config.json").read_text())
    cfg["num_experts"] = 8
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(cfg))
    args = argparse.Namespace(model=str(other), hf_config_path=None)
    with pytest.raises(server.LaunchError, match="invalid plan"):
        plan_source.load_validated_plan(Settings(plan_file=tiny / "plan.json"), args)


def test_main_exit_codes_for_refusals(tiny, monkeypatch, capsys):
    monkeypatch.setenv("REAP_PLAN_FILE", str(tiny / "plan.json"))
    monkeypatch.setenv("REAP_MAX_LOADED_CARTRIGDES", "3")
    assert server.main([str(tiny / "model")]) == 2
    assert "REAP_MAX_LOADED_CARTRIDGES" in capsys.readouterr().err
    monkeypatch.delenv("REAP_MAX_LOADED_CARTRIGDES")
    assert server.main([str(tiny / "model"), "--api-server-count", "2"]) == 1
    assert "--api-server-count" in capsys.readouterr().err


def test_prepare_hands_the_workers_a_slot_count_for_cache_slots_swaps(tiny, monkeypatch):
    from reap_swap.plan.document import load_plan
    from reap_swap.sizing.cache_tail import plan_swap_split
    from reap_swap.sizing.model_shape import read_model_shape

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    args, _ = server.prepare(
        [
            str(tiny / "model"),
            "--reap-plan",
            str(tiny / "plan.json"),
            "--reap-cache-slots",
            "swaps",
            "--enforce-eager",
        ]
    )
    cfg = args.additional_config[ADDITIONAL_CONFIG_KEY]
    shape = read_model_shape(str(tiny / "model"))
    split = plan_swap_split(load_plan(str(tiny / "plan.json"), shape), int(shape.top_k))
    assert split.why is None and split.per_layer >= 1 and split.kept > split.core
    assert cfg["cache"]["slots"] == split.cache_slots  # an int: the workers never see "swaps"
    assert Settings.from_worker_config(cfg).cache.slots == split.cache_slots


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_works_without_a_plan(flag, monkeypatch, capsys):
    """`python -m reap_swap.server --help` prints the REAP settings and vLLM's arguments and exits 0,
    with no plan anywhere (it used to exit 1: "no plan")."""
    for k in [k for k in os.environ if k.startswith("REAP_")]:
        monkeypatch.delenv(k)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    with pytest.raises(SystemExit) as exc:
        server.main([flag])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m reap_swap.server MODEL")
    assert "--reap-plan PATH" in out and "[REAP_PLAN_FILE]" in out and "--reap-cache" in out
    assert "--max-model-len" in out or "--help=" in out  # vLLM's own part follows
    ours = out.split("positional arguments")[0]
    assert not re.search(r"\bruns? \d+|research\.md|20\d\d-\d\d", ours)  # help without history


def test_no_plan_serves_a_bare_plan_written_for_the_model(tiny, monkeypatch, tmp_path, caplog):
    """No --reap-plan: the launcher writes a bare plan of the model (no core, no slices, half the
    experts' bytes as the pool) and the workers read it like any plan."""
    for k in [k for k in os.environ if k.startswith("REAP_")]:
        monkeypatch.delenv(k)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with caplog.at_level("INFO", logger="reap_swap.server.launcher"):
        args, _cmd = server.prepare([str(tiny / "model"), "--enforce-eager"])
    cfg = args.additional_config[ADDITIONAL_CONFIG_KEY]
    settings = Settings.from_worker_config(cfg)
    assert settings.plan_file.parent == tmp_path and settings.plan_file.name.startswith("reap-swap-no-plan-")
    shape = read_model_shape(str(tiny / "model"))
    plan = load_plan(str(settings.plan_file), shape)
    assert plan.bare and not any(lp.core or lp.slices for lp in plan.layers.values())
    assert plan.swappable_budget_bytes == shape.total_expert_bytes // 2
    assert cfg["plan_identity"] == plan.identity
    assert "no plan:" in caplog.text


def test_no_plan_with_a_gib_budget_sizes_the_pool(tiny, monkeypatch, tmp_path):
    for k in [k for k in os.environ if k.startswith("REAP_")]:
        monkeypatch.delenv(k)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    shape = read_model_shape(str(tiny / "model"))
    gib = 3 * shape.expert_bytes / 2**30
    args, _cmd = server.prepare([str(tiny / "model"), "--enforce-eager", "--reap-budget", repr(gib)])
    settings = Settings.from_worker_config(args.additional_config[ADDITIONAL_CONFIG_KEY])
    assert load_plan(str(settings.plan_file), shape).swappable_budget_bytes == 3 * shape.expert_bytes
    assert settings.budget.pool == "plan"  # that pool is the plan's: the device cache may run on it
