"""Drive an OpenAI-compatible vLLM server from outside: start and stop it, greedy outputs, streamed timing.

Why its own module: the GPU driver (research/gpu/gpu_e2e.py) and
``reap-swap bench`` run the same server lifecycle and measure decode speed the same way, and the
GPU machine runs them from a bare checkout, so this imports only the standard library and httpx.

Lifecycle (``Server``, the one way this project starts a server: ``reap-swap bench``, the GPU
driver, ``scripts/demo.py`` and the end-to-end fixtures): every server runs in its own process
group (``start_new_session``) and is healthy once ``/health`` answers 200; stopping it sends
SIGTERM, then SIGKILL, to the group and to every other process of its family (processes.py: the
group, the leader's descendants, every pid seen when it became healthy) and waits until none is
left, so an engine core cannot outlive its API server and hold memory while the next one starts.

Timing (``stream_request``): a streamed request records when it was sent, when the first and the
last token chunk arrived, the chunk count and (with ``continuous_usage_stats``) the running token
count. TTFT = first - sent; decode tok/s over a set of streams = (tokens after each stream's first
chunk) / (last chunk of any - first chunk of any).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from reap_swap.bench.processes import group_alive, kill_group, process_family  # noqa: F401 (re-exported)


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_servers_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so that `with Server(...)` blocks stop their servers.

    Why: a driver killed by `timeout` (its default signal) otherwise dies without unwinding, and
    the servers it started keep their HBM (a server that outlives its driver's timeout holds its
    memory, so every later phase fails vLLM's free-memory check)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


class ServerError(RuntimeError):
    """The server exited or never became healthy; the message ends with its log tail."""


def environ_without_reap(**extra: str) -> dict[str, str]:
    """This process's environment without REAP_* (the launcher refuses a REAP_ variable it does
    not know, so a stray one in the caller's shell must not reach it), plus ``extra``."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("REAP_")}, **extra}


class Server:
    """A server command run in its own process group; a context manager (start ... stop).

    ``argv`` is the full command without ``--port``; the port is appended. Output goes to
    ``log_path`` (default ``outdir/<name>.server.log``). ``env`` is laid over ``base_env``
    (default: this process's environment). ``on_wait(elapsed_s)`` is called at every /health poll
    (the demo's progress bar). ``known`` holds the server's processes as seen when it became healthy.
    """

    def __init__(
        self,
        name: str,
        argv: list[str],
        outdir: Path,
        env: dict | None = None,
        port: int = 8100,
        startup_timeout_s: float = 420.0,
        headers: Mapping[str, str] | None = None,
        announce=None,
        *,
        log_path: Path | None = None,
        cwd: Path | None = None,
        base_env: Mapping[str, str] | None = None,
        poll_s: float = 2.0,
        on_wait: Callable[[float], None] | None = None,
    ):
        self.name, self.argv, self.outdir, self.port = name, list(argv), Path(outdir), port
        self.env = {**(os.environ if base_env is None else base_env), **(env or {})}
        self.startup_timeout_s, self.poll_s, self.on_wait = startup_timeout_s, poll_s, on_wait
        self.headers = dict(headers or {})
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(log_path) if log_path else self.outdir / f"{name}.server.log"
        self.startup_s: float | None = None
        self.known: set[int] = set()
        self.announce = announce or log

    @property
    def command(self) -> list[str]:
        return self.argv + ["--port", str(self.port)]

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def start(self) -> Server:
        """Start the command and wait for /health; ServerError (the server stopped) if it exits
        or is not healthy within ``startup_timeout_s``."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(self.log_path, "wb") as logf:
            self.proc = subprocess.Popen(
                self.command,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )
        while time.monotonic() - t0 < self.startup_timeout_s:
            if self.proc.poll() is not None:
                self.stop(check=False)
                raise ServerError(
                    f"{self.name}: server exited with {self.proc.returncode} during startup; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if self.healthy():
                self.startup_s = time.monotonic() - t0
                self.known = process_family(self.proc.pid)
                self.announce(f"{self.name}: healthy after {self.startup_s:.0f}s")
                return self
            time.sleep(self.poll_s)
            if self.on_wait is not None:
                self.on_wait(time.monotonic() - t0)
        self.stop(check=False)
        raise ServerError(
            f"{self.name}: not healthy after {self.startup_timeout_s:.0f}s; log {self.log_path}:\n"
            f"{self.log_tail()}"
        )

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 30.0, check: bool = True) -> tuple[set[int], set[int]]:
        """Kill the server's whole family; returns (the processes it had, those still alive).
        ServerError if any survived and ``check`` (never start another server then)."""
        if self.proc is None:
            return set(), set()
        self.known |= process_family(self.proc.pid)
        left = set(kill_group(self.proc, grace_s, known=self.known))
        if left and check:
            raise ServerError(f"{self.name}: processes of the server survived SIGKILL: {sorted(left)}")
        return set(self.known), left

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ----------------------------------------------------------------------------- requests


def greedy_completions(
    url: str,
    prompts: Sequence[str],
    model: str = "m",
    max_tokens: int = 48,
    headers: Mapping[str, str] | None = None,
) -> list[dict]:
    """Greedy /v1/completions of each prompt: text, tokens and their logprobs."""
    out = []
    for p in prompts:
        r = httpx.post(
            url + "/v1/completions",
            json={"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1},
            headers=headers,
            timeout=120,
        )
        r.raise_for_status()
        ch = r.json()["choices"][0]
        out.append(
            {
                "text": ch["text"],
                "tokens": ch["logprobs"]["tokens"],
                "logprobs": ch["logprobs"]["token_logprobs"],
            }
        )
    return out


def chat_greedy_record(completion: Mapping[str, Any]) -> dict:
    """A chat completion requested with ``logprobs: true`` -> text, tokens, logprobs, usage."""
    choice = (completion.get("choices") or [{}])[0]
    content = ((choice.get("logprobs") or {}).get("content")) or []
    return {
        "text": (choice.get("message") or {}).get("content") or "",
        "tokens": [c.get("token") for c in content],
        "logprobs": [c.get("logprob") for c in content],
        "finish_reason": choice.get("finish_reason"),
        "usage": completion.get("usage"),
    }


def compare(ref: Sequence[Mapping], got: Sequence[Mapping]) -> dict:
    """Greedy token sequences per prompt: identical or not, and where they first diverge."""
    same = [a["tokens"] == b["tokens"] for a, b in zip(ref, got)]
    first_div = []
    for a, b in zip(ref, got):
        d = next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), None)
        if d is None and len(a["tokens"]) != len(b["tokens"]):
            d = min(len(a["tokens"]), len(b["tokens"]))  # one is a prefix of the other
        first_div.append(d)
    return {"identical": sum(same), "of": len(same), "per_prompt": same, "first_divergence": first_div}


@dataclass
class StreamResult:
    """One streamed request, timed on the client (time.perf_counter seconds)."""

    t_sent: float
    t_first: float | None = None
    t_last: float | None = None
    chunks: int = 0  # chunks that carried a choice (token chunks; the usage-only chunk is not one)
    usage: dict | None = None
    text: list[str] = field(default_factory=list)
    # cumulative completion tokens at the first / last token chunk, when every chunk carries usage
    # (stream_options.continuous_usage_stats): exact even when the server merges tokens into one chunk
    tokens_at_first: int | None = None
    tokens_at_last: int | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t_sent

    @property
    def completion_tokens(self) -> int:
        return int((self.usage or {}).get("completion_tokens") or self.chunks)

    @property
    def prompt_tokens(self) -> int | None:
        return (self.usage or {}).get("prompt_tokens")

    @property
    def tokens_after_first(self) -> int:
        """Tokens that arrived after the first token chunk (chunks - 1 without per-chunk usage)."""
        if self.tokens_at_first is not None and self.tokens_at_last is not None:
            return self.tokens_at_last - self.tokens_at_first
        return self.completion_tokens - 1

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens after the first chunk over the time between first and last token chunk."""
        if self.t_first is None or self.t_last is None or self.t_last <= self.t_first:
            return None
        return self.tokens_after_first / (self.t_last - self.t_first)

    @property
    def prefill_tok_s(self) -> float | None:
        ttft = self.ttft_s
        return self.prompt_tokens / ttft if self.prompt_tokens and ttft else None

    def to_dict(self) -> dict:
        return {
            "ttft_s": self.ttft_s,
            "decode_tok_s": self.decode_tok_s,
            "prefill_tok_s": self.prefill_tok_s,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "chunks": self.chunks,
            "tokens_at_first": self.tokens_at_first,
            "tokens_at_last": self.tokens_at_last,
            "first_to_last_s": (self.t_last - self.t_first)
            if self.t_first is not None and self.t_last is not None
            else None,
        }


async def stream_request(
    client: httpx.AsyncClient,
    url: str,
    path: str,
    body: Mapping[str, Any],
    headers: Mapping[str, str] | None = None,
    timeout: float = 600,
) -> StreamResult:
    """POST ``body`` with ``stream: true`` to ``url + path`` and time its chunks."""
    import json

    res = StreamResult(t_sent=time.perf_counter())
    async with client.stream(
        "POST", url + path, json={**body, "stream": True}, headers=headers, timeout=timeout
    ) as r:
        if r.status_code >= 400:
            await r.aread()
            raise httpx.HTTPStatusError(
                f"{path} -> {r.status_code}: {r.text[:500]}", request=r.request, response=r
            )
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line.strip() == "data: [DONE]":
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                res.usage = chunk["usage"]
            choices = chunk.get("choices") or []
            if not choices:
                continue
            running = (chunk.get("usage") or {}).get("completion_tokens")
            if res.t_first is None:
                res.t_first, res.tokens_at_first = now, running
            res.t_last, res.tokens_at_last = now, running
            res.chunks += 1
            piece = choices[0].get("text")
            if piece is None:
                piece = (choices[0].get("delta") or {}).get("content")
            if piece:
                res.text.append(piece)
    return res


def batch_decode_tok_s(results: Sequence[StreamResult]) -> float | None:
    """Aggregate decode rate of concurrent streams: tokens after each first / (last of any - first of any)."""
    firsts = [r.t_first for r in results if r.t_first is not None]
    lasts = [r.t_last for r in results if r.t_last is not None]
    if not firsts or not lasts or max(lasts) <= min(firsts):
        return None
    return sum(r.tokens_after_first for r in results) / (max(lasts) - min(firsts))


def stream_all(
    url: str,
    path: str,
    bodies: Sequence[Mapping[str, Any]],
    headers: Mapping[str, str] | None = None,
    timeout: float = 600,
) -> list[StreamResult]:
    """Stream ``bodies`` to ``url + path`` concurrently (a connection each) and time every one."""

    async def go():
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(bodies) + 2)) as client:
            return await asyncio.gather(
                *[stream_request(client, url, path, b, headers, timeout) for b in bodies]
            )

    return asyncio.run(go())


def decode_speed(
    url: str, prompts: Sequence[str], batch: int, n: int = 256, repeats: int = 3, model: str = "m"
) -> dict:
    """Streamed greedy decode tok/s of ``batch`` concurrent completions: one warm-up, then
    ``repeats`` runs (prompts rotate); median, min and max (batch_decode_tok_s of each run)."""

    def body(prompt: str, tokens: int) -> dict:
        return {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}

    stream_all(url, "/v1/completions", [body("warm up", 16)], timeout=300)
    rates = sorted(
        batch_decode_tok_s(
            stream_all(
                url,
                "/v1/completions",
                [body(prompts[(rep + i) % len(prompts)], n) for i in range(batch)],
                timeout=300,
            )
        )
        for rep in range(repeats)
    )
    return {"median": rates[len(rates) // 2], "min": rates[0], "max": rates[-1]}
