"""Issue 17's guards: the pure summariser (guard_report) from synthetic samples, and the guard
scripts' CPU-checkable parts (the all-resident plan is valid, the arms' commands)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from script_modules import load_script

from reap_swap.guard_report import decode_markdown, decode_summary, swap_summary
from reap_swap.model_shape import read_model_shape
from reap_swap.plan import validate_plan_document

DATA = Path(__file__).parent / "data"


def _swap_samples():
    out = []
    for rep, (off, on) in enumerate([(45.0, 52.0), (46.0, 53.0), (44.0, 51.0), (45.5, 49.0), (45.2, 52.5)]):
        for arm, g, pub in (("0", off, 0.003), ("8", on, 0.0004)):
            phases = {"publish": pub, "publish_overlapped": 0.0 if arm == "0" else 0.002, "admit": 0.017}
            out.append({"case": "1GiB_delta", "arm": arm, "rep": rep, "gbps": g, "phases": phases})
    out.append({"case": "10pct_pool", "arm": "8", "rep": 0, "gbps": 50.0, "phases": {}})
    return out


def test_swap_summary_medians_ratio_and_guard():
    s = swap_summary(_swap_samples(), default_arm="8", baseline_arm="0")
    on, off = s["cases"]["1GiB_delta"]["8"], s["cases"]["1GiB_delta"]["0"]
    assert on["gbps"]["median"] == 52.0 and on["gbps"]["n"] == 5 and off["gbps"]["median"] == 45.2
    assert on["gbps_vs_0"] == pytest.approx(52.0 / 45.2) and off["gbps_vs_0"] == 1.0
    assert on["publish_ms"]["median"] == pytest.approx(0.4) and off["publish_ms"]["median"] == pytest.approx(
        3.0
    )
    assert on["publish_overlapped_ms"]["median"] == pytest.approx(2.0)
    assert s["guard"] == {
        "case": "1GiB_delta",
        "arm": "8",
        "gbps_median": 52.0,
        "target_gbps": 50.0,
        "met": True,
    }
    assert s["cases"]["10pct_pool"]["8"]["gbps_vs_0"] is None  # no baseline in that case


def test_swap_guard_missed_and_missing():
    samples = [dict(x, gbps=x["gbps"] - 5) for x in _swap_samples()]
    assert swap_summary(samples, "8", "0")["guard"]["met"] is False
    assert swap_summary([], "8", "0")["guard"]["met"] is None


def _decode_samples():
    # serve 0: stock 700, reap 690, reap-cache 680 (medians); serve 1: 720 / 700 / 690
    table = {0: {"stock": [690, 700, 710], "reap": [680, 690, 700], "reap-cache": [670, 680, 690]},
             1: {"stock": [715, 720, 725], "reap": [695, 700, None], "reap-cache": [685, 690, 695]}}  # fmt: skip
    return [
        {"arm": arm, "serve": s, "round": r, "tok_s": v}
        for s, arms in table.items()
        for arm, vals in arms.items()
        for r, v in enumerate(vals)
    ]


def test_decode_summary_pooled_and_serve_medians():
    s = decode_summary(_decode_samples())
    stock, reap, cache = (s["arms"][a] for a in ("stock", "reap", "reap-cache"))
    assert stock["per_serve_median"] == {0: 700, 1: 720} and stock["serves"] == 2
    assert stock["pooled"]["median"] == 712.5 and stock["pooled"]["n"] == 6
    assert reap["pooled"]["n"] == 5  # the failed (None) sample is not counted
    assert reap["per_serve_median"] == {0: 690, 1: 697.5}
    assert reap["vs_stock"]["serve_medians"] == pytest.approx(693.75 / 710)
    assert reap["vs_stock"]["pooled"] == pytest.approx(695 / 712.5)
    assert reap["vs_stock"]["met_pooled"] is True  # 0.9754
    assert cache["vs_stock"]["serve_medians"] == pytest.approx(685 / 710)
    assert cache["vs_stock"]["met_serve_medians"] is False  # 0.9648
    assert "vs_stock" not in stock
    md = decode_markdown(s)
    assert "| reap | 2 | 5 |" in md and "| stock | 2 | 6 | 712.5" in md and "0.975" in md


def test_decode_summary_without_stock_gives_no_ratio():
    s = decode_summary([{"arm": "reap", "serve": 0, "round": 0, "tok_s": 1.0}])
    assert s["arms"]["reap"]["vs_stock"]["pooled"] is None
    assert s["arms"]["reap"]["vs_stock"]["met_pooled"] is None


def test_guard_commands_and_the_all_resident_plan(tmp_path):
    """The reap arms serve a valid plan whose core is every expert of every MoE layer (pool = all,
    so --reap-cache-slots auto leaves no tail); the cache arm differs only by the cache flags."""
    guards = load_script("gpu_guards")
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(DATA / "mixtral_tiny_cpu_config.json", model / "config.json")
    cmds = guards.commands(model, tmp_path, kv_gib=2.0, util=0.3)
    doc = json.loads((tmp_path / "plan-all-resident.json").read_text())
    shape = read_model_shape(model)
    assert validate_plan_document(doc, shape).ok
    for layer in doc["perLayer"].values():
        assert layer["coreExperts"] == list(range(shape.num_experts)) and layer["sliceCatalog"] == []
    assert doc["budget"]["swappable_expert_budget_bytes"] == shape.total_expert_bytes
    assert cmds["reap-cache"][: -len(guards.CACHE_FLAGS)] == cmds["reap"][:-2]
    assert cmds["reap"][-2:] == ["--reap-cache", "off"]
    for argv in cmds.values():
        assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.3"
        assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(2 * 2**30)
        assert "--enforce-eager" not in argv  # CUDA graphs on
    stock = cmds["stock"]
    assert stock[stock.index("--model") + 2 :] == cmds["reap"][4 : cmds["reap"].index("--reap-plan")]


class _FakeServer:
    started: list[str] = []
    stopped: list[str] = []

    def __init__(self, name, argv, outdir, port=0, **_):
        self.name, self.url, self.argv = name, f"http://fake:{port}", argv

    def start(self):
        _FakeServer.started.append(self.name)
        _URLS[self.name] = self.url
        return self

    def stop(self, check=True):
        _FakeServer.stopped.append(self.name)


def test_gpu_guards_main_over_fake_servers(tmp_path, monkeypatch):
    """gpu_guards.main end to end with fake servers and rates: 2 serves x 3 rounds x 3 arms
    interleaved, every server stopped, facts recorded, the summary and markdown written."""
    guards = load_script("gpu_guards")
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(DATA / "mixtral_tiny_cpu_config.json", model / "config.json")
    _FakeServer.started, _FakeServer.stopped = [], []
    rates = {"stock": 700.0, "reap": 690.0, "reap-cache": 689.0}
    monkeypatch.setattr(guards.serving, "Server", _FakeServer)
    monkeypatch.setattr(guards, "one_decode", lambda url, tokens, prompt: rates[_arm_of(url, guards)])
    monkeypatch.setattr(guards, "reap_facts", lambda url: {"cache": {"engaged": False}})
    out = tmp_path / "out"
    argv = ["gpu_guards", "--model", str(model), "--out", str(out), "--serves", "2", "--rounds", "3"]
    monkeypatch.setattr("sys.argv", argv)
    _URLS.clear()
    assert guards.main() == 0
    doc = json.loads((out / "guards.json").read_text())
    assert len(doc["samples"]) == 2 * 3 * 3 and sorted(_FakeServer.stopped) == sorted(_FakeServer.started)
    assert len(_FakeServer.started) == 6
    assert [s["arm"] for s in doc["samples"][:6]] == [
        "stock",
        "reap",
        "reap-cache",
        "reap",
        "reap-cache",
        "stock",
    ]
    assert doc["summary"]["arms"]["reap"]["vs_stock"]["pooled"] == pytest.approx(690 / 700)
    assert len(doc["facts"]["reap-cache"]) == 2
    assert "| reap-cache | 2 | 6 |" in (out / "guards.md").read_text()


_URLS: dict[str, str] = {}


def _arm_of(url: str, guards) -> str:
    """The arm a fake server's url belongs to (the fake records name -> url at start)."""
    return next(a for a in guards.ARMS if any(n.startswith(a + "-s") and u == url for n, u in _URLS.items()))
