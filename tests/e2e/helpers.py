"""Small request helpers shared by the end-to-end tests."""

from __future__ import annotations

import random

from .conftest import MODEL_NAME

VOCAB = 512
FIRST_ORDINARY_ID = 3  # 0..2 are <|endoftext|>, <|im_start|>, <|im_end|>


def unique_prompt(seed: str, length: int = 24) -> list[int]:
    """Token ids no other prompt shares a 16-token block with, so prefix caching skips nothing."""
    rng = random.Random(seed)
    return [rng.randrange(FIRST_ORDINARY_ID, VOCAB) for _ in range(length)]


def prefill(api, token_ids: list[int]) -> dict:
    """Run exactly one prefill of `token_ids` (max_tokens=1: the sampled token is never fed back)."""
    r = api.post(
        "/v1/completions",
        json={"model": MODEL_NAME, "prompt": token_ids, "max_tokens": 1, "temperature": 0.0},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(token_ids)
    return body


def swap(api, request_id: str, active_set: dict, path: str = "/swap_active_set", **extra) -> dict:
    r = api.post(path, json={"request_id": request_id, "active_set": active_set, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def misses(api, request_id: str, reset: bool = False) -> dict:
    r = api.get(f"/router_misses/{request_id}", params={"reset": "true"} if reset else None)
    assert r.status_code == 200, r.text
    return r.json()


def status(api) -> dict:
    r = api.get("/reap/status")
    assert r.status_code == 200, r.text
    return r.json()
