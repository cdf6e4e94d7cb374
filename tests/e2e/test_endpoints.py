"""Every REAP endpoint, chat through the OpenAI client around swaps, no-op, refresh limit, reset."""

import openai
import pytest

from .conftest import API_KEY, MODEL_NAME
from .helpers import misses, prefill, status, swap, unique_prompt


def chat(server, text: str) -> str:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY)
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": text}], max_tokens=8, temperature=0.0
    )
    assert out.choices[0].finish_reason in ("length", "stop")
    assert out.usage.completion_tokens >= 1
    return out.choices[0].message.content


def test_chat_completions_before_and_after_swaps(server, api):
    before = chat(server, "Hello, how are you today?")
    swap(api, "chat-1", {"layer_0": ["layer_0_slice_00"], "layer_3": [4, 5]})
    after_one = chat(server, "Hello, how are you today?")
    swap(
        api,
        "chat-2",
        {f"layer_{i}": [s for s in (f"layer_{i}_slice_00", f"layer_{i}_slice_01")] for i in range(4)},
    )
    after_two = chat(server, "Hello, how are you today?")
    # accounting mode moves no weights, so greedy output is unchanged by swaps
    assert before == after_one == after_two


def test_swap_response_shape(api):
    before = status(api)
    out = swap(api, "shape-1", {"layer_1": ["layer_1_slice_01", 0 + 9], "2": [0]})
    for key in (
        "signature",
        "previous_signature",
        "delta",
        "validation",
        "timing",
        "bytes_copied",
        "note",
        "forensics",
        "refresh_count",
        "mode",
        "swap_seq",
    ):
        assert key in out, key
    assert out["previous_signature"] == before["signature"]
    assert out["bytes_copied"] == 0 and "accounting mode" in out["note"]
    assert out["timing"]["total_seconds"] > 0 and "workers" in out["timing"]["phases"]
    assert (
        out["delta"]["totals"]["added"] + out["delta"]["totals"]["reused"]
        == out["validation"]["resident_experts"]
    )
    st = status(api)
    assert st["signature"] == out["signature"] and st["swap_count"] == before["swap_count"] + 1
    assert 9 in st["layers"]["1"] and 0 in st["layers"]["2"]
    assert st["last_swap_time"] is not None and st["workers_consistent"]


def test_same_signature_is_a_noop_that_says_so(api):
    first = swap(api, "noop-1", {"layer_2": ["layer_2_slice_02"]})
    again = swap(api, "noop-2", {"2": ["layer_2_slice_02"]})
    assert again["noop"] is True and again["signature"] == first["signature"]
    assert "no-op" in again["note"] and again["bytes_copied"] == 0
    assert again["delta"]["totals"]["added"] == 0 and again["delta"]["totals"]["removed"] == 0


def test_decode_refresh_limit_is_429_with_the_limit(api):
    swap(api, "refresh-1", {"layer_0": ["layer_0_slice_01"]})
    ok = swap(api, "refresh-1", {"layer_0": ["layer_0_slice_02"]}, phase="decode_refresh")
    assert ok["refresh_count"] == 1 and ok["max_refreshes_per_request"] == 1
    sig = status(api)["signature"]
    r = api.post(
        "/swap_active_set",
        json={
            "request_id": "refresh-1",
            "phase": "decode_refresh",
            "active_set": {"layer_0": ["layer_0_slice_00"]},
        },
    )
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["limit"] == 1 and err["type"] == "refresh_limit" and "1" in err["message"]
    assert status(api)["signature"] == sig  # refused: nothing changed
    # a new prefill of the same request id starts its refresh count again
    again = swap(api, "refresh-1", {"layer_0": ["layer_0_slice_00"]})
    assert again["refresh_count"] == 0


def test_warm_active_set_and_reset_router_stats(api):
    swap(api, "warm-1", {"layer_0": ["layer_0_slice_00"]}, path="/warm_active_set")
    prefill(api, unique_prompt("warm-1"))
    assert misses(api, "warm-1")["totals"]["observed_selections"] == 24 * 2 * 4
    out = swap(
        api, "warm-1", {"layer_0": ["layer_0_slice_00"]}, path="/warm_active_set", reset_router_stats=True
    )
    assert out["kind"] == "warm" and out["warm_start_only"] is True
    assert misses(api, "warm-1")["totals"]["observed_selections"] == 0


def test_router_misses_reset_query(api):
    swap(api, "reset-q", {})
    prefill(api, unique_prompt("reset-q"))
    first = misses(api, "reset-q", reset=True)
    assert first["reset"] is True and first["totals"]["observed_selections"] == 24 * 2 * 4
    assert misses(api, "reset-q")["totals"]["observed_selections"] == 0
    prefill(api, unique_prompt("reset-q-2"))
    assert misses(api, "reset-q")["totals"]["observed_selections"] == 24 * 2 * 4


def test_router_misses_of_a_closed_request_and_unknown_ids(api):
    swap(api, "closed-1", {})
    prefill(api, unique_prompt("closed-1"))
    swap(api, "closed-2", {})  # closes closed-1
    m = misses(api, "closed-1")
    assert m["open"] is False and m["totals"]["observed_selections"] == 24 * 2 * 4
    r = api.get("/router_misses/never-seen")
    assert r.status_code == 404 and r.json()["error"]["field"] == "request_id"


def test_forensics(api):
    out = swap(api, "forensic-1", {"layer_1": ["layer_1_slice_00"]})
    r = api.get("/forensics/forensic-1")
    assert r.status_code == 200, r.text
    rec = r.json()
    assert rec["plan_identity"] == status(api)["plan_identity"]
    assert rec["refresh_count"] == 0 and rec["last_swap"]["signature"] == out["signature"]
    assert rec["last_active_set"] == {"layer_1": ["layer_1_slice_00"]}
    assert api.get("/forensics/nobody").status_code == 404


def test_swap_cartridge(api):
    st = status(api)
    assert set(st["cartridges"]["defined"]) >= {"first-slices", "second-slices", "all"}
    r = api.post("/swap_cartridge/second-slices")
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["kind"] == "cartridge" and out["request_id"] == "cartridge:second-slices"
    assert out["validation"]["cartridge"] == "second-slices"
    again = api.post("/swap_cartridge/second-slices", json={"request_id": "cart-2"}).json()
    assert again["noop"] is True and again["validation"]["cartridge_was_loaded"] is True
    assert "second-slices" in status(api)["cartridges"]["loaded"]
    missing = api.post("/swap_cartridge/no-such-cartridge")
    assert missing.status_code == 404 and missing.json()["error"]["field"] == "cartridge_id"


def test_prometheus_metrics_on_vllm_metrics(api):
    swap(api, "metrics-1", {})
    prefill(api, unique_prompt("metrics-1"))
    swap(api, "metrics-2", {})  # reads (and credits) the counters
    text = api.get("/metrics").text
    values = {}
    for line in text.splitlines():
        if line.startswith("reap_swap_") and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    assert values['reap_swap_swaps_total{kind="swap",outcome="applied"}'] >= 2
    assert values["reap_swap_routed_selections_total"] >= 24 * 2 * 4
    assert "reap_swap_missed_selections_total" in values
    assert values['reap_swap_swap_seconds_count{kind="swap"}'] >= 2
    assert "reap_swap_bytes_copied_total" in values
    assert "vllm:" in text  # vLLM's own metrics are still there


@pytest.mark.parametrize("path", ["/v1/models", "/health"])
def test_vllm_routes_still_work(api, path):
    assert api.get(path).status_code == 200
