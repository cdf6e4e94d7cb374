"""50 concurrent mixed swaps and chats: all succeed, swaps serialise, the final status is consistent."""

import asyncio
import random

import httpx

from .conftest import MODEL_NAME
from .helpers import status

SETS = [
    {},
    {f"layer_{i}": [f"layer_{i}_slice_00"] for i in range(4)},
    {f"layer_{i}": [f"layer_{i}_slice_01", f"layer_{i}_slice_02"] for i in range(4)},
    {"layer_0": [4, 5, 6], "layer_3": ["layer_3_slice_02"]},
]


async def _mixed(server, n: int, parallel: int) -> list[tuple[str, httpx.Response]]:
    rng = random.Random(50)
    limit = asyncio.Semaphore(parallel)

    async def one(i: int, c: httpx.AsyncClient):
        async with limit:
            kind = ("swap", "chat", "warm", "cartridge", "status")[i % 5]
            if kind == "swap":
                return kind, await c.post(
                    "/swap_active_set", json={"request_id": f"cc-{i}", "active_set": rng.choice(SETS)}
                )
            if kind == "warm":
                return kind, await c.post(
                    "/warm_active_set", json={"request_id": f"cc-{i}", "active_set": rng.choice(SETS)}
                )
            if kind == "cartridge":
                name = rng.choice(["first-slices", "second-slices", "all"])
                return kind, await c.post(f"/swap_cartridge/{name}", json={"request_id": f"cc-{i}"})
            if kind == "status":
                return kind, await c.get("/reap/status")
            return kind, await c.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL_NAME,
                    "max_tokens": 4,
                    "messages": [{"role": "user", "content": f"count to {i}"}],
                },
            )

    async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers, timeout=300) as c:
        return await asyncio.gather(*(one(i, c) for i in range(n)))


def test_fifty_concurrent_mixed_requests(server, api):
    before = status(api)
    results = asyncio.run(_mixed(server, 50, parallel=16))
    failed = [(k, r.status_code, r.text[:200]) for k, r in results if r.status_code != 200]
    assert not failed, failed
    swaps = [r.json() for k, r in results if k in ("swap", "warm", "cartridge")]
    assert len(swaps) == 30
    after = status(api)
    assert after["swap_count"] == before["swap_count"] + len(swaps)
    # the lock serialised them: sequence numbers are consecutive and chain previous -> new signature
    chain = sorted(swaps, key=lambda s: s["swap_seq"])
    assert [s["swap_seq"] for s in chain] == list(range(before["swap_count"] + 1, after["swap_count"] + 1))
    assert chain[0]["previous_signature"] == before["signature"]
    for prev, cur in zip(chain, chain[1:]):
        assert cur["previous_signature"] == prev["signature"]
    assert after["signature"] == chain[-1]["signature"]
    assert after["workers_consistent"]
    assert after["open_request"] == chain[-1]["request_id"]
