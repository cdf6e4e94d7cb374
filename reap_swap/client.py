"""The active-set client: choose the slices for a prompt, make them resident, send the chat.

``ReapClient`` (sync) and ``AsyncReapClient`` (asyncio) share one request flow written as a
generator that yields HTTP calls and receives their answers, so the two cannot drift apart;
each class only drives it with its own httpx client.

``chat(messages, **openai_kwargs)`` is one request end to end:

1. select (``static`` | ``prior`` | ``probe``, see reap_swap.selection). ``probe`` first opens
   ``<id>:probe`` with only the core resident, sends the same chat with ``max_tokens=1`` (a
   prefill-only pass) and reads that request's router misses;
2. open the request: ``POST /swap_active_set``, or, when the selection's signature is the one the
   server last reported as resident, ``POST /warm_active_set`` with the same set. Either call is
   what attributes the router statistics that follow to this request id (and on the server a set
   that is already resident is a no-op);
3. ``POST /v1/chat/completions`` through vLLM's OpenAI-compatible route; with ``refresh_every=N``
   the answer is streamed and after every N chunks the running request's misses may trigger a
   ``decode_refresh`` swap (at most the plan's ``max_refreshes_per_request``);
4. ``GET /router_misses/<id>``: what this request routed to experts that were not resident.

The plan comes from ``plan=`` (a path, a document or a Plan), else from the server's plan file
when this machine can read it; either way its identity must match the server's.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from reap_swap.active_set import signature
from reap_swap.plan import Plan, load_plan
from reap_swap.selection import (
    MissedMass,
    Selection,
    core_probe_payload,
    get_strategy,
    missed_mass,
    refresh,
    routed_share,
)

DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=10.0)
Messages = Sequence[Mapping[str, Any]]


class ReapHTTPError(RuntimeError):
    """A non-2xx answer; ``error`` is the server's JSON error object when it sent one."""

    def __init__(self, method: str, path: str, status: int, body: Any):
        self.method, self.path, self.status, self.body = method, path, status, body
        err = body.get("error") if isinstance(body, Mapping) else None
        self.error = err if isinstance(err, Mapping) else (body if isinstance(body, Mapping) else {})
        message = self.error.get("message") or (
            body if isinstance(body, str) else orjson.dumps(body).decode()
        )
        self.type = self.error.get("type")
        self.field = self.error.get("field")
        super().__init__(f"{method} {path} -> {status}: {message}")


# ----------------------------------------------------------------------------- the shared flow


@dataclass(frozen=True)
class _Call:
    method: str
    path: str
    json: Any = None
    params: Mapping[str, Any] | None = None
    stream: bool = False  # the driver answers with _OPEN, then sends ("chunk", obj) ... ("end", None)


_OPEN = object()  # sent into the flow when a streamed call's response headers arrived
_NEXT = object()  # yielded by the flow while streaming: "give me the next chunk"


@dataclass
class ChatResult:
    """One chat: the completion plus what the client chose and what the server measured."""

    request_id: str
    completion: dict
    selection: Selection
    swap: dict  # summary of the call that opened the request
    router_misses: dict  # GET /router_misses/<request_id> at the end
    probe: dict | None = None  # probe pass: request id, timings, miss totals
    refreshes: list[dict] = field(default_factory=list)
    timings_ms: dict[str, float] = field(default_factory=dict)

    @property
    def answer(self) -> str:
        choices = self.completion.get("choices") or [{}]
        return (choices[0].get("message") or {}).get("content") or ""

    @property
    def hit_rate(self) -> float | None:
        totals = self.router_misses.get("totals") or {}
        observed = totals.get("observed_selections") or 0
        return 1.0 - totals.get("missed_selections", 0) / observed if observed else None

    def to_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "answer": self.answer,
            "completion": self.completion,
            "selection": self.selection.to_dict(),
            "swap": self.swap,
            "probe": self.probe,
            "refreshes": self.refreshes,
            "router_misses": self.router_misses,
            "hit_rate": self.hit_rate,
            "timings_ms": self.timings_ms,
        }


def swap_summary(response: Mapping[str, Any], opened_with: str) -> dict:
    """The parts of a swap/warm response a caller wants to see."""
    timing = response.get("timing") or {}
    validation = response.get("validation") or {}
    return {
        "opened_with": opened_with,
        "kind": response.get("kind"),
        "phase": response.get("phase"),
        "signature": response.get("signature"),
        "previous_signature": response.get("previous_signature"),
        "noop": response.get("noop"),
        "bytes_copied": response.get("bytes_copied"),
        "delta": (response.get("delta") or {}).get("totals"),
        "changed_layers": (response.get("delta") or {}).get("changed_layers"),
        "resident_bytes": validation.get("resident_bytes"),
        "budget_bytes": validation.get("budget_bytes"),
        "refresh_count": response.get("refresh_count"),
        "mode": response.get("mode"),
        "server_seconds": timing.get("total_seconds"),
        "note": response.get("note") or None,
    }


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000.0, 3)


def _completion_body(messages: Messages, model: str, kwargs: Mapping[str, Any]) -> dict:
    return {"model": model, "messages": [dict(m) for m in messages], **kwargs}


def _probe_body(body: Mapping[str, Any]) -> dict:
    """The same prompt, one token, no streaming: the prefill is what the probe measures."""
    drop = {"stream", "stream_options", "n", "max_completion_tokens", "logprobs", "top_logprobs"}
    return {k: v for k, v in body.items() if k not in drop} | {"max_tokens": 1}


class _Assembler:
    """chat.completion.chunk events -> one chat.completion object (choice 0)."""

    def __init__(self) -> None:
        self.first: dict | None = None
        self.content: list[str] = []
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.chunks = 0

    def add(self, chunk: Mapping[str, Any]) -> None:
        self.first = self.first or dict(chunk)
        if chunk.get("usage"):
            self.usage = dict(chunk["usage"])
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                self.content.append(piece)
                self.chunks += 1
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def completion(self) -> dict:
        first = self.first or {}
        return {
            "id": first.get("id"),
            "object": "chat.completion",
            "created": first.get("created"),
            "model": first.get("model"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(self.content)},
                    "finish_reason": self.finish_reason,
                }
            ],
            "usage": self.usage,
        }


class _Base:
    """State and flows shared by the sync and async clients (no I/O here)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        plan: str | Path | Mapping | Plan | None = None,
        strategy: str = "prior",
        budget_bytes: int | None = None,
        model: str | None = None,
    ):
        get_strategy(strategy)  # fail early on a typo
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.strategy = strategy
        self.budget_bytes = budget_bytes
        self.model = model
        self._plan_source = plan
        self._plan: Plan | None = plan if isinstance(plan, Plan) else None
        self._plan_checked = False
        self.known_signature: str | None = None  # what the server last said is resident

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _note(self, response: Any) -> Any:
        """Remember the resident signature a swap reported (a validate-only swap changes nothing)."""
        if (
            isinstance(response, Mapping)
            and isinstance(response.get("signature"), str)
            and "kind" in response
            and not response.get("validate_only")
        ):
            self.known_signature = response["signature"]
        return response

    # -- flows (generators yielding _Call, receiving the decoded JSON answer) ---------------------
    def _plan_flow(self) -> Generator[_Call, Any, Plan]:
        """Load the plan once and check that the server serves the same one."""
        if self._plan is not None and self._plan_checked:
            return self._plan
        status = yield _Call("GET", "/reap/status")
        self.known_signature = status.get("signature")
        if self._plan is None:
            source = self._plan_source
            if source is None:
                source = status.get("plan_file")
                if not source or not Path(source).is_file():
                    raise ValueError(
                        f"no plan given and the server's plan file {source!r} is not readable "
                        "here: pass plan=PATH"
                    )
            self._plan = load_plan(source)
        if status.get("plan_identity") and status["plan_identity"] != self._plan.identity:
            raise ValueError(
                f"the server serves plan {status['plan_identity'][:12]}, this client has "
                f"{self._plan.identity[:12]}: selections would not match what the server checks"
            )
        self._plan_checked = True
        return self._plan

    def _model_flow(self, kwargs: Mapping[str, Any]) -> Generator[_Call, Any, str]:
        if kwargs.get("model"):
            return str(kwargs["model"])
        if self.model is None:
            models = yield _Call("GET", "/v1/models")
            data = models.get("data") or []
            if not data:
                raise ValueError("the server lists no models at /v1/models")
            self.model = data[0]["id"]
        return self.model

    def _open_flow(self, payload: dict, sig: str) -> Generator[_Call, Any, dict]:
        """Swap, or warm when ``sig`` is already resident: both attribute statistics to the id."""
        already = sig == self.known_signature and payload.get("phase", "prefill") == "prefill"
        path = "/warm_active_set" if already else "/swap_active_set"
        t0 = time.perf_counter()
        response = self._note((yield _Call("POST", path, payload)))
        summary = swap_summary(response, "warm (signature already active)" if already else "swap")
        summary["client_ms"] = _ms(t0)
        return summary

    def _select_flow(
        self,
        messages: Messages | str,
        strategy: str,
        budget_bytes: int | None,
        request_id: str,
        completion_body: dict | None,
    ) -> Generator[_Call, Any, tuple[Selection, dict | None]]:
        plan = yield from self._plan_flow()
        chosen = get_strategy(strategy)
        probe_info = None
        misses: MissedMass | None = None
        if chosen.needs_probe:
            if completion_body is None:
                raise ValueError("strategy 'probe' needs the chat completion body to probe with")
            probe_id = f"{request_id}:probe"
            t0 = time.perf_counter()
            core_sig = signature(plan.core_sets())
            opened = yield from self._open_flow(core_probe_payload(probe_id), core_sig)
            t1 = time.perf_counter()
            yield _Call("POST", "/v1/chat/completions", _probe_body(completion_body))
            t2 = time.perf_counter()
            probe_misses = yield _Call("GET", f"/router_misses/{probe_id}")
            misses = missed_mass(probe_misses)
            probe_info = {
                "request_id": probe_id,
                "open": opened,
                "totals": probe_misses.get("totals"),
                "open_ms": round((t1 - t0) * 1000, 3),
                "prefill_ms": round((t2 - t1) * 1000, 3),
                "misses_ms": _ms(t2),
            }
        t3 = time.perf_counter()
        selection = chosen.select(plan, messages, budget_bytes=budget_bytes, probe=misses)
        if probe_info is not None:
            probe_info["select_ms"] = _ms(t3)
            probe_info["total_ms"] = _ms(t0)  # everything the probe added before the real swap
        return selection, probe_info

    def _select_only_flow(
        self,
        messages: Messages | str,
        strategy: str | None,
        budget_bytes: int | None,
        request_id: str | None,
        kwargs: Mapping[str, Any],
    ) -> Generator[_Call, Any, tuple[Selection, dict | None]]:
        strategy = strategy or self.strategy
        budget = self.budget_bytes if budget_bytes is None else budget_bytes
        rid = request_id or f"reap-{uuid.uuid4().hex[:16]}"
        body = None
        if get_strategy(strategy).needs_probe:
            model = yield from self._model_flow(kwargs)
            msgs = [{"role": "user", "content": messages}] if isinstance(messages, str) else messages
            body = _completion_body(msgs, model, {k: v for k, v in kwargs.items() if k != "model"})
        return (yield from self._select_flow(messages, strategy, budget, rid, body))

    def _chat_flow(
        self,
        messages: Messages,
        strategy: str | None,
        request_id: str | None,
        budget_bytes: int | None,
        refresh_every: int | None,
        kwargs: dict,
        given: Selection | None = None,
    ) -> Generator[Any, Any, ChatResult]:
        rid = request_id or f"reap-{uuid.uuid4().hex[:16]}"
        strategy = strategy or self.strategy
        budget = self.budget_bytes if budget_bytes is None else budget_bytes
        timings: dict[str, float] = {}
        t_all = time.perf_counter()
        model = yield from self._model_flow(kwargs)
        body = _completion_body(messages, model, {k: v for k, v in kwargs.items() if k != "model"})
        t0 = time.perf_counter()
        if given is not None:  # the caller chose already
            yield from self._plan_flow()
            selection, probe = given, None
        else:
            selection, probe = yield from self._select_flow(messages, strategy, budget, rid, body)
        timings["select_ms"] = _ms(t0)  # includes the probe pass
        swap = yield from self._open_flow(selection.payload(rid), selection.signature)
        timings["open_ms"] = swap["client_ms"]

        t0 = time.perf_counter()
        refreshes: list[dict] = []
        if refresh_every:
            body = body | {"stream": True, "stream_options": {"include_usage": True}}
            yield _Call("POST", "/v1/chat/completions", body, stream=True)
            assembler, current, since, used = _Assembler(), selection, 0, 0
            while True:
                event, chunk = yield _NEXT
                if event == "end":
                    break
                before = assembler.chunks
                assembler.add(chunk)
                since += assembler.chunks - before
                if since < refresh_every or used >= self._plan.max_refreshes_per_request:
                    continue
                since = 0
                t1 = time.perf_counter()
                # the running request's misses so far, measured against what is resident now
                running = yield _Call("GET", f"/router_misses/{rid}")
                new = refresh(
                    self._plan, current, missed_mass(running), used, messages, routed=routed_share(running)
                )
                record = {
                    "after_chunks": assembler.chunks,
                    "misses_so_far": running.get("totals"),
                    "swapped": new is not None,
                }
                if new is not None:
                    record["swap"] = yield from self._open_flow(new.payload(rid), new.signature)
                    record["selection"] = new.to_dict()
                    current, used = new, used + 1
                record["ms"] = _ms(t1)
                refreshes.append(record)
            completion = assembler.completion()
        else:
            completion = yield _Call("POST", "/v1/chat/completions", body)
        timings["completion_ms"] = _ms(t0)
        t0 = time.perf_counter()
        misses = yield _Call("GET", f"/router_misses/{rid}")
        timings["misses_ms"] = _ms(t0)
        timings["total_ms"] = _ms(t_all)
        if probe is not None:
            timings["probe_ms"] = probe["total_ms"]
        return ChatResult(
            request_id=rid,
            completion=completion,
            selection=selection,
            swap=swap,
            router_misses=misses,
            probe=probe,
            refreshes=refreshes,
            timings_ms=timings,
        )


def _swap_body(
    active_set: Mapping[str, Sequence[int | str]] | Selection,
    request_id: str,
    phase: str,
    budget_bytes: int | None,
    reset_router_stats: bool,
) -> dict:
    if isinstance(active_set, Selection):
        body = active_set.payload(request_id, phase=phase, reset_router_stats=reset_router_stats)
        if budget_bytes is not None:
            body["budget_bytes"] = budget_bytes
        return body
    body = {
        "request_id": request_id,
        "phase": phase,
        "active_set": {str(k): list(v) for k, v in active_set.items()},
    }
    if budget_bytes is not None:
        body["budget_bytes"] = budget_bytes
    if reset_router_stats:
        body["reset_router_stats"] = True
    return body


def _decode(method: str, path: str, response: httpx.Response) -> Any:
    try:
        body = orjson.loads(response.content) if response.content else None
    except orjson.JSONDecodeError:
        body = response.text
    if response.status_code >= 400:
        raise ReapHTTPError(method, path, response.status_code, body)
    return body


def _sse_data(line: str) -> Any:
    """One SSE line -> the decoded chunk, None for anything else, StopIteration marker for [DONE]."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return _DONE
    return orjson.loads(data) if data else None


_DONE = object()


# ----------------------------------------------------------------------------- sync


class ReapClient(_Base):
    """Blocking client (httpx.Client). Use as a context manager or call close()."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
        transport: httpx.BaseTransport | None = None,
        **options: Any,
    ):
        super().__init__(base_url, api_key, **options)
        self._http = httpx.Client(
            base_url=self.base_url, headers=self._headers(), timeout=timeout, transport=transport
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ReapClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _call(self, call: _Call) -> Any:
        response = self._http.request(call.method, call.path, json=call.json, params=call.params)
        return _decode(call.method, call.path, response)

    def _drive(self, flow: Generator) -> Any:
        try:
            op = next(flow)
            while True:
                if isinstance(op, _Call) and op.stream:
                    with self._http.stream(op.method, op.path, json=op.json) as response:
                        if response.status_code >= 400:
                            response.read()
                            _decode(op.method, op.path, response)  # raises ReapHTTPError
                        op = flow.send(_OPEN)
                        for line in response.iter_lines():
                            chunk = _sse_data(line)
                            if chunk is None:
                                continue
                            if chunk is _DONE:
                                break
                            op = flow.send(("chunk", chunk))
                            while isinstance(op, _Call):  # a refresh between chunks
                                op = flow.send(self._call(op))
                    op = flow.send(("end", None))
                elif isinstance(op, _Call):
                    op = flow.send(self._call(op))
                else:
                    raise RuntimeError(f"flow yielded {op!r} outside a stream")
        except StopIteration as stop:
            return stop.value

    # -- endpoints ---------------------------------------------------------------------------
    def swap(
        self,
        active_set: Mapping[str, Sequence[int | str]] | Selection,
        request_id: str,
        *,
        phase: str = "prefill",
        budget_bytes: int | None = None,
        reset_router_stats: bool = False,
    ) -> dict:
        """POST /swap_active_set. ``active_set``: {"layer_N": [ids or sliceIds]} or a Selection."""
        body = _swap_body(active_set, request_id, phase, budget_bytes, reset_router_stats)
        return self._note(self._call(_Call("POST", "/swap_active_set", body)))

    def warm(
        self,
        active_set: Mapping[str, Sequence[int | str]] | Selection,
        request_id: str,
        *,
        phase: str = "prefill",
        budget_bytes: int | None = None,
        reset_router_stats: bool = False,
    ) -> dict:
        """POST /warm_active_set."""
        body = _swap_body(active_set, request_id, phase, budget_bytes, reset_router_stats)
        return self._note(self._call(_Call("POST", "/warm_active_set", body)))

    def open(self, selection: Selection, request_id: str) -> dict:
        """Open ``request_id`` with a selection: a swap, or a warm when its signature is already
        resident (chat's own open step); the swap_summary, with client_ms of this call."""
        return self._drive(self._open_flow(selection.payload(request_id), selection.signature))

    def swap_cartridge(
        self,
        cartridge_id: str,
        request_id: str | None = None,
        *,
        phase: str = "prefill",
        budget_bytes: int | None = None,
    ) -> dict:
        body = {
            k: v
            for k, v in {"request_id": request_id, "phase": phase, "budget_bytes": budget_bytes}.items()
            if v is not None
        }
        return self._note(self._call(_Call("POST", f"/swap_cartridge/{cartridge_id}", body)))

    def router_misses(self, request_id: str, reset: bool = False) -> dict:
        params = {"reset": "true"} if reset else None
        return self._call(_Call("GET", f"/router_misses/{request_id}", params=params))

    def forensics(self, request_id: str) -> dict:
        return self._call(_Call("GET", f"/forensics/{request_id}"))

    def status(self) -> dict:
        status = self._call(_Call("GET", "/reap/status"))
        self.known_signature = status.get("signature")
        return status

    def plan(self) -> Plan:
        return self._drive(self._plan_flow())

    def served_model(self) -> str:
        """The model name chat completions use (the first of /v1/models unless model= was given)."""
        return self._drive(self._model_flow({}))

    def select(
        self,
        messages: Messages | str,
        *,
        strategy: str | None = None,
        budget_bytes: int | None = None,
        request_id: str | None = None,
        **openai_kwargs: Any,
    ) -> tuple[Selection, dict | None]:
        """(selection, probe info) for a prompt; ``probe`` runs its prefill pass on the server
        (under ``<request_id>:probe``), the others need only the plan."""
        return self._drive(
            self._select_only_flow(messages, strategy, budget_bytes, request_id, openai_kwargs)
        )

    def chat(
        self,
        messages: Messages,
        *,
        strategy: str | None = None,
        request_id: str | None = None,
        budget_bytes: int | None = None,
        refresh_every: int | None = None,
        selection: Selection | None = None,
        **openai_kwargs: Any,
    ) -> ChatResult:
        """Select, open (swap/warm), complete, read the misses. ``openai_kwargs`` go into the
        chat completion body (model, max_tokens, temperature, ...); ``selection`` skips selecting."""
        return self._drive(
            self._chat_flow(
                messages, strategy, request_id, budget_bytes, refresh_every, dict(openai_kwargs), selection
            )
        )


# ----------------------------------------------------------------------------- async


class AsyncReapClient(_Base):
    """asyncio client (httpx.AsyncClient); same methods as ReapClient, awaitable."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
        transport: httpx.AsyncBaseTransport | None = None,
        **options: Any,
    ):
        super().__init__(base_url, api_key, **options)
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=self._headers(), timeout=timeout, transport=transport
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncReapClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def _call(self, call: _Call) -> Any:
        response = await self._http.request(call.method, call.path, json=call.json, params=call.params)
        return _decode(call.method, call.path, response)

    async def _drive(self, flow: Generator) -> Any:
        try:
            op = next(flow)
            while True:
                if isinstance(op, _Call) and op.stream:
                    async with self._http.stream(op.method, op.path, json=op.json) as response:
                        if response.status_code >= 400:
                            await response.aread()
                            _decode(op.method, op.path, response)
                        op = flow.send(_OPEN)
                        async for line in response.aiter_lines():
                            chunk = _sse_data(line)
                            if chunk is None:
                                continue
                            if chunk is _DONE:
                                break
                            op = flow.send(("chunk", chunk))
                            while isinstance(op, _Call):
                                op = flow.send(await self._call(op))
                    op = flow.send(("end", None))
                elif isinstance(op, _Call):
                    op = flow.send(await self._call(op))
                else:
                    raise RuntimeError(f"flow yielded {op!r} outside a stream")
        except StopIteration as stop:
            return stop.value

    async def swap(
        self,
        active_set: Mapping[str, Sequence[int | str]] | Selection,
        request_id: str,
        *,
        phase: str = "prefill",
        budget_bytes: int | None = None,
        reset_router_stats: bool = False,
    ) -> dict:
        body = _swap_body(active_set, request_id, phase, budget_bytes, reset_router_stats)
        return self._note(await self._call(_Call("POST", "/swap_active_set", body)))

    async def warm(
        self,
        active_set: Mapping[str, Sequence[int | str]] | Selection,
        request_id: str,
        *,
        phase: str = "prefill",
        budget_bytes: int | None = None,
        reset_router_stats: bool = False,
    ) -> dict:
        body = _swap_body(active_set, request_id, phase, budget_bytes, reset_router_stats)
        return self._note(await self._call(_Call("POST", "/warm_active_set", body)))

    async def open(self, selection: Selection, request_id: str) -> dict:
        return await self._drive(self._open_flow(selection.payload(request_id), selection.signature))

    async def swap_cartridge(
        self,
        cartridge_id: str,
        request_id: str | None = None,
        *,
        phase: str = "prefill",
        budget_bytes: int | None = None,
    ) -> dict:
        body = {
            k: v
            for k, v in {"request_id": request_id, "phase": phase, "budget_bytes": budget_bytes}.items()
            if v is not None
        }
        return self._note(await self._call(_Call("POST", f"/swap_cartridge/{cartridge_id}", body)))

    async def router_misses(self, request_id: str, reset: bool = False) -> dict:
        params = {"reset": "true"} if reset else None
        return await self._call(_Call("GET", f"/router_misses/{request_id}", params=params))

    async def forensics(self, request_id: str) -> dict:
        return await self._call(_Call("GET", f"/forensics/{request_id}"))

    async def status(self) -> dict:
        status = await self._call(_Call("GET", "/reap/status"))
        self.known_signature = status.get("signature")
        return status

    async def plan(self) -> Plan:
        return await self._drive(self._plan_flow())

    async def served_model(self) -> str:
        return await self._drive(self._model_flow({}))

    async def select(
        self,
        messages: Messages | str,
        *,
        strategy: str | None = None,
        budget_bytes: int | None = None,
        request_id: str | None = None,
        **openai_kwargs: Any,
    ) -> tuple[Selection, dict | None]:
        return await self._drive(
            self._select_only_flow(messages, strategy, budget_bytes, request_id, openai_kwargs)
        )

    async def chat(
        self,
        messages: Messages,
        *,
        strategy: str | None = None,
        request_id: str | None = None,
        budget_bytes: int | None = None,
        refresh_every: int | None = None,
        selection: Selection | None = None,
        **openai_kwargs: Any,
    ) -> ChatResult:
        return await self._drive(
            self._chat_flow(
                messages, strategy, request_id, budget_bytes, refresh_every, dict(openai_kwargs), selection
            )
        )


__all__ = ["AsyncReapClient", "ChatResult", "ReapClient", "ReapHTTPError", "swap_summary"]
