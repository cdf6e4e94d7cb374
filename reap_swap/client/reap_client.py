"""The active-set client: choose the slices for a prompt, make them resident, send the chat.

``ReapClient`` (sync) and ``AsyncReapClient`` (asyncio) share one request flow written as a
generator that yields HTTP calls and receives their answers, so the two cannot drift apart: each
public method runs its flow (flow.py), http.io_steps turns that into I/O steps, and each class only
does those steps with its own httpx client.

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

import contextlib
from collections.abc import Generator, Mapping, Sequence
from typing import Any

import httpx

from reap_swap.client.flow import ClientFlows
from reap_swap.client.http import (
    DEFAULT_TIMEOUT,
    LINE,
    OPEN,
    READ,
    SEND,
    ChatResult,
    Messages,
    ReapHTTPError,
    io_steps,
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
        self._http = httpx.Client(**self._http_options(timeout, transport))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ReapClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _drive(self, flow: Generator) -> Any:
        """Runs a flow to its result, doing the I/O that io_steps asks for."""
        steps, answer = io_steps(flow), None
        with contextlib.ExitStack() as streams:  # closes a stream that an error ended early
            while True:
                try:
                    kind, arg = steps.send(answer)
                except StopIteration as stop:
                    return stop.value
                if kind == SEND:
                    answer = self._http.request(**arg.request)
                elif kind == OPEN:
                    response = streams.enter_context(self._http.stream(**arg.request))
                    answer = response, response.iter_lines()
                elif kind == READ:
                    answer = arg.read()
                elif kind == LINE:
                    answer = next(arg, None)
                else:  # CLOSE
                    answer = arg.close()

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
        flow = self._swap_flow(
            "/swap_active_set", active_set, request_id, phase, budget_bytes, reset_router_stats
        )
        return self._drive(flow)

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
        flow = self._swap_flow(
            "/warm_active_set", active_set, request_id, phase, budget_bytes, reset_router_stats
        )
        return self._drive(flow)

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
        return self._drive(self._cartridge_flow(cartridge_id, request_id, phase, budget_bytes))

    def router_misses(self, request_id: str, reset: bool = False) -> dict:
        return self._drive(self._misses_flow(request_id, reset))

    def forensics(self, request_id: str) -> dict:
        return self._drive(self._forensics_flow(request_id))

    def status(self) -> dict:
        return self._drive(self._status_flow())

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
        self._http = httpx.AsyncClient(**self._http_options(timeout, transport))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncReapClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def _drive(self, flow: Generator) -> Any:
        """ReapClient._drive with httpx.AsyncClient."""
        steps, answer = io_steps(flow), None
        async with contextlib.AsyncExitStack() as streams:
            while True:
                try:
                    kind, arg = steps.send(answer)
                except StopIteration as stop:
                    return stop.value
                if kind == SEND:
                    answer = await self._http.request(**arg.request)
                elif kind == OPEN:
                    response = await streams.enter_async_context(self._http.stream(**arg.request))
                    answer = response, response.aiter_lines()
                elif kind == READ:
                    answer = await arg.aread()
                elif kind == LINE:
                    answer = await anext(arg, None)
                else:  # CLOSE
                    answer = await arg.aclose()

    # -- endpoints (ReapClient's, awaitable) ------------------------------------------------------
    async def swap(
        self,
        active_set: Mapping[str, Sequence[int | str]] | Selection,
        request_id: str,
        *,
        phase: str = "prefill",
        budget_bytes: int | None = None,
        reset_router_stats: bool = False,
    ) -> dict:
        flow = self._swap_flow(
            "/swap_active_set", active_set, request_id, phase, budget_bytes, reset_router_stats
        )
        return await self._drive(flow)

    async def warm(
        self,
        active_set: Mapping[str, Sequence[int | str]] | Selection,
        request_id: str,
        *,
        phase: str = "prefill",
        budget_bytes: int | None = None,
        reset_router_stats: bool = False,
    ) -> dict:
        flow = self._swap_flow(
            "/warm_active_set", active_set, request_id, phase, budget_bytes, reset_router_stats
        )
        return await self._drive(flow)

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
        return await self._drive(self._cartridge_flow(cartridge_id, request_id, phase, budget_bytes))

    async def router_misses(self, request_id: str, reset: bool = False) -> dict:
        return await self._drive(self._misses_flow(request_id, reset))

    async def forensics(self, request_id: str) -> dict:
        return await self._drive(self._forensics_flow(request_id))

    async def status(self) -> dict:
        return await self._drive(self._status_flow())

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
