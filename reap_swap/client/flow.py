"""The request flows the sync and async clients share, written as generators that yield HTTP
calls (client_http.Call) and receive their decoded answers: no I/O here, so the two clients
cannot drift apart."""

from __future__ import annotations

import time
import uuid
from collections.abc import Generator, Mapping, Sequence
from pathlib import Path
from typing import Any

from reap_swap.client.http import (
    NEXT_CHUNK,
    Call,
    ChatResult,
    ChunkAssembler,
    Messages,
    cartridge_body,
    chat_body,
    elapsed_ms,
    probe_body,
    swap_body,
    swap_summary,
)
from reap_swap.client.selection import (
    MissedMass,
    Selection,
    core_probe_payload,
    missed_mass,
    refresh,
    routed_share,
)
from reap_swap.client.strategies import get_strategy
from reap_swap.plan.active_set import signature
from reap_swap.plan.document import Plan, load_plan


class ClientFlows:
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
        self.pin_capacity: dict[int, int] = {}  # layer -> what the server can pin (read with the plan)

    def _http_options(self, timeout: Any, transport: Any) -> dict[str, Any]:
        """What the httpx client (sync or async) is made with."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return {"base_url": self.base_url, "headers": headers, "timeout": timeout, "transport": transport}

    # -- flows (generators yielding Call, receiving the decoded JSON answer) ---------------------
    def _posted(self, path: str, body: dict) -> Generator[Call, Any, dict]:
        """A swap-like POST; remembers the resident signature it reports (a validate-only swap
        changes nothing)."""
        response = yield Call("POST", path, body)
        if (
            isinstance(response, Mapping)
            and isinstance(response.get("signature"), str)
            and "kind" in response
            and not response.get("validate_only")
        ):
            self.known_signature = response["signature"]
        return response

    def _swap_flow(
        self,
        path: str,
        active_set: Mapping[str, Sequence[int | str]] | Selection,
        request_id: str,
        phase: str,
        budget_bytes: int | None,
        reset_router_stats: bool,
    ) -> Generator[Call, Any, dict]:
        body = swap_body(active_set, request_id, phase, budget_bytes, reset_router_stats)
        return (yield from self._posted(path, body))

    def _cartridge_flow(
        self, cartridge_id: str, request_id: str | None, phase: str, budget_bytes: int | None
    ) -> Generator[Call, Any, dict]:
        body = cartridge_body(request_id, phase, budget_bytes)
        return (yield from self._posted(f"/swap_cartridge/{cartridge_id}", body))

    def _misses_flow(self, request_id: str, reset: bool = False) -> Generator[Call, Any, dict]:
        params = {"reset": "true"} if reset else None
        return (yield Call("GET", f"/router_misses/{request_id}", params=params))

    def _forensics_flow(self, request_id: str) -> Generator[Call, Any, dict]:
        return (yield Call("GET", f"/forensics/{request_id}"))

    def _status_flow(self) -> Generator[Call, Any, dict]:
        status = yield Call("GET", "/reap/status")
        self.known_signature = status.get("signature")
        return status

    def _plan_flow(self) -> Generator[Call, Any, Plan]:
        """Load the plan once and check that the server serves the same one."""
        if self._plan is not None and self._plan_checked:
            return self._plan
        status = yield from self._status_flow()
        # what the server can pin per layer (the seeded device cache): selections fit within it
        cap = ((status.get("cache") or {}).get("pin_capacity")) or {}
        self.pin_capacity = {int(layer): int(n) for layer, n in cap.items()}
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

    def _model_flow(self, kwargs: Mapping[str, Any]) -> Generator[Call, Any, str]:
        if kwargs.get("model"):
            return str(kwargs["model"])
        if self.model is None:
            models = yield Call("GET", "/v1/models")
            data = models.get("data") or []
            if not data:
                raise ValueError("the server lists no models at /v1/models")
            self.model = data[0]["id"]
        return self.model

    def _open_flow(self, payload: dict, sig: str) -> Generator[Call, Any, dict]:
        """Swap, or warm when ``sig`` is already resident: both attribute statistics to the id."""
        already = sig == self.known_signature and payload.get("phase", "prefill") == "prefill"
        path = "/warm_active_set" if already else "/swap_active_set"
        t0 = time.perf_counter()
        response = yield from self._posted(path, payload)
        summary = swap_summary(response, "warm (signature already active)" if already else "swap")
        summary["client_ms"] = elapsed_ms(t0)
        return summary

    def _select_flow(
        self,
        messages: Messages | str,
        strategy: str,
        budget_bytes: int | None,
        request_id: str,
        completion_body: dict | None,
    ) -> Generator[Call, Any, tuple[Selection, dict | None]]:
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
            yield Call("POST", "/v1/chat/completions", probe_body(completion_body))
            t2 = time.perf_counter()
            probe_misses = yield from self._misses_flow(probe_id)
            misses = missed_mass(probe_misses)
            probe_info = {
                "request_id": probe_id,
                "open": opened,
                "totals": probe_misses.get("totals"),
                "open_ms": round((t1 - t0) * 1000, 3),
                "prefill_ms": round((t2 - t1) * 1000, 3),
                "misses_ms": elapsed_ms(t2),
            }
        t3 = time.perf_counter()
        selection = chosen.select(
            plan, messages, budget_bytes=budget_bytes, probe=misses, capacity=self.pin_capacity or None
        )
        if probe_info is not None:
            probe_info["select_ms"] = elapsed_ms(t3)
            probe_info["total_ms"] = elapsed_ms(t0)  # everything the probe added before the real swap
        return selection, probe_info

    def _select_only_flow(
        self,
        messages: Messages | str,
        strategy: str | None,
        budget_bytes: int | None,
        request_id: str | None,
        kwargs: Mapping[str, Any],
    ) -> Generator[Call, Any, tuple[Selection, dict | None]]:
        strategy = strategy or self.strategy
        budget = self.budget_bytes if budget_bytes is None else budget_bytes
        rid = request_id or f"reap-{uuid.uuid4().hex[:16]}"
        body = None
        if get_strategy(strategy).needs_probe:
            model = yield from self._model_flow(kwargs)
            msgs = [{"role": "user", "content": messages}] if isinstance(messages, str) else messages
            body = chat_body(msgs, model, {k: v for k, v in kwargs.items() if k != "model"})
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
        body = chat_body(messages, model, {k: v for k, v in kwargs.items() if k != "model"})
        t0 = time.perf_counter()
        if given is not None:  # the caller chose already
            yield from self._plan_flow()
            selection, probe = given, None
        else:
            selection, probe = yield from self._select_flow(messages, strategy, budget, rid, body)
        timings["select_ms"] = elapsed_ms(t0)  # includes the probe pass
        swap = yield from self._open_flow(selection.payload(rid), selection.signature)
        timings["open_ms"] = swap["client_ms"]

        t0 = time.perf_counter()
        refreshes: list[dict] = []
        if refresh_every:
            completion = yield from self._streamed_flow(
                body, selection, rid, messages, refresh_every, refreshes
            )
        else:
            completion = yield Call("POST", "/v1/chat/completions", body)
        timings["completion_ms"] = elapsed_ms(t0)
        t0 = time.perf_counter()
        misses = yield from self._misses_flow(rid)
        timings["misses_ms"] = elapsed_ms(t0)
        timings["total_ms"] = elapsed_ms(t_all)
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

    def _streamed_flow(
        self,
        body: dict,
        selection: Selection,
        rid: str,
        messages: Messages,
        refresh_every: int,
        refreshes: list[dict],
    ) -> Generator[Any, Any, dict]:
        """The completion streamed; every ``refresh_every`` chunks the running request's misses may
        trigger a decode_refresh swap (recorded into ``refreshes``). Returns the assembled completion."""
        body = body | {"stream": True, "stream_options": {"include_usage": True}}
        yield Call("POST", "/v1/chat/completions", body, stream=True)
        assembler, current, since, used = ChunkAssembler(), selection, 0, 0
        while True:
            event, chunk = yield NEXT_CHUNK
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
            running = yield from self._misses_flow(rid)
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
            record["ms"] = elapsed_ms(t1)
            refreshes.append(record)
        completion = assembler.completion()
        return completion
