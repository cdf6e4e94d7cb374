"""active_set: payload validation, normalisation against the plan, keep-sets, budget, signature,
deltas and refresh accounting."""

from pathlib import Path

import orjson
import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reap_swap.plan.active_set import (
    ActiveSetError,
    BudgetExceeded,
    LayerDelta,
    RefreshLedger,
    RefreshLimitExceeded,
    SwapRequest,
    check_budget,
    delta,
    delta_summary,
    normalize_active_set,
    resident_bytes,
    resident_sets,
    signature,
)
from reap_swap.plan.document import load_plan

FIXTURE = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "strict30-v2-plan.json"
E, PE = 16, 1000  # experts per layer, bytes per expert of the small plan


def small_plan_doc() -> dict:
    """Four layers of 16 experts: core {0,1,2}, slices a={3,4}, b={5,6,7}, c={7,8}; 9..15 not offered."""
    return {
        "mode": "dynamic_core_specialist",
        "budget": {
            "per_expert_bytes": PE,
            "swappable_expert_budget_bytes": 4 * 8 * PE,
            "max_refreshes_per_request": 2,
        },
        "perLayer": {
            f"layer_{i}": {
                "numExperts": E,
                "coreExperts": [0, 1, 2],
                "sliceCatalog": [
                    {"sliceId": "a", "experts": [3, 4]},
                    {"sliceId": "b", "experts": [5, 6, 7]},
                    {"sliceId": "c", "experts": [7, 8]},
                ],
            }
            for i in range(4)
        },
    }


PLAN = load_plan(small_plan_doc())
CANDIDATES = sorted(PLAN.layers[0].candidates)  # 0..8


# ----------------------------------------------------------------------------- payload


def test_swap_request_defaults_and_strict_types():
    req = SwapRequest(request_id="r1", active_set={"layer_3": [3, "b"]})
    assert (req.phase, req.budget_bytes, req.reset_router_stats, req.warm_start_only) == (
        "prefill",
        None,
        False,
        False,
    )
    assert req.active_set == {"layer_3": [3, "b"]}  # ints stay ids, strings stay slice ids


@pytest.mark.parametrize(
    "body, field",
    [
        ({"request_id": "", "active_set": {}}, "request_id"),
        ({"request_id": "r", "active_set": {}, "phase": "decode"}, "phase"),
        ({"request_id": "r", "active_set": {"0": [True]}}, "active_set"),
        ({"request_id": "r", "active_set": {"0": [3.0]}}, "active_set"),
        ({"request_id": "r", "active_set": {"0": 3}}, "active_set"),
        ({"request_id": "r", "active_set": {}, "budget_bytes": -1}, "budget_bytes"),
        ({"request_id": "r", "active_set": {}, "budgetBytes": 5}, "budgetBytes"),
        ({"request_id": "r"}, "active_set"),
    ],
)
def test_swap_request_rejects_bad_bodies_naming_the_field(body, field):
    with pytest.raises(pydantic.ValidationError) as info:
        SwapRequest.model_validate(body)
    assert field in {str(err["loc"][0]) for err in info.value.errors()}


# ----------------------------------------------------------------------------- normalisation


def test_slices_expand_and_layer_key_forms_merge():
    requested = normalize_active_set(PLAN, {"layer_1": ["a", 8], "1": ["c"], "2": []})
    assert requested == {1: frozenset({3, 4, 7, 8}), 2: frozenset()}


def test_unknown_layer_names_the_key_and_the_valid_range():
    with pytest.raises(ActiveSetError) as info:
        normalize_active_set(PLAN, {"layer_9": [3]})
    assert info.value.field == "active_set.layer_9"
    assert "unknown layer 'layer_9'" in info.value.message and "layers 0..3" in info.value.message
    for bad in ("layer_x", "L3", "-1", ""):
        with pytest.raises(ActiveSetError, match="unknown layer"):
            normalize_active_set(PLAN, {bad: []})


def test_id_outside_core_and_slices_names_layer_and_id():
    with pytest.raises(ActiveSetError) as info:
        normalize_active_set(PLAN, {"layer_2": [3, 12]})
    assert info.value.field == "active_set.layer_2[1]"
    assert info.value.message == "expert 12 of layer 2 is in neither the core nor any slice of the plan"
    with pytest.raises(ActiveSetError) as info:
        normalize_active_set(PLAN, {"3": ["a", "zz"]})
    assert (info.value.field, info.value.message) == ("active_set.3[1]", "unknown sliceId 'zz' in layer 3")
    with pytest.raises(ActiveSetError, match="expected an expert id"):
        normalize_active_set(PLAN, {"0": [True]})


layer_sets = st.dictionaries(
    st.integers(0, 3), st.lists(st.sampled_from(CANDIDATES + ["a", "b", "c"])), max_size=4
)


@settings(max_examples=100, deadline=None)
@given(sets=layer_sets, spellings=st.lists(st.booleans(), min_size=4, max_size=4))
def test_layer_key_spellings_are_equivalent(sets, spellings):
    long = {f"layer_{layer}": items for layer, items in sets.items()}
    mixed = {(f"layer_{layer}" if spellings[layer] else str(layer)): items for layer, items in sets.items()}
    assert normalize_active_set(PLAN, long) == normalize_active_set(PLAN, mixed)
    for layer, ids in normalize_active_set(PLAN, long).items():
        assert ids <= PLAN.layers[layer].candidates


def test_keep_sets_are_dense_core_plus_requested():
    keep = resident_sets(PLAN, normalize_active_set(PLAN, {"1": ["a"]}))
    assert keep == {
        0: frozenset({0, 1, 2}),
        1: frozenset({0, 1, 2, 3, 4}),
        2: frozenset({0, 1, 2}),
        3: frozenset({0, 1, 2}),
    }
    assert resident_bytes(PLAN, keep) == 14 * PE


# ----------------------------------------------------------------------------- budget


def test_budget_exceeded_reports_needed_budget_and_overflow():
    keep = resident_sets(PLAN, normalize_active_set(PLAN, {"0": ["a", "b", "c"]}))  # 9 + 3 + 3 + 3 experts
    assert check_budget(PLAN, keep, None) == 32 * PE  # the plan's budget
    with pytest.raises(BudgetExceeded) as info:
        check_budget(PLAN, keep, 17 * PE)
    err = info.value
    assert (err.needed_bytes, err.budget_bytes, err.overflow_bytes) == (18 * PE, 17 * PE, PE)
    assert err.field == "budget_bytes" and isinstance(err, ActiveSetError)
    assert "18,000" in err.message and "17,000" in err.message and "1,000 bytes over" in err.message


requested_sets = st.dictionaries(st.integers(0, 3), st.frozensets(st.sampled_from(CANDIDATES)), max_size=4)


@settings(max_examples=150, deadline=None)
@given(requested=requested_sets, budget=st.one_of(st.none(), st.integers(0, 50 * PE)))
def test_accepted_sets_never_exceed_the_budget(requested, budget):
    keep = resident_sets(PLAN, requested)
    limit = PLAN.swappable_budget_bytes if budget is None else budget
    if budget is not None and budget > PLAN.swappable_budget_bytes:  # above the pool: refused
        with pytest.raises(ActiveSetError, match="budget_bytes"):
            check_budget(PLAN, keep, budget)
        return
    try:
        applied = check_budget(PLAN, keep, budget)
    except BudgetExceeded as err:
        assert err.needed_bytes == resident_bytes(PLAN, keep) > limit == err.budget_bytes
    else:
        assert applied == limit and resident_bytes(PLAN, keep) <= limit


@pytest.mark.skipif(not FIXTURE.exists(), reason=f"shared fixture missing: {FIXTURE}")
def test_real_plan_two_slices_per_layer_fit_three_do_not():
    plan = load_plan(FIXTURE)

    def pick(n):
        return {f"layer_{i}": [s.slice_id for s in layer.slices[:n]] for i, layer in plan.layers.items()}

    two = resident_sets(plan, normalize_active_set(plan, pick(2)))
    assert check_budget(plan, two, None) == 16757880012
    with pytest.raises(BudgetExceeded) as info:
        check_budget(plan, resident_sets(plan, normalize_active_set(plan, pick(3))), None)
    assert info.value.overflow_bytes == info.value.needed_bytes - 16757880012 > 0


# ----------------------------------------------------------------------------- signature and delta


@settings(max_examples=150, deadline=None)
@given(a=requested_sets, b=requested_sets, data=st.data())
def test_signature_is_order_independent_and_tells_sets_apart(a, b, data):
    ka, kb = resident_sets(PLAN, a), resident_sets(PLAN, b)
    shuffled = {
        layer: frozenset(data.draw(st.permutations(sorted(ids))))
        for layer, ids in data.draw(st.permutations(list(ka.items())))
    }
    sig = signature(ka)
    assert len(sig) == 16 and int(sig, 16) >= 0
    assert signature(shuffled) == sig
    assert (signature(kb) == sig) == (kb == ka)


def test_signature_depends_on_layer_placement():
    assert signature({0: frozenset({1}), 1: frozenset()}) != signature({0: frozenset(), 1: frozenset({1})})


@settings(max_examples=150, deadline=None)
@given(
    old=st.dictionaries(st.integers(0, 5), st.frozensets(st.integers(0, 20))),
    new=st.dictionaries(st.integers(0, 5), st.frozensets(st.integers(0, 20))),
)
def test_delta_partitions_old_and_new(old, new):
    d = delta(old, new)
    assert set(d) == set(old) | set(new)
    for layer, x in d.items():
        added, removed, reused = set(x.added), set(x.removed), set(x.reused)
        assert added | reused == new.get(layer, set())
        assert removed | reused == old.get(layer, set())
        assert not (added & reused) and not (removed & reused) and not (added & removed)
        assert list(x.added) == sorted(x.added)
    summary = delta_summary(d)
    assert summary["totals"]["added"] == sum(len(x.added) for x in d.values())
    assert orjson.loads(orjson.dumps(summary)) == summary


def test_delta_summary_example():
    d = delta({0: frozenset({1, 2}), 1: frozenset({5})}, {0: frozenset({2, 3, 4}), 1: frozenset({5})})
    assert d[0] == LayerDelta(added=(3, 4), removed=(1,), reused=(2,))
    assert delta_summary(d) == {
        "layers": {
            "0": {"added": 2, "removed": 1, "reused": 1},
            "1": {"added": 0, "removed": 0, "reused": 1},
        },
        "totals": {"added": 2, "removed": 1, "reused": 2},
        "changed_layers": 1,
    }


# ----------------------------------------------------------------------------- refresh ledger


def test_refresh_ledger_counts_decode_refreshes_and_prefill_resets():
    ledger = RefreshLedger(PLAN.max_refreshes_per_request)  # 2
    assert ledger.record("r", "prefill") == 0
    assert ledger.record("r", "decode_refresh") == 1
    assert ledger.record("r", "decode_refresh") == 2
    with pytest.raises(RefreshLimitExceeded) as info:
        ledger.record("r", "decode_refresh")
    assert (info.value.request_id, info.value.limit) == ("r", 2)
    assert ledger.count("r") == 2  # the refused refresh is not counted
    assert ledger.count("other") == 0
    assert ledger.record("r", "prefill") == 0 and ledger.record("r", "decode_refresh") == 1
    with pytest.raises(ValueError):
        ledger.record("r", "decode")


def test_refresh_ledger_limit_zero_refuses_every_refresh():
    ledger = RefreshLedger(0)
    with pytest.raises(RefreshLimitExceeded):
        ledger.record("r", "decode_refresh")


def test_refresh_ledger_is_bounded_and_keeps_the_recent():
    ledger = RefreshLedger(5, max_entries=100)
    ledger.record("old-but-used", "decode_refresh")
    for i in range(1000):
        ledger.record(f"r{i}", "decode_refresh")
        if i % 50 == 0:
            ledger.count("old-but-used")  # reading keeps an entry fresh
    assert len(ledger) == 100
    assert ledger.count("r999") == 1 and ledger.count("r0") == 0
    assert ledger.count("old-but-used") == 1


def test_request_budget_cannot_exceed_the_plans():
    keep = resident_sets(PLAN, {})
    with pytest.raises(ActiveSetError) as err:
        check_budget(PLAN, keep, PLAN.swappable_budget_bytes + 1)
    assert err.value.field == "budget_bytes" and "above the plan's budget" in err.value.message
    assert check_budget(PLAN, keep, PLAN.swappable_budget_bytes) == PLAN.swappable_budget_bytes
