"""Startup refusals: they happen in the launcher, before any engine process exists."""

import json
import subprocess
import sys

import pytest

from .conftest import ROOT, group_alive, kill_group, launcher_env


def launch(args: list[str], env: dict[str, str] | None = None, timeout: float = 180):
    proc = subprocess.Popen(
        [sys.executable, "-m", "reap_swap.server", *args],
        cwd=ROOT,
        env=launcher_env(**(env or {})),
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc, grace_s=5)
    left = group_alive(proc.pid)
    assert not left, f"processes left behind: {left}"
    return proc.returncode, out


@pytest.fixture
def broken_plan(tiny_moe, tmp_path):
    doc = json.loads((tiny_moe / "plan.json").read_text())
    doc["perLayer"]["layer_2"]["coreExperts"] = [0, 1, 99]  # no expert 99 in a 16-expert model
    doc["perLayer"]["layer_5"] = dict(doc["perLayer"]["layer_1"], rawLayerKey="5")  # the model has 4 layers
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    return path


def test_invalid_plan_stops_startup_with_the_report(tiny_moe, broken_plan):
    code, out = launch([str(tiny_moe / "model"), "--reap-plan", str(broken_plan), "--port", "1"])
    assert code != 0, out
    assert "invalid plan" in out and "layer_2" in out and "99" in out, out
    assert "EngineCore" not in out and "Starting vLLM" not in out


def test_unknown_reap_variable_is_refused_listing_known_names(tiny_moe):
    code, out = launch([str(tiny_moe / "model")], env={"REAP_PLAN_FIEL": str(tiny_moe / "plan.json")})
    assert code != 0
    assert "REAP_PLAN_FIEL" in out
    for known in (
        "REAP_PLAN_FILE",
        "REAP_SWAP_VALIDATE_ONLY",
        "REAP_SWAP_MASKS_ONLY",
        "REAP_ENABLE_ROUTER_MASKS",
        "REAP_MAX_LOADED_CARTRIDGES",
    ):
        assert known in out


def test_router_masks_are_refused(tiny_moe):
    code, out = launch(
        [str(tiny_moe / "model")],
        env={"REAP_PLAN_FILE": str(tiny_moe / "plan.json"), "REAP_ENABLE_ROUTER_MASKS": "1"},
    )
    assert code != 0 and "destroy output quality" in out


def test_without_a_plan_a_model_without_a_config_is_refused_before_any_engine(tmp_path):
    """No plan: the launcher builds a bare plan from the model's config (plan/bare.py), so a model
    folder without one is refused with the reason, before vLLM starts an engine."""
    code, out = launch([str(tmp_path)], timeout=120)
    assert code == 1 and "startup refused" in out and str(tmp_path) in out
    assert "EngineCore" not in out


def test_conflicting_worker_extension_is_refused(tiny_moe):
    code, out = launch(
        [
            str(tiny_moe / "model"),
            "--reap-plan",
            str(tiny_moe / "plan.json"),
            "--worker-extension-cls",
            "somewhere.Else",
        ]
    )
    assert code != 0 and "worker-extension-cls" in out
