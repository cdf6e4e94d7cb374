"""What ``reap-swap accept`` sends a server: the token-id prompts and their greedy completions, the
thread that keeps swapping the active set, and the storm.

Completions are streamed (one request at a time): the chunks time the decode (tokens after the
first chunk over the time from the first to the last chunk), and their logprobs concatenated are
the completion's tokens and logprobs, the same numbers a non-streamed request returns. Chunks
timed apart time the decode; chunks that arrive together do not: a server that falls behind sends
several tokens per chunk, and a stream held back and flushed at the end delivers every chunk in
the last instant. Each chunk is stamped with the time of the network read that delivered it (not
the time it was parsed, which a loaded client stretches), so chunks read from one buffer share a
stamp. The decode rate is left out (None) with fewer chunks than half the tokens, or when the
chunks came less than ``FLUSHED_S`` apart on average (``held_back``: no decode step is that fast for
one stream); the end-to-end rate (tokens over the request's seconds, prefill
included) is always kept. Token ids (``return_tokens_as_token_ids``) are compared, not their
text: two ids can decode to one string.

The swaps name what the server accepts: the plan's slices (0-2 random ones per layer), else
random candidate experts of the plan's layers, else (no plan) random experts of the model's MoE
layers. A swap the server refuses (4xx: over the budget, not in the plan) is counted, not a
failure; only a 5xx or no answer is.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import orjson

from reap_swap.bench.accept_verdict import NO_ANSWER

FLUSHED_S = 50e-6  # mean gap between chunks' reads below which they were flushed together, not timed apart
# malformed /swap_active_set bodies: each must get a 4xx, never a 5xx
MALFORMED = [
    b"{not json",
    orjson.dumps({"request_id": "bad1", "active_set": {"layer_0": ["nope"]}}),
    orjson.dumps({"request_id": "bad2", "active_set": {"layer_999": [1]}}),
    orjson.dumps({"request_id": "bad3", "active_set": {"layer_0": [-1]}}),
    orjson.dumps({"request_id": "bad4", "active_set": [1, 2]}),
    orjson.dumps({"active_set": {}}),
    orjson.dumps({"request_id": "bad5", "active_set": {}, "budget_bytes": 10**15}),
    orjson.dumps({"request_id": "bad6", "active_set": {"layer_0": [1.5, True]}}),
]


def token_prompts(vocab: int, n: int, seed: int = 42) -> list[list[int]]:
    """n prompts of 24, 32, 40, ... random token ids, away from both ends of the vocabulary
    (special and padding ids usually sit there)."""
    rng = random.Random(seed)
    lo, hi = 100, vocab - max(100, vocab // 10)
    return [[rng.randrange(lo, hi) for _ in range(24 + 8 * i)] for i in range(n)]


def swap_choices(plan_doc: Mapping | None, shape: Any | None) -> tuple[dict[str, list], dict[str, list]]:
    """(layer key -> what a random swap picks from, layer key -> everything: the too-wide swap)."""
    if plan_doc is not None:
        picks, everything = {}, {}
        for key, layer in plan_doc["perLayer"].items():
            slices = [s["sliceId"] for s in layer.get("sliceCatalog") or []]
            experts = sorted(
                set(layer.get("coreExperts") or [])
                | {e for s in layer.get("sliceCatalog") or [] for e in s["experts"]}
            )
            picks[key] = slices or experts
            everything[key] = slices or experts
        return picks, everything
    every = {f"layer_{l}": list(range(shape.num_experts)) for l in shape.moe_layers}
    return every, every


def stamped_lines(reads: Iterable[bytes]) -> Iterator[tuple[float, str]]:
    """(time of the read that completed it, line) for every line of a byte stream."""
    pending = b""
    for data in reads:
        now = time.perf_counter()
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            yield now, line.rstrip(b"\r").decode()
    if pending:
        yield time.perf_counter(), pending.rstrip(b"\r").decode()


class Stream:
    """One greedy completion of a token-id prompt, streamed and timed."""

    def __init__(self, client: httpx.Client, model: str, tokens: int):
        self.client, self.model, self.tokens = client, model, tokens

    def body(self, ids: Sequence[int]) -> dict:
        return {
            "model": self.model,
            "prompt": list(ids),
            "max_tokens": self.tokens,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
            "stream": True,
        }

    def __call__(self, ids: Sequence[int]) -> dict:
        tokens: list[str] = []
        logprobs: list[float | None] = []
        text: list[str] = []
        t_sent = time.perf_counter()
        t_first = t_last = None
        first_count = chunks = 0
        with self.client.stream("POST", "/v1/completions", json=self.body(ids)) as r:
            if r.status_code != 200:
                r.read()
                raise RuntimeError(f"/v1/completions answered {r.status_code}: {r.text[:500]}")
            for now, line in stamped_lines(r.iter_bytes()):
                if not line.startswith("data: ") or line.strip() == "data: [DONE]":
                    continue
                choices = orjson.loads(line[6:]).get("choices") or []
                lp = (choices[0].get("logprobs") or {}) if choices else {}
                if not lp.get("tokens"):
                    continue
                if t_first is None:
                    t_first, first_count = now, len(lp["tokens"])
                t_last, chunks = now, chunks + 1
                tokens += lp["tokens"]
                logprobs += lp["token_logprobs"]
                text.append(choices[0].get("text") or "")
        seconds = time.perf_counter() - t_sent
        held_back = t_first is not None and chunks > 1 and (t_last - t_first) / (chunks - 1) < FLUSHED_S
        decode = None
        if t_first is not None and t_last > t_first and 2 * chunks >= len(tokens) and not held_back:
            decode = (len(tokens) - first_count) / (t_last - t_first)
        return {
            "tokens": tokens,
            "logprobs": logprobs,
            "text": "".join(text),
            "prompt_tokens": len(ids),
            "ttft_s": None if t_first is None else t_first - t_sent,
            "seconds": seconds,
            "chunks": chunks,
            "held_back": held_back,
            "decode_tok_s": decode,
            "tok_s": len(tokens) / seconds,
        }


def complete_all(url: str, headers: Mapping[str, str], model: str, prompts, tokens: int) -> list[dict]:
    """Every prompt, one request at a time (no batching: the reference decodes each alone too)."""
    with httpx.Client(base_url=url, headers=dict(headers), timeout=600) as client:
        stream = Stream(client, model, tokens)
        return [stream(p) for p in prompts]


def _count(codes: dict[str, int], lock: threading.Lock, code: str) -> None:
    with lock:
        codes[code] = codes.get(code, 0) + 1


def swap_body(rng: random.Random, picks: Mapping[str, list], request_id: str) -> dict:
    """A /swap_active_set body: 0-2 random picks per layer."""
    active = {k: rng.sample(v, min(len(v), rng.randint(0, 2))) for k, v in picks.items()}
    return {"request_id": request_id, "phase": "prefill", "active_set": active}


class Swapper(threading.Thread):
    """Posts /swap_active_set with a random choice per layer every ``period_s`` until ``halt``."""

    def __init__(
        self, url: str, headers: Mapping[str, str], picks: Mapping[str, list], seed: int, period_s: float
    ):
        super().__init__(daemon=True)
        self.url, self.headers, self.period_s = url, dict(headers), period_s
        self.picks, self.rng = dict(picks), random.Random(seed)
        self.halt = threading.Event()
        self.codes: dict[str, int] = {}
        self.lock = threading.Lock()
        self.posted = 0

    def body(self, n: int) -> dict:
        return swap_body(self.rng, self.picks, f"accept-swap-{n}")

    def run(self) -> None:
        with httpx.Client(base_url=self.url, headers=self.headers, timeout=120) as c:
            while not self.halt.is_set():
                self.posted += 1
                try:
                    code = str(c.post("/swap_active_set", json=self.body(self.posted)).status_code)
                except httpx.HTTPError:
                    code = NO_ANSWER
                _count(self.codes, self.lock, code)
                self.halt.wait(self.period_s)

    def report(self) -> dict:
        return {"posted": self.posted, "period_s": self.period_s, "codes": dict(sorted(self.codes.items()))}


def storm(
    url: str,
    headers: Mapping[str, str],
    model: str,
    picks: Mapping[str, list],
    everything: Mapping[str, list],
    n: int,
    concurrency: int,
    on_done=None,
) -> dict:
    """n requests, ``concurrency`` at a time, in turn: a chat or a text completion, a swap (every
    fifth one asks for everything on every layer: wider than a layer can pin), a malformed swap."""
    codes: dict[str, int] = {}
    lock = threading.Lock()

    def request(c: httpx.Client, i: int) -> httpx.Response:
        if i % 3 == 0:
            if i % 2 == 0:
                body = {"model": model, "messages": [{"role": "user", "content": f"count to {i}"}]}
                return c.post("/v1/chat/completions", json={**body, "max_tokens": 24})
            return c.post(
                "/v1/completions", json={"model": model, "prompt": f"count to {i}", "max_tokens": 24}
            )
        if i % 3 == 1:
            body = swap_body(
                random.Random(i), picks, f"accept-storm-{i}"
            )  # per request: the same storm every run
            if i % 5 == 1:
                body["active_set"] = {k: list(v) for k, v in everything.items()}
            return c.post("/swap_active_set", json=body)
        raw = MALFORMED[(i // 3) % len(MALFORMED)]
        return c.post("/swap_active_set", content=raw, headers={"content-type": "application/json"})

    def one(i: int) -> None:
        with httpx.Client(base_url=url, headers=dict(headers), timeout=600) as c:
            try:
                code = str(request(c, i).status_code)
            except httpx.HTTPError:
                code = NO_ANSWER
        _count(codes, lock, code)
        if on_done is not None:
            on_done()

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(n)))
    return {"requests": n, "concurrency": concurrency, "codes": dict(sorted(codes.items()))}
