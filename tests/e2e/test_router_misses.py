"""Router misses against an independent recount (transformers, float32, same checkpoint).

Each prompt is prefilled exactly once (/v1/completions, max_tokens=1, token-id prompt that shares
no cache block with any other prompt), so vLLM's counters must equal transformers' routing of the
same ids, expert by expert, and misses must equal the recount outside the resident set.
"""

from .helpers import misses, prefill, status, swap, unique_prompt

EVERY_SLICE = {f"layer_{i}": [f"layer_{i}_slice_{j:02d}" for j in range(3)] for i in range(4)}


def expected(recounts: list[dict[int, list[int]]], keep: dict[str, list[int]]) -> dict[str, dict]:
    out = {}
    for layer in range(4):
        counts = [sum(rc[layer][e] for rc in recounts) for e in range(16)]
        outside = [e for e in range(16) if e not in set(keep[str(layer)])]
        out[str(layer)] = {
            "expert_counts": counts,
            "missed_selections": sum(counts[e] for e in outside),
            "inactive_experts": [e for e in outside if counts[e] > 0],
        }
    return out


def check(m: dict, exp: dict[str, dict]) -> None:
    for layer, want in exp.items():
        got = m["layers"][layer]
        assert got["expert_counts"] == want["expert_counts"], f"layer {layer}"
        assert got["missed_selections"] == want["missed_selections"], f"layer {layer}"
        assert got["inactive_experts"] == want["inactive_experts"], f"layer {layer}"
        assert got["observed_selections"] == sum(want["expert_counts"])
        # norm_topk_prob: each token's routed weights sum to 1 per layer
        assert abs(got["observed_mass"] - got["observed_selections"] / 2) < 1e-3


def test_zero_misses_when_every_expert_is_resident(api, recount):
    swap(api, "all-resident", EVERY_SLICE)
    resident = status(api)["layers"]
    assert all(len(resident[str(i)]) == 16 for i in range(3))
    assert resident["3"] == list(range(14))  # the plan leaves experts 14 and 15 of layer 3 out
    prompts = [unique_prompt(f"all-resident-{n}") for n in range(3)]
    for p in prompts:
        prefill(api, p)
    m = misses(api, "all-resident")
    exp = expected([recount.counts(p) for p in prompts], status(api)["layers"])
    check(m, exp)
    for layer in ("0", "1", "2"):
        assert m["layers"][layer]["missed_selections"] == 0
        assert m["layers"][layer]["inactive_mass"] == 0.0
    # layer 3: only the two experts the plan leaves out can miss
    assert set(m["layers"]["3"]["inactive_experts"]) <= {14, 15}
    assert m["totals"]["observed_selections"] == 3 * 24 * 2 * 4


def test_misses_positive_and_exact_when_the_active_set_leaves_routed_experts_out(api, recount):
    swap(api, "core-only", {})
    keep = status(api)["layers"]
    assert all(len(v) == 4 for v in keep.values())
    prompts = [unique_prompt(f"core-only-{n}") for n in range(2)]
    for p in prompts:
        prefill(api, p)
    m = misses(api, "core-only")
    check(m, expected([recount.counts(p) for p in prompts], keep))
    assert m["totals"]["missed_selections"] > 0
    assert 0 < m["totals"]["miss_ratio"] < 1
    assert m["totals"]["inactive_mass"] > 0


def test_decode_refresh_mid_request_measures_each_segment_against_its_own_set(api, recount):
    swap(api, "two-sets", {})
    keep_a = status(api)["layers"]
    p1 = unique_prompt("two-sets-a")
    prefill(api, p1)
    swap(
        api,
        "two-sets",
        {f"layer_{i}": [f"layer_{i}_slice_00", f"layer_{i}_slice_01"] for i in range(4)},
        phase="decode_refresh",
    )
    keep_b = status(api)["layers"]
    p2 = unique_prompt("two-sets-b")
    prefill(api, p2)
    m = misses(api, "two-sets")
    a, b = expected([recount.counts(p1)], keep_a), expected([recount.counts(p2)], keep_b)
    for layer in map(str, range(4)):
        got = m["layers"][layer]
        assert got["expert_counts"] == [
            x + y for x, y in zip(a[layer]["expert_counts"], b[layer]["expert_counts"])
        ]
        assert got["missed_selections"] == a[layer]["missed_selections"] + b[layer]["missed_selections"]


def test_requests_served_while_another_is_open_are_credited_to_the_open_one(api, recount):
    swap(api, "attr-a", {})
    pa = unique_prompt("attr-a")
    prefill(api, pa)
    swap(api, "attr-b", {})
    pb = unique_prompt("attr-b")
    prefill(api, pb)
    ma, mb = misses(api, "attr-a"), misses(api, "attr-b")
    assert ma["open"] is False and mb["open"] is True
    for layer in map(str, range(4)):
        assert ma["layers"][layer]["expert_counts"] == recount.counts(pa)[int(layer)]
        assert mb["layers"][layer]["expert_counts"] == recount.counts(pb)[int(layer)]
