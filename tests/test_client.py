"""The active-set client over a fake server (httpx.MockTransport): every public method of
ReapClient and AsyncReapClient sends the same requests and returns the same answers, and the
errors map to the same ReapHTTPError; the real server's round trips are tests/e2e/test_client_e2e.py."""

from __future__ import annotations

import asyncio
import inspect

import httpx
import pytest
from client_fakes import PE, PLAN, FakeServer

from reap_swap.client import selection as S
from reap_swap.client.reap_client import AsyncReapClient, ChatResult, ReapClient, ReapHTTPError
from reap_swap.plan.active_set import signature

PUBLIC = (  # the methods both clients have
    "chat",
    "forensics",
    "open",
    "plan",
    "router_misses",
    "select",
    "served_model",
    "status",
    "swap",
    "swap_cartridge",
    "warm",
)


class Api:
    """One client, sync or async, called the same way (an async call runs to its end on ``loop``)."""

    def __init__(self, client, loop: asyncio.AbstractEventLoop | None):
        self.client, self.loop = client, loop

    def __getattr__(self, name: str):
        attr = getattr(self.client, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            out = attr(*args, **kwargs)
            if self.loop is None:
                return out
            assert inspect.isawaitable(out)
            return self.loop.run_until_complete(out)

        return call


@pytest.fixture(params=["sync", "async"])
def make(request):
    loop = asyncio.new_event_loop() if request.param == "async" else None
    made: list = []

    def make(server: FakeServer, **options) -> Api:
        options.setdefault("plan", PLAN)
        if loop is None:
            client = ReapClient("http://reap/", "key", transport=httpx.MockTransport(server), **options)
        else:
            client = AsyncReapClient("http://reap/", "key", transport=httpx.MockTransport(server), **options)
        made.append(client)
        return Api(client, loop)

    yield make
    for client in made:
        if loop is None:
            client.close()
        else:
            loop.run_until_complete(client.aclose())
    if loop is not None:
        loop.close()


def calls(server: FakeServer) -> list[tuple[str, str]]:
    return [(method, path) for method, path, _, _ in server.log]


def test_the_two_clients_have_the_same_public_methods():
    for name in PUBLIC:
        sync, aio = getattr(ReapClient, name), getattr(AsyncReapClient, name)
        assert inspect.signature(sync) == inspect.signature(aio), name
        assert not inspect.iscoroutinefunction(sync) and inspect.iscoroutinefunction(aio), name
    assert inspect.iscoroutinefunction(AsyncReapClient.aclose)
    assert inspect.iscoroutinefunction(AsyncReapClient.__aenter__)


def test_endpoints_send_their_bodies_and_note_the_signature(make):
    server = FakeServer()
    api = make(server)
    assert server.headers == [] and api.base_url == "http://reap"
    assert api.status()["plan_identity"] == PLAN.identity and api.known_signature is None
    swapped = api.swap({"layer_0": ["a"], 5: [2, 3]}, "r1", budget_bytes=9 * PE, reset_router_stats=True)
    assert server.log[-1] == (
        "POST",
        "/swap_active_set",
        {},
        {
            "request_id": "r1",
            "phase": "prefill",
            "active_set": {"layer_0": ["a"], "5": [2, 3]},
            "budget_bytes": 9 * PE,
            "reset_router_stats": True,
        },
    )
    assert api.known_signature == swapped["signature"]
    chosen = S.select_static(PLAN, 8 * PE)
    warmed = api.warm(chosen, "r2", phase="prefill", budget_bytes=7 * PE, reset_router_stats=True)
    assert server.log[-1][1:] == (
        "/warm_active_set",
        {},
        {
            "request_id": "r2",
            "phase": "prefill",
            "active_set": {},
            "budget_bytes": 7 * PE,
            "reset_router_stats": True,
        },
    )
    assert warmed["kind"] == "warm" and api.known_signature == chosen.signature
    api.swap({"layer_0": ["b"]}, "dry-run")  # validate-only: nothing changed on the server
    assert api.known_signature == chosen.signature
    assert api.swap_cartridge("python", budget_bytes=5)["body"] == {"phase": "prefill", "budget_bytes": 5}
    assert server.log[-1][:2] == ("POST", "/swap_cartridge/python")
    assert api.known_signature == "cart"
    api.swap_cartridge("c", "r3", phase="decode_refresh")
    assert server.log[-1][3] == {"request_id": "r3", "phase": "decode_refresh"}
    assert api.router_misses("r1")["request_id"] == "r1" and server.log[-1][2] == {}
    api.router_misses("r1", reset=True)
    assert server.log[-1][:3] == ("GET", "/router_misses/r1", {"reset": "true"})
    assert api.forensics("r9") == {"request_id": "r9"}
    assert all(h["authorization"] == "Bearer key" for h in server.headers)


def test_errors_map_to_reap_http_error(make):
    server = FakeServer()
    api = make(server)
    with pytest.raises(ReapHTTPError) as err:
        api.forensics("missing")
    e = err.value
    assert (e.method, e.path, e.status, e.type, e.field) == (
        "GET",
        "/forensics/missing",
        404,
        "not_found",
        "request_id",
    )
    assert str(e) == "GET /forensics/missing -> 404: no such request"
    with pytest.raises(ReapHTTPError) as err:
        api.forensics("text")
    assert err.value.status == 500 and err.value.body == "boom" and err.value.error == {}
    assert str(err.value) == "GET /forensics/text -> 500: boom"
    with pytest.raises(ReapHTTPError) as err:  # a streamed call's error body is read before mapping
        api.chat([{"role": "user", "content": "x"}], strategy="static", model="broken", refresh_every=2)
    assert err.value.status == 400 and err.value.field == "model" and err.value.path == "/v1/chat/completions"
    assert server.opened == server.closed == 1
    with pytest.raises(ValueError, match="unknown strategy 'nope'"):
        make(server, strategy="nope")


def test_plan_is_checked_once_against_the_server(make):
    server = FakeServer()
    api = make(server)
    assert api.plan() is PLAN and api.plan() is PLAN
    assert calls(server) == [("GET", "/reap/status")]
    assert api.pin_capacity == {0: 12, 5: 12}
    other = make(FakeServer(plan_identity="f" * 64))
    with pytest.raises(ValueError, match="serves plan ffffffffffff"):
        other.plan()
    unreadable = make(FakeServer(), plan=None)
    with pytest.raises(ValueError, match="no plan given"):
        unreadable.plan()


def test_served_model_is_asked_once_unless_given(make):
    server = FakeServer()
    api = make(server)
    assert api.served_model() == "tiny" and api.served_model() == "tiny"
    assert calls(server) == [("GET", "/v1/models")]
    named = FakeServer()
    assert make(named, model="mine").served_model() == "mine" and named.log == []


def test_chat_prior_swaps_then_warms_the_same_signature(make):
    server = FakeServer()
    api = make(server, budget_bytes=7 * PE)
    messages = [{"role": "user", "content": "hello there"}]
    result = api.chat(messages, request_id="q1", max_tokens=4, temperature=0.0)
    assert isinstance(result, ChatResult) and result.answer == "hello"
    assert calls(server) == [
        ("GET", "/v1/models"),
        ("GET", "/reap/status"),
        ("POST", "/swap_active_set"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/router_misses/q1"),
    ]
    assert server.log[3][3] == {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0.0}
    assert server.log[2][3] == result.selection.payload("q1")
    assert result.swap["opened_with"] == "swap" and result.swap["signature"] == result.selection.signature
    assert result.swap["server_seconds"] == 0.002 and result.swap["delta"] == {"added": 1}
    assert result.router_misses["request_id"] == "q1" and result.probe is None and result.refreshes == []
    assert set(result.timings_ms) == {"select_ms", "open_ms", "completion_ms", "misses_ms", "total_ms"}
    assert result.hit_rate == pytest.approx(1.0 - 0 / 20)
    again = api.chat(messages, request_id="q2", model="other", selection=result.selection)
    assert calls(server)[5:] == [
        ("POST", "/warm_active_set"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/router_misses/q2"),
    ]
    assert again.swap["opened_with"] == "warm (signature already active)" and again.swap["noop"] is True
    assert server.log[6][3]["model"] == "other"
    assert again.to_dict()["answer"] == "hello"


def test_chat_probe_runs_a_prefill_pass_on_the_core(make):
    server = FakeServer()
    api = make(server)
    messages = [{"role": "user", "content": "probe me"}]
    result = api.chat(messages, strategy="probe", request_id="p", max_tokens=9, stream=False, n=1)
    assert calls(server) == [
        ("GET", "/v1/models"),
        ("GET", "/reap/status"),
        ("POST", "/swap_active_set"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/router_misses/p:probe"),
        ("POST", "/swap_active_set"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/router_misses/p"),
    ]
    assert server.log[2][3] == {"request_id": "p:probe", "active_set": {}}
    assert server.log[3][3] == {"model": "tiny", "messages": messages, "max_tokens": 1}
    assert server.log[6][3] == {
        "model": "tiny",
        "messages": messages,
        "max_tokens": 9,
        "stream": False,
        "n": 1,
    }
    probe = result.probe
    assert probe["request_id"] == "p:probe" and probe["open"]["signature"] == signature(PLAN.core_sets())
    assert probe["totals"] == {"observed_selections": 20}
    assert set(probe) == {
        "request_id",
        "open",
        "totals",
        "open_ms",
        "prefill_ms",
        "misses_ms",
        "select_ms",
        "total_ms",
    }
    assert result.timings_ms["probe_ms"] == probe["total_ms"]
    assert "b" in result.selection.slices[0]  # the probe missed on 4, 5, 6


def test_select_alone(make):
    server = FakeServer()
    api = make(server)
    sel, probe = api.select("plain prompt", strategy="static")
    assert probe is None and sel.strategy == "static" and calls(server) == [("GET", "/reap/status")]
    sel, probe = api.select(
        "probe prompt", strategy="probe", request_id="s", budget_bytes=6 * PE, max_tokens=3
    )
    assert sel.strategy == "probe" and sel.budget_bytes == 6 * PE and probe["request_id"] == "s:probe"
    assert server.log[3][3] == {
        "model": "tiny",
        "messages": [{"role": "user", "content": "probe prompt"}],
        "max_tokens": 1,
    }
    assert calls(server)[-1] == ("GET", "/router_misses/s:probe")


def test_open_swaps_then_warms(make):
    server = FakeServer()
    api = make(server)
    chosen = S.select_static(PLAN)
    first = api.open(chosen, "o1")
    second = api.open(chosen, "o2")
    assert (first["opened_with"], second["opened_with"]) == ("swap", "warm (signature already active)")
    assert "client_ms" in first and calls(server) == [
        ("POST", "/swap_active_set"),
        ("POST", "/warm_active_set"),
    ]
    assert server.log[1][3] == chosen.payload("o2")


def test_streamed_chat_refreshes_mid_stream(make):
    server = FakeServer()
    api = make(server)
    result = api.chat(
        [{"role": "user", "content": "stream"}],
        strategy="static",
        request_id="st",
        refresh_every=2,
        max_tokens=6,
    )
    assert calls(server) == [
        ("GET", "/v1/models"),
        ("GET", "/reap/status"),
        ("POST", "/swap_active_set"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/router_misses/st"),
        ("POST", "/swap_active_set"),
        ("GET", "/router_misses/st"),
    ]
    # the stream stays open through the refresh and is closed before the final misses
    assert server.open_streams == [0, 0, 0, 0, 1, 1, 0] and server.opened == server.closed == 1
    assert server.log[3][3]["stream"] is True and server.log[3][3]["stream_options"] == {
        "include_usage": True
    }
    assert server.log[5][3]["phase"] == "decode_refresh"
    assert result.completion == {
        "id": "c2",
        "object": "chat.completion",
        "created": 7,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "w0 w1 w2 w3 w4 w5 "},
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 6},
    }
    (done,) = result.refreshes  # the plan allows one refresh per request
    assert done["after_chunks"] == 2 and done["swapped"] is True and done["swap"]["phase"] == "decode_refresh"
    assert done["selection"]["phase"] == "decode_refresh" and api.known_signature == done["swap"]["signature"]
    assert done["misses_so_far"] == {"observed_selections": 20} and "ms" in done


def test_an_error_between_chunks_closes_the_stream(make):
    server = FakeServer()
    api = make(server)
    with pytest.raises(ReapHTTPError, match="GET /router_misses/st-fail -> 500: counters gone"):
        api.chat([{"role": "user", "content": "s"}], strategy="static", request_id="st-fail", refresh_every=2)
    assert server.opened == server.closed == 1 and calls(server)[-1] == ("GET", "/router_misses/st-fail")


def test_context_managers_close_the_http_client():
    transport = httpx.MockTransport(FakeServer())
    with ReapClient("http://reap", plan=PLAN, transport=transport) as client:
        assert client.status()["plan_identity"] == PLAN.identity
    assert client._http.is_closed

    async def go():
        async with AsyncReapClient("http://reap", plan=PLAN, transport=transport) as aclient:
            assert (await aclient.status())["plan_identity"] == PLAN.identity
        return aclient

    assert asyncio.run(go())._http.is_closed
