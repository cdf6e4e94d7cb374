"""Issue 17's guards: the pure summariser (guard_report) from synthetic samples (the guard
harness, research/gpu/gpu_guards.py, is tested in research/tests/test_gpu_guards.py)."""

from __future__ import annotations

import pytest

from reap_swap.bench.guards import cache_not_engaged, decode_markdown, decode_summary, swap_summary


def _swap_samples():
    out = []
    for rep, (off, on) in enumerate([(45.0, 52.0), (46.0, 53.0), (44.0, 51.0), (45.5, 49.0), (45.2, 52.5)]):
        for arm, g, pub in (("0", off, 0.003), ("8", on, 0.0004)):
            phases = {"publish": pub, "publish_overlapped": 0.0 if arm == "0" else 0.002, "admit": 0.017}
            out.append({"case": "1GiB_delta", "arm": arm, "rep": rep, "gbps": g, "phases": phases})
    out.append({"case": "10pct_pool", "arm": "8", "rep": 0, "gbps": 50.0, "phases": {}})
    return out


def test_swap_summary_medians_ratio_and_guard():
    s = swap_summary(_swap_samples(), default_arm="8", baseline_arm="0")
    on, off = s["cases"]["1GiB_delta"]["8"], s["cases"]["1GiB_delta"]["0"]
    assert on["gbps"]["median"] == 52.0 and on["gbps"]["n"] == 5 and off["gbps"]["median"] == 45.2
    assert on["gbps_vs_0"] == pytest.approx(52.0 / 45.2) and off["gbps_vs_0"] == 1.0
    assert on["publish_ms"]["median"] == pytest.approx(0.4) and off["publish_ms"]["median"] == pytest.approx(
        3.0
    )
    assert on["publish_overlapped_ms"]["median"] == pytest.approx(2.0)
    assert s["guard"] == {
        "case": "1GiB_delta",
        "arm": "8",
        "gbps_median": 52.0,
        "target_gbps": 50.0,
        "met": True,
    }
    assert s["cases"]["10pct_pool"]["8"]["gbps_vs_0"] is None  # no baseline in that case


def test_swap_guard_missed_and_missing():
    samples = [dict(x, gbps=x["gbps"] - 5) for x in _swap_samples()]
    assert swap_summary(samples, "8", "0")["guard"]["met"] is False
    assert swap_summary([], "8", "0")["guard"]["met"] is None


def _decode_samples():
    # serve 0: stock 700, reap 690, reap-cache 680 (medians); serve 1: 720 / 700 / 690
    table = {0: {"stock": [690, 700, 710], "reap": [680, 690, 700], "reap-cache": [670, 680, 690]},
             1: {"stock": [715, 720, 725], "reap": [695, 700, None], "reap-cache": [685, 690, 695]}}  # fmt: skip
    return [
        {"arm": arm, "serve": s, "round": r, "tok_s": v}
        for s, arms in table.items()
        for arm, vals in arms.items()
        for r, v in enumerate(vals)
    ]


def test_decode_summary_pooled_and_serve_medians():
    s = decode_summary(_decode_samples())
    stock, reap, cache = (s["arms"][a] for a in ("stock", "reap", "reap-cache"))
    assert stock["per_serve_median"] == {0: 700, 1: 720} and stock["serves"] == 2
    assert stock["pooled"]["median"] == 712.5 and stock["pooled"]["n"] == 6
    assert reap["pooled"]["n"] == 5  # the failed (None) sample is not counted
    assert reap["per_serve_median"] == {0: 690, 1: 697.5}
    assert reap["vs_stock"]["serve_medians"] == pytest.approx(693.75 / 710)
    assert reap["vs_stock"]["pooled"] == pytest.approx(695 / 712.5)
    assert reap["vs_stock"]["met_pooled"] is True  # 0.9754
    assert cache["vs_stock"]["serve_medians"] == pytest.approx(685 / 710)
    assert cache["vs_stock"]["met_serve_medians"] is False  # 0.9648
    assert "vs_stock" not in stock
    # paired: per round arm / stock of that round, median per serve, median of the serves
    assert reap["paired_per_serve"][0] == pytest.approx(690 / 700)
    assert reap["paired_per_serve"][1] == pytest.approx((695 / 715 + 700 / 720) / 2)  # round 2 failed
    assert reap["vs_stock"]["paired"] == pytest.approx((690 / 700 + (695 / 715 + 700 / 720) / 2) / 2)
    assert reap["vs_stock"]["met_paired"] is True
    md = decode_markdown(s)
    assert "| reap | 2 | 5 |" in md and "| stock | 2 | 6 | 712.5" in md and "0.975" in md


def test_paired_reading_cancels_round_drift():
    """Every arm of a round moves together (run 12: 352-639 tok/s): the pooled ratio is noise, the
    paired one is the arm's own 0.98."""
    drift = [400, 650, 380, 600, 500, 630, 360]
    samples = [
        {"arm": arm, "serve": 0, "round": r, "tok_s": d * f}
        for r, d in enumerate(drift)
        for arm, f in (("stock", 1.0), ("reap-cache", 0.98))
    ]
    samples = [x for x in samples if not (x["arm"] == "stock" and x["round"] == 1)]  # one lost
    row = decode_summary(samples)["arms"]["reap-cache"]
    assert row["vs_stock"]["paired"] == pytest.approx(0.98)
    assert row["vs_stock"]["pooled"] != pytest.approx(0.98, abs=0.01)


def test_refused_arm_reads_not_measured():
    s = decode_summary(_decode_samples()[:6], refused={"reap-cache": "cache not engaged (mode device): x"})
    row = s["arms"]["reap-cache"]
    assert row["not_measured"].startswith("cache not engaged")
    assert row["vs_stock"]["met_paired"] is None and row["vs_stock"]["paired"] is None
    assert "not measured: cache not engaged" in decode_markdown(s)


def _cache(engaged=True, slots=8, layers=12, steps=5, mode="device"):
    rows = {str(i): {"engaged": True, "slots": slots, "tail_slots": slots} for i in range(layers)}
    return {"engaged": engaged, "mode": mode, "layers": rows, "steps": steps, "reason": None}


def test_cache_not_engaged_names_the_reason():
    assert cache_not_engaged(_cache(), 12, 8) is None
    assert cache_not_engaged(_cache(), 12, 8, ran=True) is None
    assert "no step" in cache_not_engaged(_cache(steps=0), 12, 8, ran=True)
    assert "8 of 12 layers" not in (cache_not_engaged(_cache(), 12, 8) or "")
    assert "11 of 12" in cache_not_engaged(_cache(layers=11), 12, 8)
    assert "expected 8" in cache_not_engaged(_cache(slots=4), 12, 8)
    assert cache_not_engaged(None, 12, 8) == "no cache section in /reap/status"
    # run 12's arm: auto on a pool of exactly every expert
    run12 = {"engaged": False, "mode": "device", "layers": {"0": {"engaged": False, "reason": "auto: 0"}},
             "reason": "--reap-cache-slots auto: 0 pool slot(s) beyond the pinned set"}  # fmt: skip
    assert "0 pool slot(s) beyond" in cache_not_engaged(run12, 12, 8)
    layer_off = _cache()
    layer_off["layers"]["3"] = {"engaged": False, "reason": "prepare/finalize x"}
    assert "11 of 12" in cache_not_engaged(layer_off, 12, 8) and "prepare/finalize" in cache_not_engaged(
        layer_off, 12, 8
    )


def test_decode_summary_without_stock_gives_no_ratio():
    s = decode_summary([{"arm": "reap", "serve": 0, "round": 0, "tok_s": 1.0}])
    assert s["arms"]["reap"]["vs_stock"]["pooled"] is None
    assert s["arms"]["reap"]["vs_stock"]["met_pooled"] is None


def test_decode_guard_summaries_with_nothing_or_one_arm():
    assert "| arm |" in decode_markdown(decode_summary([]))
    one = decode_summary([{"arm": "reap", "serve": 0, "round": 0, "tok_s": None}])  # a failed stream
    decode_markdown(one)
    assert (one["arms"]["reap"].get("vs_stock") or {}).get("pooled") is None


def test_swap_guard_summary_without_the_candidate_arm():
    rows = [{"case": "10pct_pool", "arm": "0", "gbps": 50.0, "phases": {"publish": 0.001}}]
    out = swap_summary(rows, default_arm="8", baseline_arm="0")
    assert "10pct_pool" in out["cases"]
