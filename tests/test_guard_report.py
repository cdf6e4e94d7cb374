"""Issue 17's guards: the pure summariser (guard_report) from synthetic samples, and the guard
scripts' CPU-checkable parts (the all-resident plan is valid, the arms' commands)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from script_modules import load_script

from reap_swap.guard_report import cache_not_engaged, decode_markdown, decode_summary, swap_summary
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
    # paired: per round arm / stock of that round, median per serve, median of the serves
    assert reap["paired_per_serve"][0] == pytest.approx(690 / 700)
    assert reap["paired_per_serve"][1] == pytest.approx((695 / 715 + 700 / 720) / 2)  # round 2 failed
    assert reap["vs_stock"]["paired"] == pytest.approx((690 / 700 + (695 / 715 + 700 / 720) / 2) / 2)
    assert reap["vs_stock"]["met_paired"] is True
    md = decode_markdown(s)
    assert "| reap | 2 | 5 |" in md and "| stock | 2 | 6 | 712.5" in md and "0.975" in md


def test_paired_reading_cancels_round_drift():
    """Every arm of a round moves together (run 12: 352-639 tok/s): the pooled ratio is noise, the
    paired one is the arm's own 0.98."""
    drift = [400, 650, 380, 600, 500, 630, 360]
    samples = [
        {"arm": arm, "serve": 0, "round": r, "tok_s": d * f}
        for r, d in enumerate(drift)
        for arm, f in (("stock", 1.0), ("reap-cache", 0.98))
    ]
    samples = [x for x in samples if not (x["arm"] == "stock" and x["round"] == 1)]  # one lost
    row = decode_summary(samples)["arms"]["reap-cache"]
    assert row["vs_stock"]["paired"] == pytest.approx(0.98)
    assert row["vs_stock"]["pooled"] != pytest.approx(0.98, abs=0.01)


def test_refused_arm_reads_not_measured():
    s = decode_summary(_decode_samples()[:6], refused={"reap-cache": "cache not engaged (mode device): x"})
    row = s["arms"]["reap-cache"]
    assert row["not_measured"].startswith("cache not engaged")
    assert row["vs_stock"]["met_paired"] is None and row["vs_stock"]["paired"] is None
    assert "not measured: cache not engaged" in decode_markdown(s)


def _cache(engaged=True, slots=8, layers=12, steps=5, mode="device"):
    rows = {str(i): {"engaged": True, "slots": slots, "tail_slots": slots} for i in range(layers)}
    return {"engaged": engaged, "mode": mode, "layers": rows, "steps": steps, "reason": None}


def test_cache_not_engaged_names_the_reason():
    assert cache_not_engaged(_cache(), 12, 8) is None
    assert cache_not_engaged(_cache(), 12, 8, ran=True) is None
    assert "no step" in cache_not_engaged(_cache(steps=0), 12, 8, ran=True)
    assert "8 of 12 layers" not in (cache_not_engaged(_cache(), 12, 8) or "")
    assert "11 of 12" in cache_not_engaged(_cache(layers=11), 12, 8)
    assert "expected 8" in cache_not_engaged(_cache(slots=4), 12, 8)
    assert cache_not_engaged(None, 12, 8) == "no cache section in /reap/status"
    # run 12's arm: auto on a pool of exactly every expert
    run12 = {"engaged": False, "mode": "device", "layers": {"0": {"engaged": False, "reason": "auto: 0"}},
             "reason": "--reap-cache-slots auto: 0 pool slot(s) beyond the pinned set"}  # fmt: skip
    assert "0 pool slot(s) beyond" in cache_not_engaged(run12, 12, 8)
    layer_off = _cache()
    layer_off["layers"]["3"] = {"engaged": False, "reason": "prepare/finalize x"}
    assert "11 of 12" in cache_not_engaged(layer_off, 12, 8) and "prepare/finalize" in cache_not_engaged(
        layer_off, 12, 8
    )


def test_decode_summary_without_stock_gives_no_ratio():
    s = decode_summary([{"arm": "reap", "serve": 0, "round": 0, "tok_s": 1.0}])
    assert s["arms"]["reap"]["vs_stock"]["pooled"] is None
    assert s["arms"]["reap"]["vs_stock"]["met_pooled"] is None


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
