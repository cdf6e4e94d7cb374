"""forensics: worker aggregation without TP double counting, router-miss summaries, bounded ledgers."""

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reap_swap.plan.forensics import (
    ForensicsLog,
    StatsLedger,
    add_stats,
    aggregate_workers,
    mask_outside,
    summarize_router_misses,
)


def report(layers, tp_rank=0, dp_rank=0, tp_size=1, rank=None):
    return {
        "rank": rank if rank is not None else dp_rank * tp_size + tp_rank,
        "tp_rank": tp_rank,
        "tp_size": tp_size,
        "dp_rank": dp_rank,
        "layers": {str(layer): {"counts": list(c), "weights": list(w)} for layer, (c, w) in layers.items()},
    }


def test_tp_ranks_are_not_double_counted_and_dp_groups_are_summed():
    dp0 = {0: ([1, 2, 0], [0.5, 1.0, 0.0]), 3: ([4, 0, 0], [2.0, 0.0, 0.0])}
    dp1 = {0: ([0, 1, 1], [0.0, 0.25, 0.25])}
    reports = [
        report(dp0, tp_rank=1, dp_rank=0, tp_size=2),
        report(dp0, tp_rank=0, dp_rank=0, tp_size=2),
        report(dp1, tp_rank=0, dp_rank=1, tp_size=2),
        report(dp1, tp_rank=1, dp_rank=1, tp_size=2),
    ]
    out = aggregate_workers(reports)
    assert list(out) == [0, 3]
    assert out[0] == {"counts": [1, 3, 1], "weights": [0.5, 1.25, 0.25], "tp_disagreement": []}
    assert out[3] == {"counts": [4, 0, 0], "weights": [2.0, 0.0, 0.0], "tp_disagreement": []}


def test_tp_disagreement_is_flagged_and_rank0_counts_are_kept():
    good = {0: ([1, 2], [0.5, 1.0])}
    bad = {0: ([1, 3], [0.5, 1.5]), 1: ([1, 0], [1.0, 0.0])}
    out = aggregate_workers([report(good, tp_rank=0, tp_size=2), report(bad, tp_rank=1, tp_size=2)])
    assert out[0]["counts"] == [1, 2]
    assert out[0]["tp_disagreement"] == [{"dp_rank": 0, "tp_rank": 1}]
    # a layer only a non-reference rank reported: flagged, counted as nothing
    assert out[1] == {
        "counts": [0, 0],
        "weights": [0.0, 0.0],
        "tp_disagreement": [{"dp_rank": 0, "tp_rank": 1}],
    }


def test_mismatched_expert_counts_across_dp_groups_are_an_error():
    with pytest.raises(ValueError, match="layer 0"):
        aggregate_workers(
            [
                report({0: ([1, 2], [1.0, 1.0])}, dp_rank=0),
                report({0: ([1, 2, 3], [1.0, 1.0, 1.0])}, dp_rank=1),
            ]
        )


stats = st.integers(1, 8).flatmap(
    lambda e: st.dictionaries(
        st.integers(0, 5),
        st.tuples(
            st.lists(st.integers(0, 1000), min_size=e, max_size=e),
            st.lists(st.floats(0, 100, allow_nan=False), min_size=e, max_size=e),
        ),
        min_size=1,
        max_size=4,
    )
)


@settings(max_examples=100, deadline=None)
@given(layers=stats, tp_size=st.integers(1, 8))
def test_identical_tp_ranks_aggregate_to_one_rank(layers, tp_size):
    one = aggregate_workers([report(layers)])
    many = aggregate_workers([report(layers, tp_rank=t, tp_size=tp_size) for t in reversed(range(tp_size))])
    assert many == one
    assert all(entry["tp_disagreement"] == [] for entry in many.values())
    assert {layer: entry["counts"] for layer, entry in one.items()} == {
        l: list(c) for l, (c, _) in layers.items()
    }


def test_router_miss_summary_by_hand():
    layer_stats = {
        0: {"counts": [5, 0, 3, 2], "weights": [2.0, 0.0, 1.0, 1.0]},
        "1": {"counts": [0, 0, 0, 0], "weights": [0.0, 0.0, 0.0, 0.0]},
        2: {"counts": [1, 1, 0, 0], "weights": [0.5, 0.5, 0.0, 0.0]},
    }
    keep = {0: frozenset({0, 1}), 1: frozenset({0})}  # layer 2 is not managed: all resident
    s = summarize_router_misses(layer_stats, mask_outside(layer_stats, keep))
    assert s["layers"]["0"] == {
        "observed_selections": 10,
        "missed_selections": 5,
        "observed_mass": 4.0,
        "inactive_mass": 2.0,
        "inactive_experts": [2, 3],
        "expert_counts": [5, 0, 3, 2],
        "miss_ratio": 0.5,
        "inactive_mass_ratio": 0.5,
    }
    assert s["layers"]["1"]["miss_ratio"] == 0.0 and s["layers"]["1"]["inactive_mass_ratio"] == 0.0
    assert s["layers"]["2"]["missed_selections"] == 0 and s["layers"]["2"]["inactive_experts"] == []
    assert s["totals"] == {
        "observed_selections": 12,
        "missed_selections": 5,
        "observed_mass": 5.0,
        "inactive_mass": 2.0,
        "inactive_experts": 2,
        "miss_ratio": 5 / 12,
        "inactive_mass_ratio": 0.4,
    }
    assert orjson.loads(orjson.dumps(s)) == s


@settings(max_examples=100, deadline=None)
@given(layers=stats, data=st.data())
def test_misses_are_bounded_by_observations(layers, data):
    layer_stats = {l: {"counts": c, "weights": w} for l, (c, w) in layers.items()}
    keep = {l: frozenset(data.draw(st.sets(st.integers(0, len(c) - 1)))) for l, (c, _) in layers.items()}
    s = summarize_router_misses(layer_stats, mask_outside(layer_stats, keep))
    for l, row in s["layers"].items():
        assert 0 <= row["missed_selections"] <= row["observed_selections"]
        assert 0 <= row["miss_ratio"] <= 1 and 0 <= row["inactive_mass_ratio"] <= 1 + 1e-9
        assert not set(row["inactive_experts"]) & keep[int(l)]
        assert row["inactive_experts"] == sorted(row["inactive_experts"])
    # everything resident: no misses at all
    full = {l: frozenset(range(len(c))) for l, (c, _) in layers.items()}
    assert (
        summarize_router_misses(layer_stats, mask_outside(layer_stats, full))["totals"]["missed_selections"]
        == 0
    )


def test_stats_ledger_accumulates_per_request():
    ledger = StatsLedger()
    assert ledger.get("r") is None
    ledger.open("r")
    assert ledger.get("r") == {}
    ledger.close_into("r", {"0": {"counts": [1, 2], "weights": [0.5, 1.0]}})
    ledger.open("r")  # a refresh of the same request keeps its total
    ledger.close_into(
        "r", {0: {"counts": [1, 0], "weights": [0.25, 0.0]}, 1: {"counts": [3], "weights": [3.0]}}
    )
    got = ledger.get("r")
    assert got == {0: {"counts": [2, 2], "weights": [0.75, 1.0]}, 1: {"counts": [3], "weights": [3.0]}}
    got[0]["counts"][0] = 99  # a copy: the ledger is unaffected
    assert ledger.get("r")[0]["counts"][0] == 2
    with pytest.raises(ValueError):
        ledger.close_into("r", {0: {"counts": [1], "weights": [1.0]}})


def test_stats_ledger_and_forensics_log_are_bounded():
    ledger, log = StatsLedger(max_entries=10), ForensicsLog(max_entries=10)
    for i in range(100):
        ledger.open(f"r{i}")
        log.update(f"r{i}", refresh_count=0)
    assert len(ledger) == 10 and len(log) == 10
    assert "r99" in ledger and "r89" not in ledger and log.get("r0") is None


def test_forensics_log_merges_fields():
    log = ForensicsLog()
    log.update("r", last_swap={"signature": "abc"}, refresh_count=0, plan_identity="p")
    record = log.update("r", refresh_count=1)
    assert record == {
        "request_id": "r",
        "last_swap": {"signature": "abc"},
        "refresh_count": 1,
        "plan_identity": "p",
    }
    record["refresh_count"] = 7
    assert log.get("r")["refresh_count"] == 1


def test_add_stats_sums_layerwise_and_refuses_width_mismatch():
    a = {0: {"counts": [1, 2], "weights": [0.5, 1.0]}}
    b = {"0": {"counts": [1, 0], "weights": [0.5, 0.0]}, 1: {"counts": [3], "weights": [1.5]}}
    assert add_stats(a, b) == {
        0: {"counts": [2, 2], "weights": [1.0, 1.0]},
        1: {"counts": [3], "weights": [1.5]},
    }
    assert add_stats(None, b) == {
        0: {"counts": [1, 0], "weights": [0.5, 0.0]},
        1: {"counts": [3], "weights": [1.5]},
    }
    with pytest.raises(ValueError):
        add_stats(a, {0: {"counts": [1], "weights": [1.0]}})
