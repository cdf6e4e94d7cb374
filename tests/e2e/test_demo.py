"""`make demo`'s script against the real server: both answers, two swap summaries, miss ratios, no leftovers.

Why a subprocess: the demo is what a new user runs; it must work as a program (its own server in
its own process group, its own shutdown), not only as functions. The pool's server is stopped
first so that at most one server of ours runs at a time (2-core CI machine).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from .conftest import ROOT, group_alive, launcher_env

pytestmark = pytest.mark.e2e
DEMO_TIMEOUT_S = 900  # server start-up is 40-180 s on 2 cores; two short requests


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2] != "Z"


def test_demo_end_to_end(server_pool, tmp_path):
    server_pool.stop()
    out_json = tmp_path / "demo.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "scripts" / "demo.py"),
            "--json-out",
            str(out_json),
            "--log-dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=launcher_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=DEMO_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # the demo shuts its server down on SIGTERM
        output, _ = proc.communicate(timeout=60)
        pytest.fail(f"demo ran past {DEMO_TIMEOUT_S}s:\n{output.decode(errors='replace')[-4000:]}")
    text = output.decode(errors="replace")
    assert proc.returncode == 0, text[-6000:]

    # every step, in order
    steps = [m.group(0) for m in re.finditer(r"^\[\d/5\] .*$", text, re.M)]
    assert [s[:5] for s in steps] == ["[1/5]", "[2/5]", "[3/5]", "[4/5]", "[5/5]"], steps
    assert "python prompt" in steps[2] and "prose prompt" in steps[3]
    assert "mode 'accounting'" in text and "accounting mode" in text

    # two swap summaries, each with bytes copied 0 and the server's reason
    assert text.count("swap summary (POST /swap_active_set") == 2
    assert (
        len(
            re.findall(
                r"bytes copied  : 0\n\s+why\s+: accounting mode: .*no expert weights were copied", text
            )
        )
        == 2
    )
    # two answers and two router-miss ratios
    assert text.count("] answer (") == 2
    ratios = re.findall(r"router-miss ratio: (\d+)/(\d+) = ([\d.]+) %", text)
    assert len(ratios) == 2
    assert text.count("count check:") == 2 and text.count("selections: yes") == 2
    assert "next steps" in text and "python -m reap_swap.server" in text and "reap-swap plan" in text

    result = orjson.loads(out_json.read_bytes())
    requests = result["requests"]
    assert [r["domain"] for r in requests] == ["python", "prose"]
    for r, (missed, observed, pct) in zip(requests, ratios):
        assert r["answer"].strip(), f"{r['domain']}: empty answer"
        assert r["counts_exact"]
        assert (r["missed"], r["observed"]) == (int(missed), int(observed))
        assert 0.0 <= r["router_miss_ratio"] < 1.0 and abs(100 * r["router_miss_ratio"] - float(pct)) < 0.051
        assert r["router_miss_ratio"] <= r["core_only_miss_ratio"]  # swapped-in slices cannot add misses
        swap = r["swap"]
        assert swap["mode"] == "accounting" and swap["bytes_copied"] == 0
        assert swap["signature"] != swap["previous_signature"] and swap["delta"]["added"] > 0

    # nothing left: the demo's own group, and every server process it recorded
    assert not group_alive(proc.pid)
    assert result["server_pids"] and not [p for p in result["server_pids"] if _alive(p)]
    assert "verified: none of those processes is alive" in text
