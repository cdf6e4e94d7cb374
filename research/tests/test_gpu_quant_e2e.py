"""research/gpu/gpu_quant_e2e.py on CPU: argument parsing, the tiny dry run (checkpoints, plans, the
commands per case) and the summary on fake results. The servers themselves need the H200."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness_modules import load_script

qe = load_script("gpu_quant_e2e")


def test_unknown_case_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        qe.parse_args(["--out", "x", "--cases", "bf16,int3"])
    assert "int3" in capsys.readouterr().err


def test_dry_run_writes_checkpoints_plans_and_commands(tmp_path):
    assert qe.main(["--out", str(tmp_path), "--dry-run", "--tiny"]) == 0
    plans = json.loads((tmp_path / "dry_run.json").read_text())
    assert set(plans) == set(qe.CASES)
    for name, p in plans.items():
        reap, stock = p["commands"]["reap"], p["commands"]["stock"]
        assert ("--moe-backend" in reap) == p["binds"] == (name not in {"awq", "gptq", "ct-w4a16", "mxfp4"})
        assert "--no-enable-prefix-caching" in reap and "--enforce-eager" not in reap  # CUDA graphs on
        assert stock[stock.index("--model") + 2 :] == reap[4:] + qe.gpu_e2e.PROBE_EXTENSION
        plan = json.loads((tmp_path / f"plan-{name}.json").read_text())
        assert plan["budget"]["per_expert_bytes"] == p["plan_per_expert_bytes"]
    # online fp8: the plan counts bf16 experts, the pool moves fp8 payloads
    assert plans["fp8-online"]["plan_per_expert_bytes"] == 2 * plans["fp8-online"]["payload_bytes"]
    assert plans["fp8-online"]["commands"]["reap"][-2:] == ["--quantization", "fp8"]
    assert plans["awq"]["dtype"] == "float16" and "Marlin" in plans["awq"]["engine_refusal"]


def _probe(digest):
    return {"status": 200, "ranks": [{"inputs": {"seed": 0}, "layers": {"l0": {"1": digest, "8": "b"}}}]}


def _greedy(tok):
    return [{"text": "x", "tokens": ["a", tok], "logprobs": [0, 0]}]


def _fake(binds, tok="b", digest="a", copied=100):
    phases = {"0": {"greedy": _greedy("b"), "moe_probe": _probe("a")}}
    phases["25"] = {
        "greedy": _greedy(tok),
        "moe_probe": _probe(digest),
        "swap": {
            "status": 200,
            "bytes_copied": copied,
            "expected_bytes": 100 if binds else 0,
            "client_ms": 1.0,
        },
    }
    # /reap/status as the controller answers it: each worker's engine facts under workers[i].engine
    engine = {"unit_bytes": 6 * 2**20, "kept_whole_hbm_bytes": 16, "pool_slots": 256, "layers_rehomed": [0]}
    engine["refused_layers"] = {}
    if not binds:
        why = "<layout>: MarlinExperts implies the expert stride (= slab bytes, no padding)"
        engine = {
            "reason": "CUDA residency engine unavailable (RuntimeError: no MoE layer was re-homed ...)",
            "refused_layers": {"model.layers.0.mlp.experts": why, "model.layers.1.mlp.experts": why},
        }
    status = {"mode": "cuda" if binds else "accounting", "workers": [{"rank": 0, "engine": engine}]}
    return {
        "case": "c",
        "binds": binds,
        "payload_bytes": 4.5 * 2**20,
        "stock": {"greedy": _greedy("b"), "moe_probe": _probe("a")},
        "reap": {"phases": phases, "status_end": status},
    }


def test_summary_passes_identical_runs_and_fails_each_kind_of_difference():
    assert qe.case_row(_fake(True))["pass"]
    assert qe.case_row(_fake(False, copied=0))["pass"]  # refused: up on the stock path, reason recorded
    text = qe.case_row(_fake(True, tok="z"))
    assert not text["pass"] and text["text_differs"] == ["25"]
    probe = qe.case_row(_fake(True, digest="q"))
    assert not probe["pass"] and probe["probe_differs"] == ["25"]
    moved = qe.case_row(_fake(True, copied=50))
    assert not moved["pass"] and moved["bytes_mismatch"] == [100]
    crashed = _fake(False)
    crashed["reap"] = {"error": "ServerError('exited')"}
    assert not qe.case_row(crashed)["pass"]
    row = qe.case_row(_fake(True))
    assert row["unit_mib"] == 6 and row["gbps_client"] == [0.0] and row["pool_slots"] == 256
    assert row["kept_per_layer"] == 16
    md = qe.markdown({"wall_s": 1, "cases": {"a": _fake(True), "b": crashed}})
    assert "| c | bound | PASS |" in md and "| c | refused | FAIL |" in md and "exited" in md
    refused = qe.case_row(_fake(False, copied=0))
    assert refused["refusal"].startswith("layers 0,1: <layout>: MarlinExperts implies the expert stride")


def test_a_bound_format_with_a_refused_layer_fails():
    res = _fake(True)
    res["reap"]["status_end"]["workers"][0]["engine"]["refused_layers"] = {"model.layers.1.mlp.experts": "x"}
    assert qe.case_row(res)["verdict"] == "FAIL"


def test_stock_served_twice_tells_nondeterminism_from_a_reap_difference():
    differs = _fake(False, tok="z", copied=0)  # refused format, reap's text differs from stock's
    differs["stock2"] = {"greedy": _greedy("b"), "moe_probe": _probe("a")}  # stock == stock
    row = qe.case_row(differs)
    assert row["verdict"] == "FAIL" and row["stock_repeat"]["deterministic"]
    differs["stock2"]["greedy"][0]["logprobs"] = [0, -1e-5]  # stock's own logprobs vary
    row = qe.case_row(differs)
    assert row["verdict"] == "STOCK-NONDET" and not row["pass"] and not row["stock_repeat"]["deterministic"]
    assert "stock x2: NOT deterministic" in qe.markdown({"cases": {"c": differs}})
    same = _fake(False, copied=0)
    same["stock2"] = {"greedy": _greedy("b"), "moe_probe": _probe("a")}
    assert qe.case_row(same)["verdict"] == "PASS"


def _probe_at(**digests):
    return {
        "status": 200,
        "ranks": [{"inputs": {"seed": 0}, "layers": {"l0": {"1": "a", "8": "b", **digests}}}],
    }


def test_digests_that_differ_only_where_the_reap_process_varies_by_itself_are_kernel_nondet():
    """Run 18 (INT4 Marlin, m = 64): reap's own 0 and 0-after probes (same set, one process) differ at size 64,
    and every stock-vs-reap difference is at size 64: KERNEL-NONDET, with the differing digests in the note;
    a difference at another size, or one where reap is self-consistent, stays FAIL."""
    res = _fake(True)
    res["stock"]["moe_probe"] = _probe_at(**{"64": "s"})
    res["reap"]["phases"]["0"]["moe_probe"] = _probe_at(**{"64": "r1"})
    res["reap"]["phases"]["25"]["moe_probe"] = _probe_at(**{"64": "s"})
    res["reap"]["phases"]["0-after"] = {
        "greedy": _greedy("b"), "moe_probe": _probe_at(**{"64": "r2"}),
        "swap": {"status": 200, "bytes_copied": 0, "expected_bytes": 0, "client_ms": 1.0},
    }  # fmt: skip
    row = qe.case_row(res)
    assert row["reap_repeat"] == {"differ": ["l0@64"], "tokens": ["64"]}
    assert row["verdict"] == "KERNEL-NONDET" and not row["pass"]
    assert "reap 0 vs 0-after (same set, one process) differ at ['l0@64']" in qe.markdown(
        {"cases": {"c": res}}
    )
    res["reap"]["phases"]["25"]["moe_probe"] = _probe_at(**{"64": "s", "8": "other"})  # also at size 8
    assert qe.case_row(res)["verdict"] == "FAIL"
    res["reap"]["phases"]["25"]["moe_probe"] = _probe_at(**{"64": "s"})
    res["reap"]["phases"]["0-after"]["moe_probe"] = _probe_at(**{"64": "r1"})  # reap self-consistent
    row = qe.case_row(res)
    assert row["reap_repeat"]["differ"] == [] and row["verdict"] == "FAIL"
    res["reap"]["phases"]["25"]["greedy"] = _greedy("z")  # text differs too: never excused
    res["reap"]["phases"]["0-after"]["moe_probe"] = _probe_at(**{"64": "r2"})
    assert qe.case_row(res)["verdict"] == "FAIL"


def test_complete_checkpoints_are_reused(tmp_path, monkeypatch):
    a = qe.parse_args(
        ["--out", str(tmp_path), "--tiny", "--cases", "bf16,fp8-online,awq", "--ckpt-jobs", "1"]
    )
    written = []
    monkeypatch.setattr(qe.mqc, "main", lambda argv: written.append(argv[argv.index("--format") + 1]))
    for fmt in ("bf16", "awq"):
        (tmp_path / "checkpoints" / fmt).mkdir(parents=True)
    (tmp_path / "checkpoints" / "bf16" / "reap_quant_recipe.json").write_text(
        '{"format": "bf16", "layers": 2}'
    )
    (tmp_path / "checkpoints" / "awq" / "config.json").write_text("{}")  # a partial one: rewritten
    qe.write_checkpoints(a, ["bf16", "fp8-online", "awq"])
    assert written == ["awq"]  # fp8-online serves the bf16 checkpoint


def test_stock_twice_and_eager_pair_take_case_lists(capsys):
    a = qe.parse_args(["--out", "x"])
    assert a.stock_twice == "refused,fp8-online" and a.eager_pair == "fp8-online"
    assert qe.listed(a.stock_twice, "fp8-online", True) and qe.listed(a.stock_twice, "awq", False)
    assert not qe.listed(a.stock_twice, "fp8-block", True)
    assert qe.listed("all", "bf16", True) and not qe.listed("none", "awq", False)
    with pytest.raises(SystemExit):
        qe.parse_args(["--out", "x", "--stock-twice", "fp8-onlin"])
    assert "fp8-onlin" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        qe.parse_args(["--out", "x", "--eager-pair", "refused"])


def test_arms_per_case_and_the_fresh_compile_of_stock2(tmp_path, monkeypatch):
    """one_case's arms for fp8-online by default: stock, reap, stock2 (fresh compile), and the eager
    pair (both servers with --enforce-eager); fp8-block: stock and reap only."""
    calls = []
    monkeypatch.setattr(qe, "checkpoint", lambda a, fmt: tmp_path / fmt)
    monkeypatch.setattr(
        qe,
        "case_info",
        lambda name, model, group=None, unverified=False: {"binds": True, "dtype": "bfloat16"},
    )
    monkeypatch.setattr(
        qe, "run_stock", lambda argv, out, dl, name="stock", env=None: calls.append((name, argv, env)) or {}
    )
    monkeypatch.setattr(
        qe, "run_reap", lambda argv, m, out, info, dl, name="reap": calls.append((name, argv, None)) or {}
    )
    for case, want in (
        ("fp8-online", {"stock", "reap", "stock2", "stock_eager", "reap_eager"}),
        ("fp8-block", {"stock", "reap"}),
    ):
        calls.clear()
        a = qe.parse_args(["--out", str(tmp_path), "--one-case", case, "--serial-arms"])
        res = qe.one_case(a, case)
        assert {c[0] for c in calls} == want and want <= set(res)
    calls.clear()
    qe.one_case(qe.parse_args(["--out", str(tmp_path), "--serial-arms"]), "fp8-online")
    by = {c[0]: c for c in calls}
    assert by["stock2"][2] == qe.FRESH_COMPILE and by["stock"][2] is None
    assert by["stock_eager"][1][-1] == "--enforce-eager" and by["reap_eager"][1][-1] == "--enforce-eager"
    assert "--enforce-eager" not in by["stock"][1] and "--enforce-eager" not in by["reap"][1]


def test_eager_pair_summary():
    res = _fake(True)
    assert qe.case_row(res)["eager_pair"] is None
    res["stock_eager"] = {"greedy": _greedy("b")}
    res["reap_eager"] = {"phases": {"0": {"greedy": _greedy("b")}, "25": {"greedy": _greedy("b")}}}
    assert qe.case_row(res)["eager_pair"] == {
        "comparable": True, "text_differs": [], "logprobs_differ": [], "identical": True
    }  # fmt: skip
    res["reap_eager"]["phases"]["25"]["greedy"] = [
        {"text": "x", "tokens": ["a", "b"], "logprobs": [0, -1e-6]}
    ]
    row = qe.case_row(res)
    assert row["eager_pair"]["logprobs_differ"] == ["25"] and not row["eager_pair"]["identical"]
    assert "eager reap vs stock: differ" in qe.markdown({"cases": {"c": res}})
    res["reap_eager"] = {"error": "ServerError('exited')"}
    assert qe.case_row(res)["eager_pair"]["comparable"] is False
    assert qe.case_row(res)["pass"]  # the main verdict is stock vs reap with CUDA graphs


def test_decode_against_the_bound_per_phase():
    """--decode-tokens: tok/s per phase with the phase's router hit rate; t_resident from stock (no
    100 % phase here), t_all_missed from the 0 % phase, the other phases as ratios to the bound."""
    res = _fake(True)
    res["stock"]["decode_1"] = {"median": 500.0}  # 2 ms per token, every expert in HBM
    res["reap"]["phases"]["0"].update(
        decode_1={"median": 100.0}, router_misses={"totals": {"miss_ratio": 1.0}}
    )  # 10 ms: t_all_missed = 8 ms
    res["reap"]["phases"]["25"].update(
        decode_1={"median": 160.0}, router_misses={"totals": {"miss_ratio": 0.75}}
    )  # bound 1000 / (2 + 6) = 125 tok/s
    row = qe.case_row(res)
    b = row["bound"]
    assert b["t_resident_from"] == "stock" and b["t_resident_ms"] == 2.0 and b["t_all_missed_ms"] == 8.0
    assert b["rows"]["25"]["bound"] == 125.0 and b["rows"]["25"]["ratio"] == 1.28
    md = qe.markdown({"wall_s": 1, "cases": {"c": res}})
    assert "decode (1 stream) against" in md and "25: 0.250 / 160.0 / 1.280" in md
    assert "decode (1 stream)" not in qe.markdown({"wall_s": 1, "cases": {"c": _fake(True)}})


def _every_option_changed(tmp_path) -> list[str]:
    """The driver's command line with every option the child could need set away from its default (read
    from the parser itself, so a flag added later is covered too)."""
    seen: dict = {}

    def capture(self, *args, **kwargs):
        seen["parser"] = self
        raise SystemExit(0)

    orig = qe.argparse.ArgumentParser.parse_args
    qe.argparse.ArgumentParser.parse_args = capture
    try:
        with pytest.raises(SystemExit):
            qe.parse_args([])
    finally:
        qe.argparse.ArgumentParser.parse_args = orig
    ap = seen["parser"]
    argv = ["--out", str(tmp_path)]
    for act in ap._actions:
        opt = next((o for o in act.option_strings if o.startswith("--")), None)
        if opt in (None, "--help", "--out", "--one-case", "--cases", "--jobs", "--ckpt-jobs", "--dry-run"):
            continue
        if act.nargs == 0:
            argv.append(opt)
        elif act.choices:
            argv += [opt, next(c for c in act.choices if c != act.default)]
        elif act.dest in ("stock_twice", "eager_pair"):
            argv += [opt, "awq"]
        elif act.type in (int, float):
            argv += [opt, str(act.type(act.default or 0) + 3)]
        else:
            argv += [opt, "x"]
    return argv


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--reap-group-size", "auto", "--stock-twice", "all"],
        ["--reap-group-size", "8", "--decode-tokens", "16"],
        ["--layers", "12", "--decode-tokens", "64", "--serial-arms", "--tiny", "--eager-pair", "none"],
        None,  # every option away from its default
    ],
)
def test_child_gets_every_option_of_the_parent(tmp_path, argv):
    """Run 15's int4 phase passed its INT4 opt-in flag (since retired) to the driver, but the per-case
    child never got it, so every INT4 server refused: the child's options must equal the parent's."""
    full = _every_option_changed(tmp_path) if argv is None else ["--out", str(tmp_path), "--jobs", "1", *argv]
    parent = qe.parse_args(full)
    child_argv = qe.child_argv(parent, "awq")
    assert child_argv[1] == qe.__file__
    child = qe.parse_args(child_argv[2:])
    assert child.one_case == "awq"
    skip = {"one_case", "jobs", "cases", "ckpt_jobs", "dry_run"}  # the parent's alone
    for key, value in vars(parent).items():
        if key not in skip:
            assert getattr(child, key) == value, key
    # and the reap server's command line carries the group size when the child builds it
    info = {"binds": False, "dtype": "float16"}
    reap = qe.commands("awq", tmp_path, info, child)["reap"]
    assert ("--reap-group-size" in reap) == ("--reap-group-size" in full)
    if parent.reap_group_size:
        assert reap[reap.index("--reap-group-size") + 1] == parent.reap_group_size
        assert "--reap-group-size" in child_argv  # through the child process, not only the parent


def test_the_int4_phase_has_no_opt_in_flag_any_more(tmp_path):
    """Identity-order INT4 groups are the default (run 16): the driver no longer takes the retired
    opt-in, and the int4 phase of research/gpu/gpu_run.sh serves --reap-group-size auto alone."""
    with pytest.raises(SystemExit):
        qe.parse_args(["--out", str(tmp_path), "--reap-group-size", "auto", "--reap-unverified-int4-groups"])
    a = qe.parse_args(["--out", str(tmp_path), "--reap-group-size", "auto"])
    reap = qe.commands("awq", tmp_path, {"binds": True, "triton": False, "dtype": "float16"}, a)["reap"]
    assert reap[reap.index("--reap-group-size") :] == ["--reap-group-size", "auto"]
    run_sh = (Path(qe.__file__).parent / "gpu_run.sh").read_text()
    int4 = run_sh[run_sh.index("ph_int4() {") :]
    int4 = int4[: int4.index("\n}")]
    assert "--reap-group-size auto" in int4 and "unverified" not in int4
