"""`reap-swap accept` end to end on the tiny model with vLLM's CPU build: stock vLLM, then the reap
server with the plan (and, separately, with no plan), small sizes; the verdict must be a pass, and
the report must hold what the verdict was computed from.

Named test_zy_* so it runs after the tests that share the pool's servers: accept starts its own
servers (one at a time), and the pool's server is stopped first so that never two of ours run at
once. The vLLM arguments include --enforce-eager (the user's choice, passed through to both
servers): every server compiles into its own empty cache, which costs a minute per server on the
CI's two cores; the compiled default is left to the GPU run.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import ROOT, launcher_env

pytestmark = pytest.mark.e2e

VLLM_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory-bytes", str(256 << 20)]
VLLM_ARGS += ["--enforce-eager"]
PROMPTS, TOKENS, STORM = 2, 16, 16


def accept(out, model, *options: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    argv = [sys.executable, "-m", "reap_swap.cli", "accept", str(model), *options]
    argv += ["--out", str(out), "--no-progress", "--startup-timeout", "600", "--", *VLLM_ARGS]
    proc = subprocess.run(argv, cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=1200)
    left = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    return proc, left


@pytest.fixture(scope="module")
def with_plan(tiny_moe, server_pool, tmp_path_factory):
    server_pool.stop()  # accept starts its own servers; never two at once
    out = tmp_path_factory.mktemp("accept") / "out"
    sizes = ["--prompts", str(PROMPTS), "--tokens", str(TOKENS), "--storm", str(STORM)]
    proc, left = accept(out, tiny_moe / "model", "--plan", str(tiny_moe / "plan.json"), *sizes)
    return proc, out, left


def test_accept_passes_and_leaves_no_server(with_plan):
    proc, out, left = with_plan
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert not left, f"accept's server processes survived: {left}"
    table = proc.stdout.splitlines()
    assert table[-1].startswith("PASS: every phase equals stock vLLM bit for bit")
    assert sum(line.startswith("reap ") and line.rstrip().endswith("equal") for line in table) == 4
    assert (out / "accept.md").read_text().startswith("# reap-swap accept\n\n**PASS")


def test_every_phase_equals_the_reference_in_the_report(with_plan):
    _proc, out, _left = with_plan
    report = json.loads((out / "accept.json").read_text())
    assert report["verdict"] == {**report["verdict"], "pass": True, "failures": []}
    stock, reap = report["arms"]["stock"], report["arms"]["reap"]
    ref = stock["quiet"]
    assert len(ref) == PROMPTS and all(len(c["tokens"]) == len(c["logprobs"]) == TOKENS for c in ref)
    assert all(t.startswith("token_id:") for t in ref[0]["tokens"])
    for phase in ("quiet", "during", "after", "after_storm"):
        # recomputed here from the raw records: the same ids and the same doubles (json reads both
        # servers' numbers the same way, so equal text means equal floats)
        assert [c["tokens"] for c in reap[phase]] == [c["tokens"] for c in ref], phase
        assert [c["logprobs"] for c in reap[phase]] == [c["logprobs"] for c in ref], phase
        assert all(c["tok_s"] > 0 for c in reap[phase])


def test_load_commands_and_caches(with_plan):
    _proc, out, _left = with_plan
    report = json.loads((out / "accept.json").read_text())
    stock, reap = report["arms"]["stock"], report["arms"]["reap"]
    assert reap["swaps"]["posted"] >= 1
    assert all(int(code) < 500 for code in reap["swaps"]["codes"])
    codes = reap["storm"]["codes"]
    assert sum(codes.values()) == STORM and all(code.isdigit() and int(code) < 500 for code in codes)
    assert any(code in codes for code in ("400", "422"))  # the malformed payloads were refused
    assert reap["status"]["plan_given"] is True and "totals" in reap["cache"]
    for arm in (stock, reap):
        assert "--no-enable-prefix-caching" in arm["command"] and "--enforce-eager" in arm["command"]
    assert "--reap-plan" in reap["command"] and "-m" in stock["command"]
    assert "reap_swap.server" not in stock["command"]
    for name in ("stock", "reap"):  # every server compiled into its own cache
        assert any((out / "vllm-cache" / name).iterdir())
        assert (out / "logs" / f"{name}.server.log").stat().st_size > 0


def test_without_a_plan(tiny_moe, server_pool, tmp_path):
    server_pool.stop()
    out = tmp_path / "out"
    proc, left = accept(out, tiny_moe / "model", "--prompts", "1", "--tokens", "8", "--storm", "9")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert not left
    report = json.loads((out / "accept.json").read_text())
    reap = report["arms"]["reap"]
    assert "--reap-plan" not in reap["command"] and reap["status"]["plan_given"] is False
    assert report["plan"] is None and report["verdict"]["pass"]
    assert reap["swaps"]["codes"].get("200", 0) >= 1  # expert ids of the bare plan are accepted
