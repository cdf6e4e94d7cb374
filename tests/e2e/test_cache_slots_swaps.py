"""`--reap-cache-slots swaps` in the real server (accounting residency, `--reap-cache-device on`, so
swaps are held to the swap table CUDA would keep): the launcher's split reaches the workers, the
cache runs its tail of min(2 x top_k, half of what lies beyond the core) per layer, and
per-request swaps fill up to K = pool - layers x tail (with `auto` on this plan K is the core: no
swap beyond it fits, tests/e2e/test_cache_accounting.py shows the refusal)."""

from __future__ import annotations

from reap_swap.plan.document import load_plan
from reap_swap.sizing.cache_tail import plan_swap_split
from reap_swap.sizing.model_shape import read_model_shape

from .conftest import EAGER
from .helpers import status

ARGS = [
    "--reap-cache", "lfu", "--reap-cache-slots", "swaps", "--reap-residency", "accounting",
    "--reap-cache-device", "on", "--no-enable-prefix-caching",
    EAGER,  # the split does not depend on torch.compile (conftest)
]  # fmt: skip


def test_swaps_leaves_the_swap_table_room_beside_the_tail(server_pool, tiny_moe):
    plan = load_plan(str(tiny_moe / "plan.json"))
    split = plan_swap_split(plan, int(read_model_shape(str(tiny_moe / "model")).top_k))
    assert split.why is None and split.kept > split.core, split
    with server_pool.get("cache-swaps", ARGS).client() as api:
        cache = status(api)["cache"]
        assert cache["engaged"] and cache["policy"] == "core+dlfu", cache
        assert cache["swap_slots"] == split.kept, cache
        assert {v["tail_slots"] for v in cache["layers"].values()} == {split.per_layer}, cache
        # the core plus whole slices, best-first per layer, up to K: applied (beyond the core)
        chosen, held = {}, {l: set(p.core) for l, p in plan.layers.items()}
        for l, p in plan.layers.items():
            for s in p.slices:
                more = len(set(s.experts) - held[l])
                if sum(map(len, held.values())) + more <= split.kept:
                    chosen.setdefault(f"layer_{l}", []).append(s.slice_id)
                    held[l] |= set(s.experts)
        used = sum(map(len, held.values()))
        assert used > split.core
        r = api.post("/swap_active_set", json={"request_id": "within-k", "active_set": chosen})
        assert r.status_code == 200, r.text
        assert r.json()["validation"]["resident_experts"] == used
        every = {f"layer_{l}": [s.slice_id for s in p.slices] for l, p in plan.layers.items()}
        r = api.post("/swap_active_set", json={"request_id": "too-wide", "active_set": every})
        assert r.status_code == 422 and r.json()["error"]["type"] == "capacity_exceeded", r.text
        assert f"but the swap table has {split.kept}" in r.json()["error"]["message"]
