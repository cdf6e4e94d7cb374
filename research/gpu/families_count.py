"""Exact-count checks of the router counters per request length (issue 15, the Qwen3.5 undercount).

Run 10 on the H200 counted 7040 of 12160 routed selections for a 38-token prompt of the full
Qwen3.5-35B-A3B (22 of 38 tokens): the counters took a Gated DeltaNet group's never-computed slot
mapping (-1 on the 16 rows below the largest captured CUDA-graph size) as the padding mask
(research.md, qcount). These cases tell a per-row mask fault (the first rows of every step
missing: 1, 15 and 16 tokens count nothing, 17 counts 1, decode steps count nothing) from a
padding fault (15 tokens run in the 16-row graph: one phantom row) and from an exact count.

Each case is one request: a prompt of exactly `n` token ids (the completions API takes ids, so
the length does not depend on the tokenizer), `ignore_eos`, `max_tokens` m: one prefill step of n
rows, then m - 1 decode steps of one row each (the last sampled token is never fed back), so
expected = (n + m - 1) x top_k x MoE layers.

The concurrent case (issue 15 / branch mlapad, MLA padding) sends several such requests at once:
steps then hold several requests' rows and are padded to a captured size (5 decodes run in the
8-row graph), the PIECEWISE- and FULL-padded steps that one request at a time never reaches (its
decode step is one row, itself a captured size). How the scheduler batches them depends on timing;
the expected total, the sum of the per-request ones, does not.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx

DEFAULT_LENGTHS = (1, 15, 16, 17, 38)
DEFAULT_MAX_TOKENS = (1, 4)
DEFAULT_CONCURRENT = (3, 5, 7, 9, 11)  # 5 requests: decode steps of 5 rows, padded to 8
CONCURRENT_MAX_TOKENS = 8


def parse_ints(text: str) -> tuple[int, ...]:
    """ "1,15,16" -> (1, 15, 16); empty -> (). Each value must be a positive integer."""
    out = tuple(int(v) for v in text.split(",") if v.strip())
    if any(v < 1 for v in out):
        raise ValueError(f"every value must be >= 1: {text!r}")
    return out


def vocab_size(cfg: dict) -> int:
    """The language model's vocabulary (a multimodal wrapper keeps it in text_config)."""
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    return int(text["vocab_size"])


def token_prompt(n: int, vocab: int, seed: int) -> list[int]:
    """n token ids, seeded, away from the low ids where tokenizers keep special tokens."""
    lo, hi = min(1000, vocab // 4), min(vocab, 30000) - 1
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


def expected_selections(n: int, max_tokens: int, top_k: int, moe_layers: int) -> int:
    return (n + max_tokens - 1) * top_k * moe_layers


def judge(n: int, m: int, shape: dict, usage: dict, totals: dict, layers: dict) -> dict:
    """One case's record: observed vs expected, and the difference in tokens."""
    want = expected_selections(n, m, shape["top_k"], shape["layers"])
    got = (totals or {}).get("observed_selections")
    per_layer = [v.get("observed_selections") for v in (layers or {}).values()]
    per_token = shape["top_k"] * shape["layers"]
    return {
        "prompt_tokens": n,
        "max_tokens": m,
        "usage": {k: usage.get(k) for k in ("prompt_tokens", "completion_tokens")},
        "observed": got,
        "expected": want,
        "equal": got == want,
        "missing_tokens": None if got is None else (want - got) / per_token,
        "per_layer_min": min(per_layer) if per_layer else None,
        "per_layer_max": max(per_layer) if per_layer else None,
        "per_layer_expected": want // shape["layers"],
    }


def summarize(cases: list[dict], concurrent: dict | None = None) -> dict:
    out = {
        "cases": cases,
        "all_equal": bool(cases) and all(c.get("equal") for c in cases),
        "missing_tokens": {f"{c['prompt_tokens']}+{c['max_tokens']}": c.get("missing_tokens") for c in cases},
    }
    if concurrent is not None:
        out["concurrent"] = concurrent
        out["all_equal"] = out["all_equal"] and bool(concurrent.get("equal"))
    return out


def completion_body(n: int, m: int, vocab: int, seed: int) -> dict:
    return {
        "model": "m", "prompt": token_prompt(n, vocab, seed=seed),
        "max_tokens": m, "temperature": 0, "ignore_eos": True,
    }  # fmt: skip


def concurrent_case(srv, e2e, shape: dict, vocab: int, lengths, m: int) -> dict:
    """Every prompt length of `lengths` sent at once (one thread each) under one statistics request:
    observed vs the sum of the per-request expectations; `extra_tokens` > 0 are phantom rows
    (counted padding), < 0 rows lost. Every request must report m completion tokens (ignore_eos)."""
    rid = "count-concurrent"
    e2e.open_request(srv, rid)
    bodies = [completion_body(n, m, vocab, seed=50_000 + 100 * i + n) for i, n in enumerate(lengths)]
    with ThreadPoolExecutor(len(bodies)) as pool:
        replies = list(
            pool.map(lambda b: httpx.post(srv.url + "/v1/completions", json=b, timeout=300).json(), bodies)
        )
    record = {"lengths": list(lengths), "max_tokens": m}
    bad = [str(r)[:500] for r in replies if (r.get("usage") or {}).get("completion_tokens") != m]
    if bad:
        return {**record, "error": bad}
    want = sum(expected_selections(n, m, shape["top_k"], shape["layers"]) for n in lengths)
    got = (e2e.misses(srv, rid)["totals"] or {}).get("observed_selections")
    per_token = shape["top_k"] * shape["layers"]
    extra = None if got is None else (got - want) / per_token
    e2e.log("count concurrent", record["lengths"], f"+{m}:", got, "of", want, "extra tokens", extra)
    return {**record, "observed": got, "expected": want, "equal": got == want, "extra_tokens": extra}


def count_cases(srv, e2e, shape: dict, vocab: int, lengths, max_tokens, concurrent=()) -> dict:
    """Every (length, max_tokens) case on a running reap-swap server, one request at a time,
    each under its own statistics request (e2e.open_request resets the counters); then, if
    `concurrent` lengths are given, the concurrent case (CONCURRENT_MAX_TOKENS each)."""
    cases = []
    for m in max_tokens:
        for n in lengths:
            rid = f"count-{n}-{m}"
            e2e.open_request(srv, rid)
            body = completion_body(n, m, vocab, seed=1000 * m + n)
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=300).json()
            if "usage" not in r:
                cases.append({"prompt_tokens": n, "max_tokens": m, "error": str(r)[:1000]})
                continue
            miss = e2e.misses(srv, rid)
            cases.append(judge(n, m, shape, r["usage"], miss["totals"], miss["layers"]))
            c = cases[-1]
            e2e.log(
                "count", f"{n}+{m}", c["observed"], "of", c["expected"], "missing tokens", c["missing_tokens"]
            )
    together = (
        concurrent_case(srv, e2e, shape, vocab, concurrent, CONCURRENT_MAX_TOKENS) if concurrent else None
    )
    return summarize(cases, together)
