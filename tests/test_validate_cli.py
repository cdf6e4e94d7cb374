"""`reap-swap validate`: exit codes, error paths and summary on the shared strict30 plan."""

import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from reap_swap.cli.main import COMMANDS, main

FIXTURE = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "strict30-v2-plan.json"
QWEN35 = Path(__file__).parent / "data" / "qwen3_5_moe_35b_a3b_config.json"

pytestmark = pytest.mark.skipif(not FIXTURE.exists(), reason=f"shared fixture missing: {FIXTURE}")


@pytest.fixture
def plan_file(tmp_path) -> Path:
    path = tmp_path / "strict30.json"
    shutil.copyfile(FIXTURE, path)
    return path


def edited(tmp_path, edit) -> Path:
    doc = orjson.loads(FIXTURE.read_bytes())
    edit(doc)
    path = tmp_path / "edited.json"
    path.write_bytes(orjson.dumps(doc))
    return path


def test_valid_plan_exits_0_and_reports_the_counts(plan_file, capsys):
    assert main(["validate", str(plan_file)]) == 0
    out = capsys.readouterr().out
    assert "valid: 0 error(s), 0 warning(s)" in out
    assert "layers               40" in out
    assert "experts per layer    256" in out
    assert "core experts         1,960" in out
    assert "slices               1,040" in out
    assert "(73.6 %)" in out and "100.0 %" in out


def test_slice_expert_256_exits_1_naming_the_path(tmp_path, capsys):
    def edit(doc):
        doc["perLayer"]["layer_5"]["sliceCatalog"][3]["experts"][2] = 256

    assert main(["validate", str(edited(tmp_path, edit))]) == 1
    out = capsys.readouterr().out
    assert "error   perLayer.layer_5.sliceCatalog[3].experts[2]: 256 is not < numExperts 256" in out
    assert "INVALID: 1 error(s)" in out


def test_misspelled_core_experts_exits_1_naming_the_path(tmp_path, capsys):
    def edit(doc):
        layer = doc["perLayer"]["layer_17"]
        layer["coreExpert"] = layer.pop("coreExperts")

    assert main(["validate", str(edited(tmp_path, edit))]) == 1
    out = capsys.readouterr().out
    assert (
        "error   perLayer.layer_17.coreExpert: unknown key 'coreExpert' (did you mean 'coreExperts'?)" in out
    )
    assert "error   perLayer.layer_17: missing required key 'coreExperts'" in out


def test_json_output_is_one_document(tmp_path, capsys):
    def edit(doc):
        doc["perLayer"]["layer_5"]["sliceCatalog"][3]["experts"][2] = 300
        doc["perLayer"]["layer_0"]["coreByteCost"] = 1

    assert main(["validate", str(edited(tmp_path, edit)), "--json"]) == 1
    report = orjson.loads(capsys.readouterr().out)
    assert report["ok"] is False
    assert report["errors"] == [
        {"path": "perLayer.layer_5.sliceCatalog[3].experts[2]", "message": "300 is not < numExperts 256"}
    ]
    assert [w["path"] for w in report["warnings"]] == ["perLayer.layer_0.coreByteCost"]
    assert (report["summary"]["layers"], report["summary"]["core_experts"], report["summary"]["slices"]) == (
        40,
        1960,
        1040,
    )


def test_model_config_file_or_folder(plan_file, tmp_path, capsys):
    assert main(["validate", str(plan_file), "--model", str(QWEN35), "--json"]) == 0
    assert orjson.loads(capsys.readouterr().out)["ok"] is True
    config = orjson.loads(QWEN35.read_bytes())
    config["text_config"]["moe_intermediate_size"] = 768
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_bytes(orjson.dumps(config))
    assert main(["validate", str(plan_file), "--model", str(folder)]) == 1
    assert (
        "error   budget.per_expert_bytes: 6,291,456 != model's expert size 9,437,184"
        in capsys.readouterr().out
    )


def test_unreadable_inputs_exit_1(tmp_path, plan_file, capsys):
    assert main(["validate", str(tmp_path / "missing.json")]) == 1
    assert "cannot read" in capsys.readouterr().out
    assert main(["validate", str(plan_file), "--model", str(tmp_path)]) == 1
    assert "--model: " in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text('{"mode": ')
    assert main(["validate", str(bad)]) == 1
    assert "$: not valid JSON" in capsys.readouterr().out


def test_usage_errors_and_help(capsys):
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)


def test_console_entry_point_runs_in_a_fresh_process(plan_file):
    """The installed script calls reap_swap.cli.main:main; run it as a module so no install is needed."""
    done = subprocess.run(
        [sys.executable, "-m", "reap_swap.cli", "validate", str(plan_file)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "core experts         1,960" in done.stdout
