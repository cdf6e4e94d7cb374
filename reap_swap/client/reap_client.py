"""The active-set client: choose the slices for a prompt, make them resident, send the chat.

``ReapClient`` (sync) and ``AsyncReapClient`` (asyncio) share one request flow written as a
generator that yields HTTP calls and receives their answers, so the two cannot drift apart;
each class only drives it with its own httpx client.

``chat(messages, **openai_kwargs)`` is one request end to end:

1. select (``static`` | ``prior`` | ``probe``, see reap_swap.client.selection). ``probe`` first opens
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

from collections.abc import Generator, Mapping, Sequence
from typing import Any

import httpx

from reap_swap.client.flow import ClientFlows
from reap_swap.client.http import (
    DEFAULT_TIMEOUT,
    OPENED,
    SSE_DONE,
    Call,
    ChatResult,
    Messages,
    ReapHTTPError,
    decode_response,
    sse_data,
    swap_body,
    swap_summary,
)
from reap_swap.client.selection import Selection
from reap_swap.plan.document import Plan

# ----------------------------------------------------------------------------- sync


class ReapClient(ClientFlows):
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

    def _call(self, call: Call) -> Any:
        response = self._http.request(call.method, call.path, json=call.json, params=call.params)
        return decode_response(call.method, call.path, response)

    def _drive(self, flow: Generator) -> Any:
        try:
            op = next(flow)
            while True:
                if isinstance(op, Call) and op.stream:
                    with self._http.stream(op.method, op.path, json=op.json) as response:
                        if response.status_code >= 400:
                            response.read()
                            decode_response(op.method, op.path, response)  # raises ReapHTTPError
                        op = flow.send(OPENED)
                        for line in response.iter_lines():
                            chunk = sse_data(line)
                            if chunk is None:
                                continue
                            if chunk is SSE_DONE:
                                break
                            op = flow.send(("chunk", chunk))
                            while isinstance(op, Call):  # a refresh between chunks
                                op = flow.send(self._call(op))
                    op = flow.send(("end", None))
                elif isinstance(op, Call):
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
        body = swap_body(active_set, request_id, phase, budget_bytes, reset_router_stats)
        return self._note(self._call(Call("POST", "/swap_active_set", body)))

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
        body = swap_body(active_set, request_id, phase, budget_bytes, reset_router_stats)
        return self._note(self._call(Call("POST", "/warm_active_set", body)))

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
        return self._note(self._call(Call("POST", f"/swap_cartridge/{cartridge_id}", body)))

    def router_misses(self, request_id: str, reset: bool = False) -> dict:
        params = {"reset": "true"} if reset else None
        return self._call(Call("GET", f"/router_misses/{request_id}", params=params))

    def forensics(self, request_id: str) -> dict:
        return self._call(Call("GET", f"/forensics/{request_id}"))

    def status(self) -> dict:
        status = self._call(Call("GET", "/reap/status"))
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


class AsyncReapClient(ClientFlows):
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

    async def _call(self, call: Call) -> Any:
        response = await self._http.request(call.method, call.path, json=call.json, params=call.params)
        return decode_response(call.method, call.path, response)

    async def _drive(self, flow: Generator) -> Any:
        try:
            op = next(flow)
            while True:
                if isinstance(op, Call) and op.stream:
                    async with self._http.stream(op.method, op.path, json=op.json) as response:
                        if response.status_code >= 400:
                            await response.aread()
                            decode_response(op.method, op.path, response)
                        op = flow.send(OPENED)
                        async for line in response.aiter_lines():
                            chunk = sse_data(line)
                            if chunk is None:
                                continue
                            if chunk is SSE_DONE:
                                break
                            op = flow.send(("chunk", chunk))
                            while isinstance(op, Call):
                                op = flow.send(await self._call(op))
                    op = flow.send(("end", None))
                elif isinstance(op, Call):
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
        body = swap_body(active_set, request_id, phase, budget_bytes, reset_router_stats)
        return self._note(await self._call(Call("POST", "/swap_active_set", body)))

    async def warm(
        self,
        active_set: Mapping[str, Sequence[int | str]] | Selection,
        request_id: str,
        *,
        phase: str = "prefill",
        budget_bytes: int | None = None,
        reset_router_stats: bool = False,
    ) -> dict:
        body = swap_body(active_set, request_id, phase, budget_bytes, reset_router_stats)
        return self._note(await self._call(Call("POST", "/warm_active_set", body)))

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
        return self._note(await self._call(Call("POST", f"/swap_cartridge/{cartridge_id}", body)))

    async def router_misses(self, request_id: str, reset: bool = False) -> dict:
        params = {"reset": "true"} if reset else None
        return await self._call(Call("GET", f"/router_misses/{request_id}", params=params))

    async def forensics(self, request_id: str) -> dict:
        return await self._call(Call("GET", f"/forensics/{request_id}"))

    async def status(self) -> dict:
        status = await self._call(Call("GET", "/reap/status"))
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
