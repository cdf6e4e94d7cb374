"""The skew bench harness (issue 17), on the CPU: the trace recorder's server argv
(research/gpu/gpu_skew_trace.py), the target summary (skew_bench_summary.py) and the driver's
schedule (gpu_skew_bench.py). Nothing here starts a server. Moved from tests/test_skewbench.py,
which keeps the bench's own cache-device flag and the vLLM-routed trace."""

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from harness_modules import load_script


def test_trace_script_server_argv():
    tr = load_script("gpu_skew_trace")
    argv = tr.server_argv("/tmp/skew", ["--dtype", "bfloat16"])
    assert argv[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "/tmp/skew"]
    assert argv[-3:] == ["127.0.0.1", "--no-enable-prefix-caching", "--enable-return-routed-experts"]
    assert "--enable-return-routed-experts" in argv and "--no-enable-prefix-caching" in argv
    assert argv.count("--host") == 1


# ----------------------------------------------------------------- the summary


def _run(arm, budget, d1, d8, h=None, cache_h=None, tokens=(1, 2, 3), reap=True, status="ok"):
    hit = {"hit_rate": h}
    if cache_h is not None:
        hit["cache_hit_rate"] = cache_h
        hit["cache_totals"] = {"hits": 9, "misses": 1}
    return {
        "arm": arm,
        "budget_bytes": budget,
        "reap": reap,
        "status": status,
        "hit_rate": hit,
        "stats": {
            "decode_tok_s_1": {"median": d1, "min": d1, "max": d1},
            "decode_tok_s_batch": {"median": d8},
        },
        "greedy": [{"tokens": list(tokens)}, {"tokens": [4, 5]}],
        "reap_status": {"cache": {"engaged": cache_h is not None}},
    }


def _report(runs, budget=50, identity="p50"):
    return {
        "model": {"total_expert_bytes": 100},
        "plan": {"identity": identity, "budget_bytes": budget},
        "config": {"batch": 8},
        "runs": runs,
    }


def test_summary_targets_and_bound():
    sm = load_script("skew_bench_summary")
    # t_res = 2 ms (500 tok/s); plan-static at h 0.75: 4 ms -> t_miss = (4 - 2) / 0.25 = 8 ms
    reports = [
        _report([_run("plan-cache", 50, 400.0, 2000.0, h=0.75, cache_h=0.95)]),
        _report([_run("plan-swap", 50, 300.0, 1000.0, h=0.9)]),
        _report([_run("resident", None, 500.0, 4000.0, h=1.0, reap=False)]),
        _report([_run("plan-static", None, 250.0, 2000.0, h=0.75)]),
        _report(
            [_run("plan-cache", 25, 200.0, 900.0, cache_h=0.5, tokens=(1, 2, 9))], budget=25, identity="p25"
        ),
        _report([_run("plan-swap", 25, 180.0, 1000.0, h=0.7, status="failed")], budget=25, identity="p25"),
    ]
    doc = sm.summarize(reports)
    b = doc["bound"]["decode_tok_s_1"]
    assert b["t_resident_ms"] == pytest.approx(2.0) and b["t_all_missed_ms"] == pytest.approx(8.0)
    assert "plan-static@50.0%" in b["t_all_missed_from"]
    rows = {(r["arm"], r["pct"]): r for r in doc["rows"]}
    # plan-cache@50: h = the cache's 0.95 -> bound 1000 / (2 + 0.05 * 8) = 416.7 tok/s
    assert rows[("plan-cache", 50.0)]["bound_decode_tok_s_1"] == pytest.approx(1000 / 2.4)
    assert rows[("plan-cache", 50.0)]["of_bound_decode_tok_s_1"] == pytest.approx(400 / (1000 / 2.4))
    assert rows[("plan-static", 50.0)]["of_bound_decode_tok_s_1"] == pytest.approx(1.0)
    t = {x["target"]: x for x in doc["targets"]}
    assert t["plan-cache / plan-swap, 1 stream, 50 %"]["value"] == pytest.approx(400 / 300)
    assert t["plan-cache / plan-swap, 1 stream, 50 %"]["met"] is True  # 1.33 >= 1.25
    assert t["plan-cache / plan-swap, batch, 50 %"]["met"] is True
    assert t["plan-cache greedy text = stock (resident), 50 %"]["value"] == "2/2"
    assert t["reach: plan-cache / resident, 1 stream, 50 %"]["value"] == pytest.approx(0.8)
    # 25 %: plan-swap failed -> not measured; the text differs at token 2 of prompt 0
    assert t["plan-cache / plan-swap, 1 stream, 25 %"]["met"] is None
    assert t["plan-cache greedy text = stock (resident), 25 %"]["met"] is False
    assert rows[("plan-cache", 25.0)]["text_vs_stock"]["first_divergence"] == [2, None]
    md = sm.markdown(doc)
    assert "| plan-cache / plan-swap, 1 stream, 50 % | 1.333 | >= 1.25 | yes |" in md
    assert "not measured" in md and "failed" in md


def test_summary_without_static_falls_back():
    sm = load_script("skew_bench_summary")
    rows = sm.rows_of([_report([_run("resident", None, 500.0, 4000.0, h=1.0, reap=False)])])
    t, src = sm.fit_t_miss(rows, "decode_tok_s_1", 2.0)
    assert t == pytest.approx(16.999) and "run 3" in src
    rows += sm.rows_of([_report([_run("stock-uva", 50, 100.0, 200.0, h=0.5, reap=False)])])
    t, src = sm.fit_t_miss(rows, "decode_tok_s_1", 2.0)
    assert t == pytest.approx((10.0 - 2.0) / 0.5) and "stock-uva" in src


def test_summary_main_reads_a_run_dir(tmp_path):
    import json

    sm = load_script("skew_bench_summary")
    for i, rep in enumerate([_report([_run("resident", None, 500.0, 4000.0, h=1.0, reap=False)])]):
        (tmp_path / f"b-{i}-x").mkdir()
        (tmp_path / f"b-{i}-x" / "bench.json").write_text(json.dumps(rep))
    (tmp_path / "trace").mkdir()
    greedy = [{"greedy": {"tokens": [1, 2, 3]}}, {"greedy": {"tokens": [4, 5]}}]
    trace_doc = {"splits": {"heldout": {"trace": "t.npz", "requests": 2, "per_request": greedy}}}
    (tmp_path / "trace" / "trace.json").write_text(json.dumps(trace_doc))
    assert sm.main([str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "skew_bench.json").read_text())
    assert doc["trace"]["trace_server_text_vs_resident"]["identical"] == 2
    assert (tmp_path / "skew_bench.md").read_text().startswith("| target |")


# ----------------------------------------------------------------- the driver's schedule


def _args(tmp_path, **kw):
    d = dict(out=tmp_path, src=Path("/tmp/model"), skew=Path("/tmp/skew"), startup_cap=300.0, repeats=3)
    return SimpleNamespace(**{**d, **kw})


def test_driver_jobs_in_measuring_order(tmp_path):
    dr = load_script("gpu_skew_bench")
    paths = {"p50": tmp_path / "p50.json", "p25": tmp_path / "p25.json"}
    jobs = dr.plan_jobs(_args(tmp_path), paths, 13.5)
    assert [j.name for j in jobs][:3] == ["cache50", "swap50", "resident"]
    assert [j.group for j in jobs] == ["A"] * 6 + ["B"] * 5
    by = {j.name: j for j in jobs}
    assert by["cache50"].argv[by["cache50"].argv.index("--budget-gib") + 1] == "6.750000"
    assert by["cache25"].argv[by["cache25"].argv.index("--plan") + 1] == str(paths["p25"])
    assert by["cache25"].argv[by["cache25"].argv.index("--arms") + 1] == "plan-cache"
    assert "--budget-gib" not in by["static50"].argv and "--budget-gib" not in by["resident"].argv
    for j in jobs:  # every job measures under its own lock, in its own folder, with a bounded start-up
        assert str(j.lock) in j.argv and "--startup-timeout" in j.argv
    order = load_script("skew_bench_summary")._job_order  # by number: b-10 after b-9
    assert sorted((j.out / "bench.json" for j in jobs if j.out.name.startswith("b-")), key=order) == [
        j.out / "bench.json" for j in jobs if j.out.name.startswith("b-")
    ]
    # the second stock resident, then all three (plan-swap+cache@50) measure last, with --no-25 too
    assert [j.name for j in jobs[-2:]] == ["resident2", "swapcache50"]
    assert jobs[-2].out.name == "b-10-resident2" and jobs[-1].out.name == "b-11-swapcache50"
    assert by["resident2"].argv[by["resident2"].argv.index("--arms") + 1] == "resident"
    assert "--budget-gib" not in by["resident2"].argv
    sc = by["swapcache50"].argv
    assert sc[sc.index("--arms") + 1] == "plan-swap+cache" and sc[sc.index("--budget-gib") + 1] == "6.750000"
    assert sc[sc.index("--plan") + 1] == str(paths["p50"])
    no25 = [j.name for j in dr.plan_jobs(_args(tmp_path), paths, 13.5, with_25=False)]
    assert no25[-3:] == ["uva50", "resident2", "swapcache50"]


class _Proc:
    def __init__(self, rc=None):
        self.returncode = rc

    def poll(self):
        return self.returncode


class _Holder:
    closed = False

    def close(self):
        self.closed = True


def test_driver_releases_one_lock_at_a_time_in_order(tmp_path):
    dr = load_script("gpu_skew_bench")
    jobs = dr.plan_jobs(_args(tmp_path), {"p50": tmp_path / "a", "p25": tmp_path / "b"}, 13.5, with_25=False)
    jobs = [j for j in jobs if j.group == "A"]
    holders = {j.name: _Holder() for j in jobs}
    for j in jobs:
        j.proc, j.log = _Proc(), tmp_path / f"{j.name}.log"
        j.log.write_text("starting\n")
    start = {"A": time.time()}
    dr.release_next(_args(tmp_path), jobs, holders, start)
    assert not any(j.released for j in jobs)  # nobody is up yet
    for j in jobs:
        j.log.write_text("[bench] x: healthy after 90s\n")
    dr.release_next(_args(tmp_path), jobs, holders, start)
    dr.release_next(_args(tmp_path), jobs, holders, start)
    assert [j.released for j in jobs] == [True] + [False] * 5  # the second waits for the first to end
    jobs[0].ended = time.time()
    dr.release_next(_args(tmp_path), jobs, holders, start)
    assert [j.released for j in jobs][:3] == [True, True, False]
    # a group whose start-up cap passed measures even if one server never came up
    jobs[1].ended = time.time()
    jobs[2].log.write_text("starting\n")
    dr.release_next(_args(tmp_path), jobs, holders, {"A": time.time() - 1000})
    assert jobs[2].released and "resident" not in holders


def test_driver_measures_nothing_while_another_group_starts(tmp_path):
    """guardfix: run 12 measured stock UVA@50 while group B's servers started; now the next job
    waits until they are up (or their start-up cap passed); --measure-during-startup: the old way."""
    dr = load_script("gpu_skew_bench")
    jobs = dr.plan_jobs(_args(tmp_path), {"p50": tmp_path / "a", "p25": tmp_path / "b"}, 13.5)
    by = {j.name: j for j in jobs}
    for j in jobs:
        j.log = tmp_path / f"{j.name}.log"
        if j.group == "A":
            j.proc = _Proc()
            j.log.write_text("healthy after 90s\n")
    for name in ("cache50", "swap50", "resident"):
        by[name].released, by[name].ended = True, time.time()
    for j in jobs:
        if j.group == "B":
            j.proc = _Proc()
            j.log.write_text("starting\n")
    now = time.time()
    holders = {j.name: _Holder() for j in jobs if not j.released}
    dr.release_next(_args(tmp_path), jobs, holders, {"A": now - 200, "B": now})
    assert not by["trace"].released  # group B is starting
    dr.release_next(_args(tmp_path, measure_during_startup=True), jobs, holders, {"A": now - 200, "B": now})
    assert by["trace"].released
    by["trace"].released = False
    holders["trace"] = _Holder()
    dr.release_next(_args(tmp_path), jobs, holders, {"A": now - 1000, "B": now - 1000})
    assert by["trace"].released  # B's start-up cap passed: measure anyway
    by["trace"].released = False
    holders["trace"] = _Holder()
    for j in jobs:
        if j.group == "B":
            j.log.write_text("healthy after 150s\n")
    dr.release_next(_args(tmp_path), jobs, holders, {"A": now - 200, "B": now})
    assert by["trace"].released


def test_summary_tells_stock_spread_from_ours():
    """resident-2 (folder b-N-resident2): each arm's text per prompt = resident / = resident-2 /
    differs from both, with bitwise logprobs and the prefill's first-logprob difference."""
    sm = load_script("skew_bench_summary")

    def greedy(run, lps):
        run["greedy"] = [{"tokens": t, "logprobs": lp} for t, lp in lps]
        return run

    a, b = ([1, 2, 3], [-1.0, -2.0]), ([4, 5], [-0.5, -0.1])
    a2 = ([1, 2, 3], [-1.01, -2.0])  # stock's own spread: same tokens, another prefill logprob
    reports = [
        _report([greedy(_run("resident", None, 500.0, 4000.0, h=1.0, reap=False), [a, b])]),
        _report([greedy(_run("plan-cache", 25, 400.0, 2000.0, cache_h=0.7), [a2, ([4, 6], [-0.5, -0.2])])],
                budget=25, identity="p25"),
        {**_report([greedy(_run("resident", None, 500.0, 4000.0, h=1.0, reap=False), [a2, ([4, 6], b[1])])]),
         "_job": "b-10-resident2"},
    ]  # fmt: skip
    doc = sm.summarize(reports)
    rows = {r["arm"]: r for r in doc["rows"]}
    assert rows["resident-2"]["pct"] == 100.0
    c = rows["plan-cache"]["text"]
    assert c["equal_resident"] == 1 and c["equal_resident_2"] == 2 and c["differs_from_both"] == 0
    assert c["vs_resident"]["logprobs_bitwise"] == 0
    assert c["vs_resident"]["first_logprob_max_abs_diff"] == pytest.approx(0.01)
    assert c["vs_resident_2"]["logprobs_bitwise"] == 1
    t = {x["target"]: x for x in doc["targets"]}
    assert t["plan-cache greedy text = stock (resident), 25 %"]["met"] is False
    assert t["plan-cache greedy text = resident or resident-2 (per prompt), 25 %"]["met"] is True
    assert t["stock's own spread: resident-2 greedy text = resident"]["value"] == "1/2"
    md = sm.markdown(doc)
    assert "| plan-cache | 25.0 | 1/2 (bitwise 0, d0 1.0e-02) | 2/2 (bitwise 1, d0 0.0e+00) | 0/2 |" in md
    assert "| resident | 100.0 | reference | 1/2" in md
    # without resident-2 nothing changes: no extra table, no extra targets
    doc1 = sm.summarize(reports[:2])
    assert "differs from both" not in sm.markdown(doc1)
    assert not any("resident-2" in x["target"] for x in doc1["targets"])


def test_summary_main_names_the_resident2_folder(tmp_path):
    import json

    sm = load_script("skew_bench_summary")
    for name in ("b-3-resident", "b-10-resident2"):
        (tmp_path / name).mkdir()
        rep = _report([_run("resident", None, 500.0, 4000.0, h=1.0, reap=False)])
        (tmp_path / name / "bench.json").write_text(json.dumps(rep))
    assert sm.main([str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "skew_bench.json").read_text())
    assert [r["arm"] for r in doc["rows"]] == ["resident", "resident-2"]
    assert "| resident-2 | 100.0 |" in (tmp_path / "skew_bench.md").read_text()


def test_driver_inductor_deterministic_env_for_every_job(tmp_path, monkeypatch):
    dr = load_script("gpu_skew_bench")
    monkeypatch.delenv("TORCHINDUCTOR_DETERMINISTIC", raising=False)
    assert "TORCHINDUCTOR_DETERMINISTIC" not in dr.job_env(_args(tmp_path))
    assert dr.job_env(_args(tmp_path, inductor_deterministic=True))["TORCHINDUCTOR_DETERMINISTIC"] == "1"
    assert dr.parse(["--inductor-deterministic"]).inductor_deterministic
    assert not dr.parse([]).inductor_deterministic and not dr.parse([]).measure_during_startup
