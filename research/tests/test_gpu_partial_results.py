"""The summarisers of the next leases' phases on results cut by a phase's cap (branch gpureview):
files cut mid-write, arms that never started, samples of one arm only. CPU only."""

import json

from harness_modules import load_script


def test_skew_summary_leaves_out_a_cut_bench_json_and_names_it(tmp_path):
    sm = load_script("skew_bench_summary")
    (tmp_path / "b-1-cache50").mkdir()
    (tmp_path / "b-1-cache50" / "bench.json").write_text('{"runs": [{"arm": "plan-ca')  # cut
    (tmp_path / "b-2-swap50").mkdir()
    (tmp_path / "b-2-swap50" / "bench.json").write_text(
        json.dumps({"runs": [{"arm": "plan-swap", "status": "failed", "error": "not healthy"}]})
    )
    (tmp_path / "trace").mkdir()
    (tmp_path / "trace" / "trace.json").write_text('{"splits": ')  # cut
    assert sm.main([str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "skew_bench.json").read_text())
    assert sorted(doc["unreadable"]) == [
        str(tmp_path / "b-1-cache50" / "bench.json"),
        str(tmp_path / "trace" / "trace.json"),
    ]
    assert [r["arm"] for r in doc["rows"]] == ["plan-swap"]
    md = (tmp_path / "skew_bench.md").read_text()
    assert "Unreadable (left out)" in md and "not measured" in md


def test_skew_summary_of_an_empty_run_dir(tmp_path):
    sm = load_script("skew_bench_summary")
    assert sm.main([str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "skew_bench.json").read_text())
    assert doc["rows"] == [] and "unreadable" not in doc


def test_quant_rows_of_a_timed_out_case_and_of_a_case_with_one_arm():
    load_script("families_report")  # quant_cases imports it as research/gpu/ on sys.path would
    qc = load_script("quant_cases")
    cut = {"case": "awq", "case_rc": 124, "timed_out": True, "case_wall_s": 330.0}
    one = {
        "case": "gptq", "binds": True, "payload_bytes": 2**20,
        "stock": {"error": "ServerError('stock: not healthy after 300s')"},
        "reap": {"phases": {"0": {"greedy": [], "decode_1": {"median": 10.0}}}},
    }  # fmt: skip
    doc = {"wall_s": 400.0, "cases": {"awq": cut, "gptq": one}}
    doc["rows"] = [qc.case_row(r) for r in doc["cases"].values()]
    md = qc.markdown(doc)
    assert "TIMED OUT" in md and "not healthy" in md


def test_family_merge_with_only_the_meta(tmp_path):
    gf = load_script("gpu_families")
    out = tmp_path / "gpt_oss_20b"
    out.mkdir()
    (out / "meta.json").write_text(json.dumps({"shape": {"moe_layers": [0, 1], "experts": 32}}))
    doc = gf.merge(out, "gpt_oss_20b")
    assert doc["family"] == "gpt_oss_20b"


def test_gpu_guards_summarises_what_a_sigterm_cut_serve_sampled(tmp_path, monkeypatch):
    """`timeout` cuts serve 1 mid-round (SIGTERM -> SystemExit): guards.json keeps every sample,
    with the summary, guards.md and the reason (before: only the per-serve guards.json, no summary)."""
    import shutil

    import pytest
    import test_gpu_guards as tg

    guards = load_script("gpu_guards")
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(tg.DATA / "mixtral_tiny_cpu_config.json", model / "config.json")
    tg._FakeServer.started, tg._FakeServer.stopped = [], []
    calls = []

    def decode(url, tokens, prompt):
        calls.append(url)
        if len(calls) > 3 + 3 * 3 + 3 + 1:  # serve 0: 3 warm-ups + 3 x 3; serve 1: 3 warm-ups + 1 sample
            raise SystemExit(143)
        return 700.0

    monkeypatch.setattr(guards.serving, "Server", tg._FakeServer)
    monkeypatch.setattr(guards, "one_decode", decode)
    layers = len(tg.read_model_shape(model).moe_layers)
    monkeypatch.setattr(guards, "reap_facts", lambda url: {"cache": tg._cache(layers=layers)})
    out = tmp_path / "out"
    argv = ["gpu_guards", "--model", str(model), "--out", str(out), "--serves", "3", "--rounds", "3"]
    argv += ["--warmup", "1"]
    monkeypatch.setattr("sys.argv", argv)
    tg._URLS.clear()
    with pytest.raises(SystemExit):
        guards.main()
    doc = json.loads((out / "guards.json").read_text())
    assert len(doc["samples"]) == 3 * 3 + 1 and "SIGTERM" in doc["cut"]
    assert doc["summary"]["arms"]["stock"]["pooled"]["n"] == 4
    assert sorted(tg._FakeServer.stopped) == sorted(tg._FakeServer.started)
    assert (out / "guards.md").read_text().startswith("| arm |")


def test_quant_driver_cut_by_its_cap_writes_the_summary_and_starts_no_queued_case(tmp_path, monkeypatch):
    """gpu_run.sh's INT4_CAP / QUANT_CAP SIGTERMs the driver while a case runs (--jobs 1): no queued
    case starts after that, and quant_e2e.json / .md still come out (before: none, only
    cases/*.json), the cut case from its own cases/*.json."""
    import os
    import signal
    import time

    import pytest

    from reap_swap.bench import server_driver as serving

    qe = load_script("gpu_quant_e2e")
    monkeypatch.setattr(qe, "write_checkpoints", lambda a, names: None)
    spawned = []

    def spawn(a, name):
        spawned.append(name)
        if name == "gptq":
            (a.out / "cases").mkdir(parents=True, exist_ok=True)
            (a.out / "cases" / "gptq.json").write_text(json.dumps({"case": "gptq", "stock": {"greedy": []}}))
            os.kill(os.getpid(), signal.SIGTERM)  # `timeout`, while this case's child still runs
            time.sleep(0.5)
        return {"case": name, "binds": True, "case_rc": 0}

    monkeypatch.setattr(qe, "spawn", spawn)
    previous = signal.getsignal(signal.SIGTERM)
    serving.stop_servers_on_sigterm()
    try:
        with pytest.raises(SystemExit):
            qe.main(["--out", str(tmp_path), "--cases", "awq,gptq,ct-w4a16", "--jobs", "1"])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert spawned == ["awq", "gptq"]
    doc = json.loads((tmp_path / "quant_e2e.json").read_text())
    assert list(doc["cases"]) == ["awq", "gptq", "ct-w4a16"]
    assert not doc["cases"]["awq"].get("timed_out") and doc["cases"]["gptq"]["timed_out"]
    assert doc["cases"]["gptq"]["stock"] == {"greedy": []} and doc["cases"]["ct-w4a16"]["timed_out"]
    assert (tmp_path / "quant_e2e.md").read_text().count("TIMED OUT") == 2


def test_a_refused_residency_swap_records_the_set_still_held(monkeypatch):
    """gpu_families.reap_steps: a swap answered 422 (capacity_exceeded beside the device cache's
    tails, run 26's tiny Qwen3.5) leaves the previous set, so the phase's `resident` is that set and
    `asked` what the phase wanted (before: the asked count, as if the swap had applied)."""
    from types import SimpleNamespace

    gf = load_script("gpu_families")
    plan = {"perLayer": {}, "budget": {"per_expert_bytes": 1, "swappable_expert_budget_bytes": 100}}
    points = [("25", {"a": 1}), ("100", {"a": 4}), ("again", {})]
    sizes = {"{}": 0, "{'a': 1}": 8, "{'a': 4}": 32}
    monkeypatch.setattr(gf.fr, "phases", lambda plan, experts: points)
    monkeypatch.setattr(gf.fr, "resident_count", lambda plan, active: sizes[str(active)])
    monkeypatch.setattr(gf.fr, "startup_label", lambda plan: "0")
    status = {"p-25": 200, "p-100": 422, "p-again": 200}
    fake = SimpleNamespace(
        status=lambda srv: {}, collective_rpc=lambda srv, m: [], open_request=lambda srv, rid: None,
        measure=lambda srv, rid, d1, d8: {}, moe_probe=lambda srv, tag: {},
        swap=lambda srv, rid, active: {"status": status[rid]},
    )  # fmt: skip
    monkeypatch.setattr(gf, "e2e", fake)
    monkeypatch.setattr(gf, "counters_under_graphs", lambda srv, shape: {})
    monkeypatch.setattr(gf, "readme_curl", lambda srv, plan, shape: None)
    res = {"reap": {"phases": {}}}
    args = SimpleNamespace(count_lengths=None, count_only=False, decode=1)
    gf.reap_steps(None, plan, {"experts": 4}, res, args, lambda: None)
    got = {k: (p["resident"], p.get("asked")) for k, p in res["reap"]["phases"].items()}
    assert got == {"0": (0, None), "25": (8, 8), "100": (8, 32), "again": (0, 0)}
