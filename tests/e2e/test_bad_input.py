"""Every class of bad input gets its documented 4xx naming the field; the server keeps serving."""

import pytest

from .conftest import MODEL_NAME
from .helpers import prefill, status, unique_prompt

GOOD = {"request_id": "bad-input", "active_set": {"layer_0": ["layer_0_slice_00"]}}

CASES = [
    # (id, body (bytes = raw), status, error type, field)
    ("malformed-json", b'{"request_id": "x", "active_set": {', 400, "invalid_json", "body"),
    ("not-an-object", b"[1, 2, 3]", 422, "invalid_request", "body"),
    ("empty-body", b"", 400, "invalid_json", "body"),
    ("missing-request-id", {"active_set": {}}, 422, "invalid_request", "request_id"),
    ("empty-request-id", {"request_id": "", "active_set": {}}, 422, "invalid_request", "request_id"),
    ("request-id-not-string", {"request_id": 7, "active_set": {}}, 422, "invalid_request", "request_id"),
    (
        "active-set-not-object",
        {"request_id": "x", "active_set": [1, 2]},
        422,
        "invalid_request",
        "active_set",
    ),
    (
        "expert-list-not-list",
        {"request_id": "x", "active_set": {"layer_0": 3}},
        422,
        "invalid_request",
        "active_set.layer_0",
    ),
    (
        "expert-float",
        {"request_id": "x", "active_set": {"layer_0": [1.5]}},
        422,
        "invalid_request",
        "active_set.layer_0[0]",
    ),
    (
        "expert-bool",
        {"request_id": "x", "active_set": {"layer_0": [True]}},
        422,
        "invalid_request",
        "active_set.layer_0[0]",
    ),
    (
        "unknown-field",
        {"request_id": "x", "active_set": {}, "activeset": {}},
        422,
        "invalid_request",
        "activeset",
    ),
    ("bad-phase", {"request_id": "x", "active_set": {}, "phase": "decode"}, 422, "invalid_request", "phase"),
    (
        "negative-budget",
        {"request_id": "x", "active_set": {}, "budget_bytes": -1},
        422,
        "invalid_request",
        "budget_bytes",
    ),
    (
        "unknown-layer",
        {"request_id": "x", "active_set": {"layer_9": [0]}},
        422,
        "invalid_active_set",
        "active_set.layer_9",
    ),
    (
        "malformed-layer-key",
        {"request_id": "x", "active_set": {"mlp.3": [0]}},
        422,
        "invalid_active_set",
        "active_set.mlp.3",
    ),
    (
        "out-of-plan-expert",
        {"request_id": "x", "active_set": {"layer_3": [2, 14]}},
        422,
        "invalid_active_set",
        "active_set.layer_3[1]",
    ),
    (
        "out-of-range-expert",
        {"request_id": "x", "active_set": {"layer_0": [16]}},
        422,
        "invalid_active_set",
        "active_set.layer_0[0]",
    ),
    (
        "negative-expert",
        {"request_id": "x", "active_set": {"0": [-1]}},
        422,
        "invalid_active_set",
        "active_set.0[0]",
    ),
    (
        "unknown-slice",
        {"request_id": "x", "active_set": {"layer_1": ["layer_0_slice_00"]}},
        422,
        "invalid_active_set",
        "active_set.layer_1[0]",
    ),
    (
        "over-budget",
        {"request_id": "x", "active_set": {"layer_0": ["layer_0_slice_00"]}, "budget_bytes": 1024},
        422,
        "budget_exceeded",
        "budget_bytes",
    ),
]


@pytest.mark.parametrize("path", ["/swap_active_set", "/warm_active_set"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_swap_payloads(api, path, case):
    _name, body, code, kind, field = case
    before = status(api)
    if isinstance(body, bytes):
        r = api.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = api.post(path, json=body)
    assert r.status_code == code, r.text
    err = r.json()["error"]
    assert err["type"] == kind and err["field"] == field, err
    assert field in err["message"], err["message"]
    after = status(api)
    assert after["signature"] == before["signature"] and after["swap_count"] == before["swap_count"]


def test_bad_query_and_cartridge_body(api):
    r = api.get("/router_misses/anything", params={"reset": "maybe"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "reset"
    r = api.post("/swap_cartridge/all", json={"request_id": 5})
    assert r.status_code == 422 and r.json()["error"]["field"] == "request_id"
    r = api.post("/swap_cartridge/all", content=b"{nope", headers={"Content-Type": "application/json"})
    assert r.status_code == 400


def test_server_keeps_serving_after_bad_input(api):
    for body in (b"{", b"null", b'{"request_id": 1}'):
        assert api.post("/swap_active_set", content=body).status_code in (400, 422)
    prefill(api, unique_prompt("after-bad-input"))
    r = api.post(
        "/v1/chat/completions",
        json={
            "model": MODEL_NAME,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "still there?"}],
        },
    )
    assert r.status_code == 200, r.text
    assert api.post("/swap_active_set", json=GOOD).status_code == 200


REAP_ROUTES = [
    ("post", "/swap_active_set", GOOD),
    ("post", "/warm_active_set", GOOD),
    ("get", "/router_misses/bad-input", None),
    ("get", "/forensics/bad-input", None),
    ("post", "/swap_cartridge/all", None),
    ("get", "/reap/status", None),
]


@pytest.mark.parametrize("method,path,body", REAP_ROUTES, ids=[r[1] for r in REAP_ROUTES])
@pytest.mark.parametrize(
    "auth", [None, "Bearer wrong-key", "Basic reap-e2e-key"], ids=["none", "wrong", "scheme"]
)
def test_api_key_guards_every_reap_route(server, method, path, body, auth):
    import httpx

    headers = {"Authorization": auth} if auth else {}
    before = None
    with server.client() as good:
        before = status(good)
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=60) as c:
        r = c.request(method.upper(), path, json=body)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["type"] == "unauthorized"
        assert c.get("/v1/models").status_code == 401  # vLLM's own guard, for comparison
        assert c.get("/health").status_code == 200
    with server.client() as good:
        assert status(good)["swap_count"] == before["swap_count"]
