"""The client's HTTP pieces: the calls a flow yields, request bodies, response decoding, SSE chunks,
the error a non-2xx answer raises, and ChatResult, what one chat returns.

``io_steps`` runs a flow down to the I/O it needs; a driver (ReapClient with httpx.Client,
AsyncReapClient with httpx.AsyncClient) does only that I/O, so decoding, error mapping and the
stream are the same for both.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from reap_swap.client.selection import Selection

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


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    json: Any = None
    params: Mapping[str, Any] | None = None
    stream: bool = False  # io_steps answers with OPENED, then sends ("chunk", obj) ... ("end", None)

    @property
    def request(self) -> dict[str, Any]:
        """The keyword arguments of httpx's request() and stream()."""
        return {"method": self.method, "url": self.path, "json": self.json, "params": self.params}


OPENED = object()  # sent into the flow when a streamed call's response headers arrived
NEXT_CHUNK = object()  # yielded by the flow while streaming: "give me the next chunk"


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


def elapsed_ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000.0, 3)


def chat_body(messages: Messages, model: str, kwargs: Mapping[str, Any]) -> dict:
    return {"model": model, "messages": [dict(m) for m in messages], **kwargs}


def probe_body(body: Mapping[str, Any]) -> dict:
    """The same prompt, one token, no streaming: the prefill is what the probe measures."""
    drop = {"stream", "stream_options", "n", "max_completion_tokens", "logprobs", "top_logprobs"}
    return {k: v for k, v in body.items() if k not in drop} | {"max_tokens": 1}


class ChunkAssembler:
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


def swap_body(
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


def cartridge_body(request_id: str | None, phase: str, budget_bytes: int | None) -> dict:
    given = {"request_id": request_id, "phase": phase, "budget_bytes": budget_bytes}
    return {k: v for k, v in given.items() if v is not None}


def decode_response(method: str, path: str, response: httpx.Response) -> Any:
    try:
        body = orjson.loads(response.content) if response.content else None
    except orjson.JSONDecodeError:
        body = response.text
    if response.status_code >= 400:
        raise ReapHTTPError(method, path, response.status_code, body)
    return body


def sse_data(line: str) -> Any:
    """One SSE line -> the decoded chunk, None for anything else, StopIteration marker for [DONE]."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return SSE_DONE
    return orjson.loads(data) if data else None


SSE_DONE = object()


# The I/O io_steps asks of a driver, as (kind, argument), and what the driver answers. A stream
# that an error ends before its CLOSE step is the driver's to close.
SEND = "send"  # Call -> its httpx.Response, body read
OPEN = "open"  # streamed Call -> (its httpx.Response, that response's line iterator)
READ = "read"  # streamed httpx.Response -> its body, read (an error answer)
LINE = "line"  # line iterator -> its next line, None at the end
CLOSE = "close"  # streamed httpx.Response -> None, once closed


def _answer(call: Call) -> Generator[tuple[str, Any], Any, Any]:
    return decode_response(call.method, call.path, (yield SEND, call))


def io_steps(flow: Generator) -> Generator[tuple[str, Any], Any, Any]:
    """Runs a flow (flow.py) to its result: yields the I/O it needs as (kind, argument) and takes
    the driver's answers. A streamed call's SSE chunks go into the flow one by one, and the calls
    the flow makes between two chunks (a refresh) are answered while the stream stays open."""
    try:
        op = next(flow)
        while True:
            if not isinstance(op, Call):
                raise RuntimeError(f"flow yielded {op!r} outside a stream")
            if not op.stream:
                op = flow.send((yield from _answer(op)))
                continue
            response, lines = yield OPEN, op
            if response.status_code >= 400:
                yield READ, response
                decode_response(op.method, op.path, response)  # raises ReapHTTPError
            flow.send(OPENED)
            while (line := (yield LINE, lines)) is not None:
                chunk = sse_data(line)
                if chunk is None:
                    continue
                if chunk is SSE_DONE:
                    break
                call = flow.send(("chunk", chunk))
                while isinstance(call, Call):  # a refresh between chunks
                    call = flow.send((yield from _answer(call)))
            yield CLOSE, response
            op = flow.send(("end", None))
    except StopIteration as stop:
        return stop.value
