"""A fake reap-swap server for the client tests (httpx.MockTransport handler): the routes the
client calls, a tiny plan, SSE chat streams, and counts of streamed bodies opened and closed."""

from __future__ import annotations

import json

import httpx

from reap_swap.plan.active_set import normalize_active_set, resident_sets, signature
from reap_swap.plan.document import load_plan

PE = 1000


def plan_doc() -> dict:
    """Two layers of 12 experts, core {0,1}, slices a={2,3} b={4,5,6} c={6,7}; the budget holds 9."""

    def layer() -> dict:
        priors = {"a": 0.1, "b": 0.1, "c": 0.3}
        experts = {"a": [2, 3], "b": [4, 5, 6], "c": [6, 7]}
        return {
            "numExperts": 12,
            "coreExperts": [0, 1],
            "sliceCatalog": [
                {"sliceId": s, "experts": experts[s], "activationMass": p, "taskPriors": {"global": p}}
                for s, p in priors.items()
            ],
        }

    return {
        "mode": "dynamic_core_specialist",
        "budget": {
            "per_expert_bytes": PE,
            "swappable_expert_budget_bytes": 9 * PE,
            "max_refreshes_per_request": 1,
        },
        "perLayer": {"layer_0": layer(), "layer_5": layer()},
    }


PLAN = load_plan(plan_doc())


def sse(*events: object) -> bytes:
    lines = [": keep-alive"]
    for e in events:
        lines.append("data: " + (e if isinstance(e, str) else json.dumps(e)))
    return ("\n\n".join(lines) + "\n\n").encode()


def misses_payload(rid: str, counts: list[int]) -> dict:
    row = {
        "inactive_experts": [e for e, c in enumerate(counts) if c and e > 1],
        "expert_counts": counts,
        "observed_selections": sum(counts),
    }
    return {"request_id": rid, "totals": {"observed_selections": 20}, "layers": {"layer_0": row}}


class CountedStream(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A response body that counts on ``server`` when it is opened and closed."""

    def __init__(self, server: FakeServer, data: bytes):
        self.server, self.data = server, data
        server.opened += 1

    def __iter__(self):
        yield self.data

    async def __aiter__(self):
        yield self.data

    def close(self) -> None:
        self.server.closed += 1

    async def aclose(self) -> None:
        self.server.closed += 1


class FakeServer:
    """Answers like reap-swap's routes; ``log`` is every request: (method, path, params, body)."""

    def __init__(self, plan_identity: str = PLAN.identity):
        self.plan_identity = plan_identity
        self.resident: str | None = None
        self.refreshes = 0
        self.log: list[tuple[str, str, dict, object]] = []
        self.headers: list[httpx.Headers] = []
        self.opened = self.closed = 0
        self.open_streams: list[int] = []  # streamed bodies not yet closed, at each request

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        path = request.url.path
        self.log.append((request.method, path, dict(request.url.params), body))
        self.headers.append(request.headers)
        self.open_streams.append(self.opened - self.closed)
        if path == "/reap/status":
            return httpx.Response(
                200,
                json={
                    "signature": self.resident,
                    "plan_identity": self.plan_identity,
                    "cache": {"pin_capacity": {"0": 12, "5": 12}},
                },
            )
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}, {"id": "other"}]})
        if path in ("/swap_active_set", "/warm_active_set"):
            return httpx.Response(200, json=self.swap(path, body))
        if path.startswith("/swap_cartridge/"):
            return httpx.Response(200, json={"kind": "cartridge", "signature": "cart", "body": body})
        if path == "/router_misses/st-fail" and self.opened > self.closed:
            return httpx.Response(500, json={"error": {"message": "counters gone"}})
        if path.startswith("/router_misses/"):
            rid = path.rsplit("/", 1)[1]
            return httpx.Response(200, json=misses_payload(rid, [5, 5, 0, 0, 4, 3, 3, 0, 0, 0, 0, 0]))
        if path == "/forensics/missing":
            error = {"message": "no such request", "type": "not_found", "field": "request_id"}
            return httpx.Response(404, json={"error": error})
        if path == "/forensics/text":
            return httpx.Response(500, text="boom")
        if path.startswith("/forensics/"):
            return httpx.Response(200, json={"request_id": path.rsplit("/", 1)[1]})
        if path == "/v1/chat/completions":
            return self.completion(body)
        return httpx.Response(404, json={"error": {"message": f"no route {path}"}})

    def swap(self, path: str, body: dict) -> dict:
        sig = signature(resident_sets(PLAN, normalize_active_set(PLAN, body["active_set"])))
        previous, dry = self.resident, body["request_id"].startswith("dry")
        if body.get("phase") == "decode_refresh":
            self.refreshes += 1
        if not dry:
            self.resident = sig
        return {
            "kind": "warm" if path == "/warm_active_set" else "swap",
            "phase": body.get("phase", "prefill"),
            "signature": sig,
            "previous_signature": previous,
            "noop": sig == previous,
            "bytes_copied": 0 if sig == previous else PE,
            "delta": {"totals": {"added": 1}, "changed_layers": [0]},
            "validation": {"resident_bytes": 7 * PE, "budget_bytes": 9 * PE},
            "refresh_count": self.refreshes,
            "timing": {"total_seconds": 0.002},
            "validate_only": dry,
        }

    def completion(self, body: dict) -> httpx.Response:
        if body["model"] == "broken":
            error = {"message": "bad model", "type": "invalid", "field": "model"}
            return httpx.Response(400, stream=CountedStream(self, json.dumps({"error": error}).encode()))
        if not body.get("stream"):
            message = {"role": "assistant", "content": "hello"}
            return httpx.Response(
                200,
                json={
                    "id": "c1",
                    "object": "chat.completion",
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": body.get("max_tokens", 2)},
                },
            )
        head = {"id": "c2", "created": 7, "model": body["model"]}
        events: list[object] = [
            head | {"choices": [{"index": 0, "delta": {"content": f"w{i} "}, "finish_reason": None}]}
            for i in range(6)
        ]
        events.append(head | {"choices": [{"index": 1, "delta": {"content": "other choice"}}]})
        events.append(head | {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        events.append(head | {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 6}})
        events += ["[DONE]", head | {"choices": [{"index": 0, "delta": {"content": "after done"}}]}]
        return httpx.Response(
            200, stream=CountedStream(self, sse(*events)), headers={"content-type": "text/event-stream"}
        )
