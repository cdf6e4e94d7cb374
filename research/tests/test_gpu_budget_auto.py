"""research/gpu/gpu_budget_auto.py: the swap each arm makes must need bytes moved (run 10's did not)."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "research" / "gpu" / "gpu_budget_auto.py"


@pytest.fixture(scope="module")
def lane():
    spec = importlib.util.spec_from_file_location("gpu_budget_auto", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _plan():
    slices = [
        {"sliceId": f"layer_0_slice_{i:02d}", "experts": list(range(8 + 4 * i, 12 + 4 * i))} for i in range(4)
    ]
    return {"perLayer": {"layer_0": {"sliceCatalog": slices}, "layer_1": {"sliceCatalog": []}}}


def test_picks_first_slice_not_resident(lane):
    resident = {"0": list(range(16))}  # core 0..7 + slices 00, 01 already in the full pool
    assert lane.one_slice_per_layer(_plan(), resident) == {"layer_0": ["layer_0_slice_02"]}


def test_all_resident_falls_back_to_last_slice_and_no_status_to_first(lane):
    assert lane.one_slice_per_layer(_plan(), {"0": list(range(64))}) == {"layer_0": ["layer_0_slice_03"]}
    assert lane.one_slice_per_layer(_plan()) == {"layer_0": ["layer_0_slice_00"]}


def test_arm_names(lane):
    a = type("A", (), {"model": "m", "plan": "p", "cap_gib": "4"})()
    assert "0.08" in lane.arm_argv("auto@0.08", a) and "auto" in lane.arm_argv("auto@0.08", a)
    assert "4" in lane.arm_argv("cap@0.14", a)
    assert "--reap-kv-tokens" in lane.arm_argv("refused", a)
    with pytest.raises(SystemExit, match="unknown arm"):
        lane.arm_argv("bogus", a)
