"""reap-swap simulate: table, JSON and plot from a trace file; bad inputs exit 2 naming the field."""

import orjson
from test_simulate import PLAN, mini_trace

from reap_swap.cache.replay import POLICIES
from reap_swap.cache.trace import save_trace
from reap_swap.cli import main as cli


def test_simulate_cli_writes_table_json_and_plot(tmp_path, capsys):
    trace = tmp_path / "t.npz"
    save_trace(trace, mini_trace(3))
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    argv = [
        "simulate",
        "--trace",
        str(trace),
        "--plan",
        PLAN,
        "--budget",
        "0.25",
        "0.5",
        "--json",
        str(out_json),
    ]
    rc = cli.main(argv + ["--plot", str(out_png), "--per-layer"])
    text = capsys.readouterr().out
    assert rc == 0
    assert "| 0.5 | 10/9/7/6 | lfu |" in text and "| 0.25 | 4/4/4/4 | static | refused:" in text
    assert "| budget | policy | layer 0 |" in text
    report = orjson.loads(out_json.read_bytes())
    assert report["trace"]["requests"] == 3 and len(report["rows"]) == 2 * len(POLICIES)
    belady = next(r for r in report["rows"] if r["policy"] == "belady" and r["budget"] == "0.5")
    assert set(belady["layers"]) == {"0", "1", "2", "3"} and belady["totals"]["expert_hit_rate"] > 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_cli_refuses_bad_inputs(tmp_path, capsys):
    bad = tmp_path / "bad.npz"
    bad.write_text("not a trace")
    assert cli.main(["simulate", "--trace", str(bad), "--budget", "0.5"]) == 2
    assert "not a readable .npz trace" in capsys.readouterr().err
    trace = tmp_path / "t.npz"
    save_trace(trace, mini_trace(1))
    assert cli.main(["simulate", "--trace", str(trace), "--budget", "3"]) == 2
    assert "--budget 3" in capsys.readouterr().err
    plan = tmp_path / "p.json"
    plan.write_text("{")
    assert cli.main(["simulate", "--trace", str(trace), "--plan", str(plan), "--budget", "0.5"]) == 2
    assert "not valid JSON" in capsys.readouterr().err
