"""The active-set client against the real server: every strategy round-trips, the probe's misses
match an independent recount, decode refresh, warm when already resident, --api-key, CLI."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys

import pytest

from reap_swap.client.reap_client import AsyncReapClient, ReapClient, ReapHTTPError
from reap_swap.client.strategies import STRATEGIES
from reap_swap.plan.active_set import signature
from reap_swap.plan.document import load_plan

from .conftest import API_KEY, MODEL_NAME, ROOT

WORDS = (
    "alpha bravo cedar delta ember fjord gamma harbor iris juniper kelp lumen maple nectar onyx "
    "prism quartz raven sable tundra umber violet willow xenon yarrow zephyr"
).split()
TOP_K = 2


def unique_text(seed: str, words: int = 14) -> str:
    """Random words: no two tests share a prompt, so prefix caching never shortens a prefill."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(words))


@pytest.fixture(scope="module")
def reap_server(server_pool):
    """The --api-key tp1 server (started again if another module switched the pool)."""
    return server_pool.get("tp1")


@pytest.fixture(scope="module")
def plan(tiny_moe):
    return load_plan(tiny_moe / "plan.json")


@pytest.fixture(scope="module")
def budget(plan):
    """Core plus 8 experts: two of the tiny plan's 4-expert slices, so strategies must choose."""
    return plan.core_bytes() + 8 * plan.per_expert_bytes


@pytest.fixture
def client(reap_server, tiny_moe, budget):
    with ReapClient(reap_server.base_url, API_KEY, plan=tiny_moe / "plan.json", budget_bytes=budget) as c:
        yield c


def _check_round_trip(client, plan, budget, result, messages):
    sel = result.selection
    assert sel.resident_bytes <= budget
    assert result.swap["signature"] == sel.signature
    status = client.status()
    assert status["signature"] == sel.signature and status["open_request"] == result.request_id
    assert {int(k): frozenset(v) for k, v in status["layers"].items()} == sel.resident
    assert result.completion["choices"][0]["message"]["content"] is not None
    usage = result.completion["usage"]
    assert usage["completion_tokens"] == 6
    misses = result.router_misses
    assert misses["request_id"] == result.request_id and misses["signature"] == sel.signature
    for layer, row in misses["layers"].items():
        # what missed is exactly what was outside the selection's keep-set
        assert not set(row["inactive_experts"]) & sel.resident[int(layer)]
        assert row["missed_selections"] <= row["observed_selections"]
        if sel.strategy != "probe":  # probe's own pass cached the prompt's prefix blocks
            assert (
                row["observed_selections"]
                == (usage["prompt_tokens"] + usage["completion_tokens"] - 1) * TOP_K
            )
    assert result.hit_rate is not None and 0.0 <= result.hit_rate <= 1.0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_strategy_round_trips(client, plan, budget, strategy):
    messages = [{"role": "user", "content": unique_text(f"rt-{strategy}")}]
    result = client.chat(
        messages,
        strategy=strategy,
        request_id=f"client-rt-{strategy}",
        max_tokens=6,
        temperature=0.0,
        ignore_eos=True,
    )
    _check_round_trip(client, plan, budget, result, messages)
    if strategy == "static":
        assert result.selection.slices == {}
    else:
        assert result.selection.slice_count >= 1
    if strategy == "probe":
        probe = result.probe
        assert probe["request_id"] == "client-rt-probe:probe" and probe["total_ms"] > probe["prefill_ms"] > 0
        assert probe["totals"]["observed_selections"] > 0 and probe["totals"]["missed_selections"] > 0
        assert probe["open"]["signature"] == signature(plan.core_sets())  # core only during the probe
        assert result.timings_ms["probe_ms"] == probe["total_ms"]


def test_probe_misses_match_an_independent_recount(client, plan, budget, recount, tiny_moe):
    """The probe pass runs with only the core resident: its misses must be exactly the experts
    outside the core that HF's own router picks for the chat-templated prompt."""
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": unique_text("probe-recount", 20)}]
    result = client.chat(
        messages, strategy="probe", request_id="client-probe-recount", max_tokens=2, temperature=0.0
    )
    tok = AutoTokenizer.from_pretrained(tiny_moe / "model")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids if isinstance(ids, list) else ids["input_ids"])  # transformers 5: a BatchEncoding
    assert result.completion["usage"]["prompt_tokens"] == len(ids)
    counted = recount.counts(ids)
    probe = client.router_misses(result.probe["request_id"])
    assert probe["open"] is False  # closed when the real request was opened
    chosen_experts = set()
    for layer, counts in counted.items():
        core = plan.layers[layer].core
        expected = [e for e, c in enumerate(counts) if c > 0 and e not in core]
        row = probe["layers"][str(layer)]
        assert row["inactive_experts"] == expected
        assert row["observed_selections"] == len(ids) * TOP_K
        assert row["missed_selections"] == sum(counts[e] for e in expected)
        chosen_experts |= {
            (layer, e)
            for sid in result.selection.slices.get(layer, ())
            for e in plan.layers[layer].slice_by_id[sid].experts
        }
    # the first slice probe took covers something the prompt really routed to and missed
    first_layer, first_ids = next(iter(result.selection.slices.items()))
    first = plan.layers[first_layer].slice_by_id[first_ids[0]]
    assert any(counted[first_layer][e] > 0 and e not in plan.layers[first_layer].core for e in first.experts)


def test_already_active_signature_opens_with_warm_not_swap(client):
    text = unique_text("warm-1")
    first = client.chat(
        [{"role": "user", "content": text}], strategy="static", request_id="client-warm-1", max_tokens=2
    )
    second = client.chat(
        [{"role": "user", "content": unique_text("warm-2")}],
        strategy="static",
        request_id="client-warm-2",
        max_tokens=2,
    )
    assert first.selection.signature == second.selection.signature
    assert second.swap["opened_with"].startswith("warm") and second.swap["noop"] is True
    assert second.swap["kind"] == "warm" and second.swap["bytes_copied"] == 0
    # the warm call still attributes the request's statistics to its id
    assert second.router_misses["request_id"] == "client-warm-2"
    assert second.router_misses["totals"]["observed_selections"] > 0


def test_decode_refresh_swaps_mid_stream_within_the_limit(client, plan):
    messages = [{"role": "user", "content": unique_text("refresh")}]
    result = client.chat(
        messages,
        strategy="static",
        request_id="client-refresh",
        max_tokens=24,
        temperature=0.0,
        ignore_eos=True,
        refresh_every=4,
    )
    swapped = [r for r in result.refreshes if r["swapped"]]
    assert len(swapped) == plan.max_refreshes_per_request == 1
    r = swapped[0]
    assert r["swap"]["phase"] == "decode_refresh" and r["swap"]["refresh_count"] == 1
    assert r["misses_so_far"]["missed_selections"] > 0  # static: core only, the request missed
    assert result.completion["usage"]["completion_tokens"] == 24
    assert len(result.answer) > 0
    assert client.forensics("client-refresh")["refresh_count"] == 1
    assert client.status()["signature"] == r["selection"]["signature"] == r["swap"]["signature"]
    # statistics of the whole request (before and after the refresh) stay with its id
    usage = result.completion["usage"]
    for row in result.router_misses["layers"].values():
        assert row["observed_selections"] == (usage["prompt_tokens"] + usage["completion_tokens"] - 1) * TOP_K


def test_async_client_round_trip(reap_server, tiny_moe, budget):
    async def go():
        async with AsyncReapClient(
            reap_server.base_url, API_KEY, plan=tiny_moe / "plan.json", budget_bytes=budget
        ) as c:
            result = await c.chat(
                [{"role": "user", "content": unique_text("async")}],
                strategy="prior",
                request_id="client-async",
                max_tokens=3,
            )
            status = await c.status()
            return result, status, await c.forensics("client-async")

    result, status, record = asyncio.run(go())
    assert status["signature"] == result.selection.signature
    assert record["last_swap"]["signature"] == result.selection.signature
    assert result.router_misses["totals"]["observed_selections"] > 0


def test_api_key_is_sent_and_required(reap_server, tiny_moe):
    with ReapClient(reap_server.base_url, None, plan=tiny_moe / "plan.json") as anonymous:
        with pytest.raises(ReapHTTPError) as err:
            anonymous.status()
        assert err.value.status == 401 and err.value.type == "unauthorized"
        with pytest.raises(ReapHTTPError) as err:
            anonymous.chat(
                [{"role": "user", "content": "hi"}], strategy="static", model=MODEL_NAME, max_tokens=1
            )
        assert err.value.status == 401
    with ReapClient(reap_server.base_url, "wrong-key", plan=tiny_moe / "plan.json") as wrong:
        with pytest.raises(ReapHTTPError):
            wrong.router_misses("client-rt-static")


def test_plan_mismatch_is_refused(reap_server, tiny_moe, tmp_path):
    doc = json.loads((tiny_moe / "plan.json").read_text())
    doc["model"] = "something else"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(doc))
    with ReapClient(reap_server.base_url, API_KEY, plan=other) as c:
        with pytest.raises(ValueError, match="serves plan"):
            c.chat([{"role": "user", "content": "x"}], strategy="static", max_tokens=1)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "reap_swap.cli", *args], capture_output=True, text=True, cwd=ROOT, timeout=300
    )


def test_cli_chat_and_probe_select_with_api_key(reap_server, tiny_moe, budget):
    out = _cli(
        "chat",
        "--server",
        reap_server.base_url,
        "--api-key",
        API_KEY,
        "--plan",
        str(tiny_moe / "plan.json"),
        "--prompt",
        unique_text("cli-chat"),
        "--strategy",
        "prior",
        "--max-tokens",
        "3",
        "--budget-bytes",
        str(budget),
        "--request-id",
        "client-cli-chat",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert (
        doc["request_id"] == "client-cli-chat" and doc["swap"]["signature"] == doc["selection"]["signature"]
    )
    assert doc["router_misses"]["totals"]["observed_selections"] > 0
    text = _cli(
        "chat",
        "--server",
        reap_server.base_url,
        "--api-key",
        API_KEY,
        "--prompt",
        unique_text("cli-2"),
        "--strategy",
        "static",
        "--max-tokens",
        "2",
    )
    assert text.returncode == 0, text.stderr  # plan read from the server's plan file
    assert "router misses:" in text.stdout and "swap:" in text.stdout
    denied = _cli(
        "chat", "--server", reap_server.base_url, "--prompt", "x", "--plan", str(tiny_moe / "plan.json")
    )
    assert denied.returncode == 1 and "401" in denied.stderr
    sel = _cli(
        "select",
        "--plan",
        str(tiny_moe / "plan.json"),
        "--strategy",
        "probe",
        "--server",
        reap_server.base_url,
        "--api-key",
        API_KEY,
        "--prompt",
        unique_text("cli-select"),
        "--budget-bytes",
        str(budget),
        "--request-id",
        "client-cli-select",
        "--json",
    )
    assert sel.returncode == 0, sel.stderr
    doc = json.loads(sel.stdout)
    assert doc["payload"]["request_id"] == "client-cli-select" and doc["probe"]["prefill_ms"] > 0
    assert doc["selection"]["resident_bytes"] <= budget
