"""The server's expert-cache accounting, exactly against `reap-swap simulate` on the same trace.

Why the comparison is not circular: the trace the simulator replays is NOT the server's own.
It is recomputed by transformers (the e2e `Recount`: float32, HF's own router) from the token
ids the server served (prompt + generated, greedy, one request at a time), split into steps as
vLLM runs them (trace.steps_of_sequence: the prompt is one prefill step, each later token one
decode step; the last sampled token is never fed back). The server, for its part, feeds the
policy the per-step delta of its device router counters (cache_accounting's docstring). So the
test checks two independent things: (1) the stream the server fed (GET /reap/cache/trace) equals
the model's routing step by step, with the same request starts -- the step semantics are vLLM's
and not assumed; (2) the server's hits, misses, promotions and read-through steps, per layer,
equal what the simulator counts for the same policy and the same slots (``--budget <bytes>B``) on
the transformers trace. The policy is the one the CUDA device runs (cache_accounting's
ACCOUNTING_POLICIES): with ``--reap-cache-seed pinned`` ``core+dlfu`` (the plan core pinned, the
integer LFU of decay 0.8 on ``--reap-cache-slots N`` // layers tail slots per layer, the device's
rule: TAIL = 10 over 4 layers lends 2 each, the remainder 2 is not lent, so the simulator's budget
is core + 8), and in the default form, which with the device modelled is CUDA's (seeded),
``dlfu-seeded`` on core + TAIL slots spread over the layers.

Swap capacity (acctail): the servers run with ``--reap-cache-device on``, so accounting holds swaps
to the CUDA server's capacity with the same flags. Pinned form: its swap table, K = the pool (62)
less 4 layers x 2 lent = 54: after the equality checks, a swap of all 62 plan experts is refused
(422 capacity_exceeded, field active_set, naming CUDA's numbers; resident set and cache unchanged) and one of
exactly 54 is applied. Seeded form: each layer pins within its C_l cache slots (core + TAIL
spread: 7, 7, 6, 6), so the same wide swap is served, cut by the plan's rank, with what was left to
the cache listed per layer (``unpinned``); one within every layer's slots is applied as asked.

Step semantics pinned: requests one at a time, prefix caching off (no prompt token skipped),
prompts far below the batched-token budget (one prefill step, no chunking), ``ignore_eos`` and a
fixed ``max_tokens`` (the request ends when the scheduler knows it will, no extra step).
"""

from __future__ import annotations

import numpy as np
import pytest

from reap_swap.cache.replay import simulate
from reap_swap.cache.trace import from_requests, steps_of_sequence
from reap_swap.plan.document import load_plan
from reap_swap.sizing.cache_tail import small_tail_note
from reap_swap.sizing.quant.budget import pool_slots

from .conftest import EAGER, MODEL_NAME
from .helpers import status, unique_prompt

TAIL = 10  # not a multiple of the 4 layers: the pinned form must drop the remainder, as CUDA does
REQUESTS = 4
MAX_TOKENS = 8
ARGS = [
    "--reap-cache",
    "lfu",
    "--reap-cache-slots",
    str(TAIL),
    "--reap-cache-record-steps",
    "1024",
    "--no-enable-prefix-caching",
    "--reap-residency",
    "accounting",  # the CPU build is accounting anyway; on CUDA it runs the policy as state only
    "--reap-cache-device",
    "on",  # accounting holds swaps to the swap table CUDA keeps when it lends the tail (acctail)
    EAGER,  # what is checked here does not depend on torch.compile (conftest)
]
SWAP_SLOTS = 62 - 4 * (TAIL // 4)  # the tiny plan's pool less the lent tail


# (server name, extra flags, the simulator policy the server must equal, tail slots the simulator
# gets): --reap-cache-seed pinned (the device's pinned form core+dlfu, 10 // 4 = 2 per layer), and
# the default form with the device modelled (seed auto = seeded, as on CUDA: the device's
# dlfu-seeded on core + 10; research.md "seedserve")
VARIANTS = {
    "pinned": ("cache-pinned", ["--reap-cache-seed", "pinned"], "core+dlfu", 4 * (TAIL // 4)),
    "seeded": ("cache-seeded", [], "dlfu-seeded", TAIL),
}


@pytest.fixture(params=sorted(VARIANTS))
def cache_api(server_pool, request):
    name, extra, policy, tail = VARIANTS[request.param]
    with server_pool.get(name, ARGS + extra).client() as c:
        c.reap_policy, c.reap_tail = policy, tail
        yield c


def generate(api, prompt: list[int]) -> list[int]:
    r = api.post(
        "/v1/completions",
        json={
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice.get("token_ids") is not None, f"no token_ids in the reply: {choice}"
    assert len(choice["token_ids"]) == MAX_TOKENS
    return choice["token_ids"]


def routed(recount, ids: list[int]) -> np.ndarray:
    """[tokens, layers, top_k] expert ids transformers routes for one forward of `ids`."""
    recount.counts(ids)
    return np.stack([recount._seen[i].reshape(len(ids), -1).numpy() for i in range(4)], axis=1)


def test_cache_accounting_equals_simulate(cache_api, recount, tiny_moe):
    plan = load_plan(str(tiny_moe / "plan.json"))
    before = status(cache_api)["cache"]
    policy = cache_api.reap_policy
    assert before["engaged"] and before["policy"] == before["device_policy"] == policy, before
    assert before["steps"] == 0, "the cache saw steps before the first request (warm-up is not a step)"
    if policy == "core+dlfu":  # 2 tail slots per layer < 2 x top_k = 4: the small-tail note (cachetail)
        pool = pool_slots(plan.swappable_budget_bytes, plan.per_expert_bytes)
        pinned = sum(len(p.core) for p in plan.layers.values())
        assert before["tail_note"] == small_tail_note(2, 2, pool, pinned, 4), before
    else:  # the seeded form has no separate tail: no note
        assert "tail_note" not in before, before
    cache_api.get("/reap/cache/trace", params={"reset": "true"})
    requests = []
    for n in range(REQUESTS):
        prompt = unique_prompt(f"cache-acc-{n}")
        out = generate(cache_api, prompt)
        requests.append(steps_of_sequence(routed(recount, prompt + out[:-1]), len(prompt)))
    trace = from_requests(
        requests,
        layers=range(4),
        model=MODEL_NAME,
        num_experts=16,
        top_k=2,
        per_expert_bytes=plan.per_expert_bytes,
    )

    fed = cache_api.get("/reap/cache/trace").json()["steps"]
    assert len(fed) == trace.num_steps == REQUESTS * MAX_TOKENS
    starts = {int(s) for s in trace.request_first_steps()}
    assert [s["request_start"] for s in fed] == [i in starts for i in range(len(fed))]
    for layer in range(4):
        want = trace.step_counts(layer)
        got = np.array([s["layers"][str(layer)] for s in fed])
        assert (got == want).all(), (
            f"layer {layer}: first differing step {np.flatnonzero((got != want).any(1))[:3]}"
        )

    core = sum(len(p.core) for p in plan.layers.values())
    report = simulate(trace, plan, [f"{(core + cache_api.reap_tail) * plan.per_expert_bytes}B"], [policy])
    row = report["rows"][0]
    cache = status(cache_api)["cache"]
    assert {k: v["slots"] for k, v in cache["layers"].items()} == row["slots"]
    for layer, sim in row["layers"].items():
        got = cache["layers"][layer]["counts"]
        for key in (
            "selections",
            "selection_hits",
            "experts",
            "expert_hits",
            "admitted",
            "bypassed",
            "read_through_steps",
            "steps",
            "decode_selection_hits",
            "decode_expert_hits",
        ):
            assert got[key] == sim[key], f"layer {layer} {key}: server {got[key]} != simulate {sim[key]}"
        # evictions: the simulator reports none; consistent with its admissions and the server's
        # final occupancy (no swaps here, so every expert that left a slot left in a step)
        server = cache["layers"][layer]
        assert server["evictions"] == sim["admitted"] + sim["start_resident"] - len(server["resident"])
        if policy == "core+dlfu":  # the plan core pinned, the tail the device's 2 slots
            assert server["pinned"] == len(plan.layers[int(layer)].core) and server["tail_slots"] == 2
    tot = row["totals"]
    assert cache["totals"]["hits"] == tot["selection_hits"]
    assert cache["totals"]["misses"] == tot["selection_misses"] > 0
    assert cache["totals"]["promotions"] == tot["admitted"] > 0

    metrics = cache_api.get("/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("reap_cache_misses_total"))
    assert float(line.split()[-1]) == tot["selection_misses"]

    refused_for_capacity(cache_api, plan)


def refused_for_capacity(api, plan):
    """A swap wider than the swap capacity. Pinned form (the table's K, one number for the pool):
    refused as CUDA refuses it, nothing changes; exactly K is applied. Seeded form (each layer's C_l
    cache slots, which /reap/status reports as pin_capacity): served, each layer pinned up to its
    slots by the plan's rank, the rest listed per layer as left to the cache (issue 42)."""
    before, cache = status(api), status(api)["cache"]
    every = {f"layer_{l}": [s.slice_id for s in p.slices] for l, p in plan.layers.items()}
    r = api.post("/swap_active_set", json={"request_id": "too-wide", "active_set": every})
    if cache["seeded_swaps"]:
        assert r.status_code == 200, r.text
        assert cache.get("swap_slots") is None, cache  # None is dropped on the wire
        slots = {int(l): v["slots"] for l, v in cache["layers"].items()}
        assert slots == {0: 7, 1: 7, 2: 6, 3: 6}, slots  # core 4 each + TAIL 10 spread
        assert cache["pin_capacity"] == {str(l): n for l, n in slots.items()}, cache
        width = {l: len(set(p.core).union(*(s.experts for s in p.slices))) for l, p in plan.layers.items()}
        body = r.json()
        assert body["validation"]["resident_experts"] == sum(slots.values()), body
        assert {k: len(v) for k, v in body["unpinned"].items()} == {
            f"layer_{l}": width[l] - slots[l] for l in plan.layers if width[l] > slots[l]
        }, body
        after = status(api)["cache"]["layers"]
        for l, n in slots.items():  # each layer holds exactly its slots' worth, the core among them
            assert after[str(l)]["pinned"] == n and set(plan.layers[l].core) <= set(after[str(l)]["resident"])
        fit = {"layer_3": [s.slice_id for s in plan.layers[3].slices if len(s.experts) == 2]}
        r = api.post("/swap_active_set", json={"request_id": "within-slots", "active_set": fit})
        assert r.status_code == 200 and "unpinned" not in r.json(), r.text
        assert r.json()["validation"]["resident_experts"] == 18
        return
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["type"] == "capacity_exceeded" and err["field"] == "active_set", err
    assert cache["swap_slots"] == SWAP_SLOTS, cache
    assert (err["needed"], err["capacity"]) == (62, SWAP_SLOTS), err
    assert (
        f"active_set: resident set needs 62 expert slots but the swap table has {SWAP_SLOTS} "
        f"(overflow {62 - SWAP_SLOTS} experts): the HBM pool of 62 slots less 4 layers x 2 = "
        f"{62 - SWAP_SLOTS} lent to the cache tails; ask for at most {SWAP_SLOTS} experts, serve without "
        "the cache (--reap-cache off"
    ) in err["message"], err
    after = status(api)
    assert after["signature"] == before["signature"] == err["signature"]
    keys = ("resident", "pinned", "tail_slots", "counts")
    assert {l: {k: v[k] for k in keys} for l, v in after["cache"]["layers"].items()} == {
        l: {k: v[k] for k in keys} for l, v in cache["layers"].items()
    }
    # 16 core + every slice of layers 0-2 (36) + layer 3's 2-expert slice = 54 = K: applied
    fit = dict(every, layer_3=[s.slice_id for s in plan.layers[3].slices if len(s.experts) == 2])
    r = api.post("/swap_active_set", json={"request_id": "exactly-k", "active_set": fit})
    assert r.status_code == 200, r.text
    assert r.json()["validation"]["resident_experts"] == SWAP_SLOTS
