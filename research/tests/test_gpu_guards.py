"""research/gpu/gpu_guards.py (issue 17's guards) on the CPU: the all-resident plan is valid, the
arms' commands, and main over fake servers (moved from tests/test_guard_report.py, which keeps the
pure summariser's tests)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from harness_modules import load_script

from reap_swap.plan.document import validate_plan_document
from reap_swap.sizing.model_shape import read_model_shape

DATA = Path(__file__).resolve().parents[2] / "tests" / "data"


def _cache(engaged=True, slots=8, layers=12, steps=5, mode="device"):
    rows = {str(i): {"engaged": True, "slots": slots, "tail_slots": slots} for i in range(layers)}
    return {"engaged": engaged, "mode": mode, "layers": rows, "steps": steps, "reason": None}


def test_guard_commands_and_the_all_resident_plan(tmp_path):
    """The reap arms serve a valid plan whose core is every expert of every MoE layer; the cache
    arm's plan budgets every expert + N slots per layer (the tail the device cache engages on) and
    asks for exactly those N x layers slots; otherwise the same argv."""
    guards, model = _guards_and_model(tmp_path)
    cmds = guards.commands(model, tmp_path, kv_gib=2.0, util=0.3, slots_per_layer=2)
    shape = read_model_shape(model)
    doc = json.loads((tmp_path / "plan-all-resident.json").read_text())
    tail = json.loads((tmp_path / "plan-all-resident-tail.json").read_text())
    for d in (doc, tail):
        assert validate_plan_document(d, shape).ok
        for layer in d["perLayer"].values():
            assert layer["coreExperts"] == list(range(shape.num_experts)) and layer["sliceCatalog"] == []
    assert doc["budget"]["swappable_expert_budget_bytes"] == shape.total_expert_bytes
    layers = len(shape.moe_layers)
    extra = tail["budget"]["swappable_expert_budget_bytes"] - shape.total_expert_bytes
    assert extra == 2 * layers * shape.expert_bytes  # pool = every expert + 2 slots per layer
    cache = cmds["reap-cache"]
    assert cache[-len(guards.CACHE_FLAGS) - 1 :] == [*guards.CACHE_FLAGS, str(2 * layers)]
    assert cache[cache.index("--reap-plan") + 1] == str(tmp_path / "plan-all-resident-tail.json")
    assert cache[: cache.index("--reap-plan")] == cmds["reap"][: cmds["reap"].index("--reap-plan")]
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


def _guards_and_model(tmp_path):
    """gpu_guards loaded, and a tiny Mixtral config as its model folder."""
    guards = load_script("gpu_guards")
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(DATA / "mixtral_tiny_cpu_config.json", model / "config.json")
    return guards, model


def _fake_servers(guards, monkeypatch, decode):
    """gpu_guards' servers replaced by _FakeServer, its decode sample by `decode`."""
    _FakeServer.started, _FakeServer.stopped = [], []
    monkeypatch.setattr(guards.serving, "Server", _FakeServer)
    monkeypatch.setattr(guards, "one_decode", decode)


def _run_main(guards, monkeypatch, model, tmp_path, serves: int, rounds: int):
    """gpu_guards.main over the fakes into tmp_path/out (it must exit 0): (out, guards.json)."""
    out = tmp_path / "out"
    argv = [
        "gpu_guards",
        "--model",
        str(model),
        "--out",
        str(out),
        "--serves",
        str(serves),
        "--rounds",
        str(rounds),
    ]
    monkeypatch.setattr("sys.argv", argv)
    _URLS.clear()
    assert guards.main() == 0
    return out, json.loads((out / "guards.json").read_text())


def test_gpu_guards_main_over_fake_servers(tmp_path, monkeypatch):
    """gpu_guards.main end to end with fake servers and rates: 2 serves x 3 rounds x 3 arms
    interleaved, every server stopped, facts recorded, the summary and markdown written."""
    guards, model = _guards_and_model(tmp_path)
    rates = {"stock": 700.0, "reap": 690.0, "reap-cache": 689.0}
    _fake_servers(guards, monkeypatch, lambda url, tokens, prompt: rates[_arm_of(url, guards)])
    layers = len(read_model_shape(model).moe_layers)
    monkeypatch.setattr(guards, "reap_facts", lambda url: {"cache": _cache(slots=8, layers=layers)})
    out, doc = _run_main(guards, monkeypatch, model, tmp_path, serves=2, rounds=3)
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
    assert len(doc["facts"]["reap-cache"]) == 4  # at start and after the rounds, each serve
    assert doc["summary"]["arms"]["reap-cache"]["vs_stock"]["paired"] == pytest.approx(689 / 700)
    assert "| reap-cache | 2 | 6 |" in (out / "guards.md").read_text()


def test_gpu_guards_refuses_a_cache_arm_that_did_not_engage(tmp_path, monkeypatch):
    """Run 12's failure: the cache arm's cache reports not engaged -> that arm is not timed and the
    guard reads "not measured" (the other arms still are); the servers all stop."""
    guards, model = _guards_and_model(tmp_path)
    _fake_servers(guards, monkeypatch, lambda url, tokens, prompt: 700.0)
    off = {
        "engaged": False,
        "mode": "device",
        "reason": "--reap-cache-slots auto: 0 pool slot(s)",
        "layers": {},
    }
    monkeypatch.setattr(guards, "reap_facts", lambda url: {"cache": off})
    out, doc = _run_main(guards, monkeypatch, model, tmp_path, serves=1, rounds=2)
    assert {s["arm"] for s in doc["samples"]} == {"stock", "reap"} and len(doc["samples"]) == 4
    row = doc["summary"]["arms"]["reap-cache"]
    assert "0 pool slot(s)" in row["not_measured"] and row["vs_stock"]["met_paired"] is None
    assert sorted(_FakeServer.stopped) == sorted(_FakeServer.started)
    assert "not measured" in (out / "guards.md").read_text()


_URLS: dict[str, str] = {}


def _arm_of(url: str, guards) -> str:
    """The arm a fake server's url belongs to (the fake records name -> url at start)."""
    return next(a for a in guards.ARMS if any(n.startswith(a + "-s") and u == url for n, u in _URLS.items()))


def test_guard_seeded_cache_arm_uses_the_all_resident_plan(tmp_path):
    """--cache-seed seeded: every pool slot a cache slot seeded with the core (auto), E per layer."""
    guards, model = _guards_and_model(tmp_path)
    cmds = guards.commands(model, tmp_path, kv_gib=2.0, util=0.3, seed="seeded")
    cache = cmds["reap-cache"]
    assert cache[cache.index("--reap-plan") + 1] == str(tmp_path / "plan-all-resident.json")
    assert cache[-4:] == ["--reap-cache-slots", "auto", "--reap-cache-seed", "seeded"]
    assert "--reap-unverified-seeded-cache" not in cache  # retired in run 23: seeded needs no opt-in
    a = SimpleNamespace(cache_seed="seeded", cache_slots_per_layer=8)
    assert guards.expected_slots(a, model) == read_model_shape(model).num_experts
    assert guards.expected_slots(SimpleNamespace(cache_seed="pinned", cache_slots_per_layer=8), model) == 8


def test_gpu_guards_keeps_the_serves_whose_cache_engaged(tmp_path, monkeypatch):
    """Serve 0's cache did not engage, serve 1's did: serve 1's cache samples are reported, serve 0
    is named in cache_not_engaged_serves."""
    guards, model = _guards_and_model(tmp_path)
    _fake_servers(guards, monkeypatch, lambda url, tokens, prompt: 700.0)
    layers = len(read_model_shape(model).moe_layers)
    off = {"engaged": False, "mode": "device", "reason": "x", "layers": {}}
    serve_of = lambda url: int(next(n for n, u in _URLS.items() if u == url).rsplit("-s", 1)[1])  # noqa: E731
    monkeypatch.setattr(
        guards, "reap_facts", lambda url: {"cache": off if serve_of(url) == 0 else _cache(layers=layers)}
    )
    _, doc = _run_main(guards, monkeypatch, model, tmp_path, serves=2, rounds=2)
    assert doc["cache_not_engaged_serves"] == [0]
    assert {x["serve"] for x in doc["samples"] if x["arm"] == "reap-cache"} == {1}
    row = doc["summary"]["arms"]["reap-cache"]
    assert "not_measured" not in row and row["vs_stock"]["paired"] == pytest.approx(1.0)
