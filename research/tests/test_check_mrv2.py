"""research/gpu/check_mrv2.py: the lead's read-out of the Model Runner V2 GPU check, on made-up lane output
and on run 13's saved output (research.md "Run 13": V2-Lite's UVA flags were ignored, 0 counted)."""

from __future__ import annotations

import json
from pathlib import Path

from harness_modules import load_script

chk = load_script("check_mrv2")
RUN13 = Path(__file__).resolve().parents[2] / "research-notes/h200-2026-12-02/run13/a"


def _family(top: Path, name: str, runner: str, log: str, equal: bool = True, notes=()) -> None:
    d = top / name
    d.mkdir(parents=True)
    status = {"status": 200, "result": {"results": [
        {"rank": 0, "runner": {"model_runner": runner, "padding_mask": "slot_mapping", "notes": list(notes)}}
    ]}}  # fmt: skip
    doc = {
        "reap": {"worker_status": status, "counters": {"equal": equal}, "host_startup": {"hbm_peak_gib": 1.0}}
    }
    (d / "reap.json").write_text(json.dumps(doc))
    (d / "reap.server.log").write_text(log)


V2_LOG = (
    "reap-swap: no UVA expert offload: vLLM 0.26.0 runs DeepseekV2ForCausalLM on Model Runner V2 by default\n"
)
V1_LOG = "non-default args: {'cpu_offload_gb': 9.0}\n[base.py:123] Offloader set to UVAOffloader\n"


def test_a_run_that_holds(tmp_path):
    _family(tmp_path, "deepseek_v2_lite", "v2", V1_LOG)  # the hook set vLLM's UVA offloader on V2
    _family(tmp_path, "mixtral_8x7b", "v1", V1_LOG)
    assert chk.main([str(tmp_path), "--out", str(tmp_path / "out.json")]) == 0
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["ok"] and [v["failures"] for v in report["families"]] == [[], []]


def test_a_run_from_before_the_hook_that_holds(tmp_path):
    _family(tmp_path, "deepseek_v2_lite", "v2", V2_LOG)
    _family(tmp_path, "mixtral_8x7b", "v1", V1_LOG)
    assert chk.main([str(tmp_path), "--before-hook"]) == 0
    assert chk.main([str(tmp_path)]) == 1  # today: V2 must offload


def test_what_fails(tmp_path):
    _family(tmp_path, "a_v2_no_uva", "v2", V2_LOG)  # the hook did not act
    _family(tmp_path, "b_v2_uncounted", "v2", V1_LOG, equal=False)
    _family(tmp_path, "c_v1_noted", "v1", V1_LOG, notes=["x"])
    assert chk.main([str(tmp_path)]) == 1
    got = {v["family"]: chk.failures(v) for v in (chk.check_family(p) for p in sorted(tmp_path.iterdir()))}
    assert any("hook should set the offloader" in f for f in got["a_v2_no_uva"])
    assert got["b_v2_uncounted"] == ["counters.equal is False"]
    assert got["c_v1_noted"] == ["worker notes: ['x']"]
    before = chk.failures(chk.check_family(tmp_path / "b_v2_uncounted"), before_hook=True)
    assert any("UVA offload was requested" in f for f in before)


def test_run13_shows_v2_ignored_the_uva_flags():
    v2 = chk.check_family(RUN13 / "fam/deepseek_v2_lite")
    assert v2["uva_args"] and not v2["vllm_offloader"]  # asked for, never set up: Model Runner V2
    assert v2["counters_equal"] is False and v2["hbm_peak_gib"] == 58.61  # pool 29.3 + experts 26.8 + dense
    v1 = chk.check_family(RUN13 / "fam/gpt_oss_20b")
    assert v1["uva_args"] and v1["vllm_offloader"] and v1["counters_equal"] is True
    assert v2["model_runner"] == ["absent"]  # run 13 predates the runner field
