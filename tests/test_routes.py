"""REAP routes on a bare FastAPI app with fake workers: status codes, field names, auth, 5xx on a
failing worker, the plugin's init_state."""

import asyncio
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from reap_fakes import PLAN, FakeEngine

from reap_swap.config.settings import ADDITIONAL_CONFIG_KEY
from reap_swap.server.controller import SwapController
from reap_swap.server.routes import ReapEndpointPlugin, api_key_digests, endpoint_plugin


def make_app(api_key=None, cartridges=None):
    engine = FakeEngine(tp_size=1)
    ctl = SwapController(PLAN, engine.rpc, cartridges=cartridges or {"c": {"layer_0": [4]}})
    asyncio.run(ctl.start())
    app = FastAPI()
    endpoint_plugin().attach_router(app)
    app.state.reap = ctl
    app.state.reap_api_keys = api_key_digests(SimpleNamespace(api_key=[api_key] if api_key else None))
    return app, engine, ctl


@pytest.fixture
def client():
    app, engine, ctl = make_app()
    with TestClient(app) as c:
        c.engine, c.ctl = engine, ctl
        yield c


def test_swap_status_misses_forensics(client):
    r = client.post("/swap_active_set", json={"request_id": "a", "active_set": {"layer_0": [4]}})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    client.engine.route(0, [4, 9])
    m = client.get("/router_misses/a").json()
    assert m["layers"]["0"]["missed_selections"] == 1
    assert client.get("/forensics/a").json()["last_swap"]["signature"] == r.json()["signature"]
    assert client.get("/reap/status").json()["swap_count"] == 1
    assert client.post("/swap_cartridge/c").json()["request_id"] == "cartridge:c"


@pytest.mark.parametrize(
    "body,code,field",
    [
        (b"{", 400, "body"),
        (b'"text"', 422, "body"),
        (b'{"request_id": "a", "active_set": {"layer_0": ["x", 2.5]}}', 422, "active_set.layer_0[1]"),
        (b'{"request_id": "a", "active_set": {"layer_0": ["x"]}}', 422, "active_set.layer_0[0]"),
        (b'{"request_id": "a", "active_set": {"layer_7": []}}', 422, "active_set.layer_7"),
        (b'{"request_id": "a", "active_set": {}, "budget_bytes": 5}', 422, "budget_bytes"),
    ],
)
def test_errors_name_the_field(client, body, code, field):
    r = client.post("/swap_active_set", content=body)
    assert r.status_code == code, r.text
    assert r.json()["error"]["field"] == field and field in r.json()["error"]["message"]


def test_unknown_ids_are_404(client):
    assert client.get("/router_misses/nope").status_code == 404
    assert client.get("/forensics/nope").status_code == 404
    assert client.post("/swap_cartridge/nope").json()["error"]["field"] == "cartridge_id"


def test_refresh_limit_is_429(client):
    body = {"request_id": "r", "active_set": {}, "phase": "decode_refresh"}
    assert client.post("/swap_active_set", json=body).status_code == 200
    r = client.post("/swap_active_set", json=body)
    assert r.status_code == 429 and r.json()["error"]["limit"] == 1


def test_failing_worker_is_500_and_state_is_kept(client):
    before = client.get("/reap/status").json()["signature"]
    client.engine.workers[0].fail_apply = 1
    r = client.post("/swap_active_set", json={"request_id": "f", "active_set": {"layer_0": [4]}})
    assert r.status_code == 500 and r.json()["error"]["rolled_back"] is True
    assert r.json()["error"]["signature"] == before
    assert r.json()["error"]["failed_ranks"] == [0]  # read from the worker's message
    assert [w["signature"] for w in r.json()["error"]["workers"]] == [before]
    assert client.get("/reap/status").json()["signature"] == before


def test_api_key_on_every_route():
    app, _engine, _ctl = make_app(api_key="k1")
    with TestClient(app) as c:
        for method, path in [
            ("post", "/swap_active_set"),
            ("post", "/warm_active_set"),
            ("get", "/reap/status"),
            ("get", "/router_misses/a"),
            ("get", "/forensics/a"),
            ("post", "/swap_cartridge/c"),
        ]:
            for headers in ({}, {"Authorization": "Bearer k2"}, {"Authorization": "k1"}):
                r = c.request(
                    method.upper(), path, headers=headers, json={"request_id": "a", "active_set": {}}
                )
                assert r.status_code == 401, (path, headers)
        ok = c.get("/reap/status", headers={"Authorization": "Bearer k1"})
        assert ok.status_code == 200


def test_vllm_api_key_environment_is_honoured(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "env-key")
    assert len(api_key_digests(SimpleNamespace(api_key=None))) == 1
    assert api_key_digests(SimpleNamespace(api_key=["a", "b"])) != []


def test_not_configured_is_503():
    app = FastAPI()
    plugin = ReapEndpointPlugin()
    plugin.attach_router(app)
    engine_client = SimpleNamespace(vllm_config=SimpleNamespace(additional_config={}))
    asyncio.run(plugin.init_state(engine_client, app.state, SimpleNamespace(api_key=None)))
    with TestClient(app) as c:
        r = c.get("/reap/status")
    assert r.status_code == 503 and "python -m reap_swap.server" in r.json()["error"]["message"]


def test_init_state_builds_the_controller(tmp_path):
    import json

    from reap_fakes import tiny_plan_doc

    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(tiny_plan_doc()))
    engine = FakeEngine(tp_size=2)

    async def collective_rpc(method, timeout=None, args=(), kwargs=None):
        return await engine.rpc(method, *args)

    cfg = {
        "plan_file": str(plan_file),
        "plan_identity": PLAN.identity,
        "validate_only": False,
        "max_loaded_cartridges": 2,
    }
    engine_client = SimpleNamespace(
        vllm_config=SimpleNamespace(additional_config={ADDITIONAL_CONFIG_KEY: cfg}),
        collective_rpc=collective_rpc,
    )
    app = FastAPI()
    plugin = ReapEndpointPlugin()
    plugin.attach_router(app)
    engine.route(0, [1, 2])  # warm-up counts
    asyncio.run(plugin.init_state(engine_client, app.state, SimpleNamespace(api_key=None)))
    assert isinstance(app.state.reap, SwapController) and app.state.reap.workers == 2
    assert all(sum(c) == 0 for w in engine.workers for c in w.counts.values())
    with TestClient(app) as c:
        assert c.get("/reap/status").json()["cartridges"]["max_loaded"] == 2
