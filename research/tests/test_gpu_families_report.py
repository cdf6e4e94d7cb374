"""families_report.py (pure): residency points a plan allows, the decode bound, family.json and its
markdown, on fake arm results; gpu_pin_bench's choice of the pinned-allocator setting."""

import json
from pathlib import Path

import pytest
from harness_modules import load_script

FIELD_PLAN = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "strict30-v2-plan.json"


@pytest.fixture(scope="module")
def fr():
    return load_script("families_report")


def synthetic(layers=2, experts=8, core=0, budget=1.0, per_expert=100):
    """The shape of gpu_e2e.make_plan: core = the first ids, slices of 2 over the rest."""
    per_layer = {}
    for L in range(layers):
        rest = list(range(core, experts))
        per_layer[f"layer_{L}"] = {
            "coreExperts": list(range(core)),
            "sliceCatalog": [
                {"sliceId": f"layer_{L}_slice_{i:02d}", "experts": rest[j : j + 2]}
                for i, j in enumerate(range(0, len(rest), 2))
            ],
        }
    return {
        "budget": {
            "per_expert_bytes": per_expert,
            "swappable_expert_budget_bytes": int(layers * experts * budget) * per_expert,
        },
        "perLayer": per_layer,
    }


def test_a_plan_without_core_gets_0_25_50_100_and_back(fr):
    plan = synthetic()
    assert fr.startup_label(plan) == "0"
    got = [(label, fr.resident_count(plan, a)) for label, a in fr.phases(plan, 8)]
    assert got == [("25", 4), ("50", 8), ("100", 16), ("again", 0)]


def test_a_budget_under_100_percent_is_filled_with_slices_and_never_exceeded(fr):
    plan = synthetic(core=2, budget=0.6)  # 9 of 16 experts
    labels = dict(fr.phases(plan, 8))
    assert "100" not in labels and "50" in labels and "budget" in labels
    assert fr.resident_count(plan, labels["slices"]) == 2 * (2 + 2)
    assert fr.resident_count(plan, labels["budget"]) <= 9
    # round robin: each layer got its slices in catalog order, none skipped
    for key, items in labels["budget"].items():
        ids = [s["sliceId"] for s in plan["perLayer"][key]["sliceCatalog"]]
        assert items == ids[: len(items)]


def test_ids_outside_core_and_slices_are_not_offered(fr):
    plan = synthetic(core=2)
    plan["perLayer"]["layer_0"]["sliceCatalog"] = plan["perLayer"]["layer_0"]["sliceCatalog"][:1]
    assert not fr.offered(plan, {"layer_0": [0, 1, 2, 3, 4]})
    assert fr.offered(plan, {"layer_0": [0, 1, 2, 3, "layer_0_slice_00"]})
    assert "100" not in dict(fr.phases(plan, 8))


@pytest.mark.skipif(not FIELD_PLAN.exists(), reason="the field plan is not in ../shared")
def test_the_field_plan_points_fit_its_2663_slot_budget(fr):
    plan = json.loads(FIELD_PLAN.read_text())
    got = {label: fr.resident_count(plan, a) for label, a in fr.phases(plan, 256)}
    assert fr.resident_count(plan, {}) == 1960  # the core startup fills (run 8)
    assert list(got) == ["slices", "budget", "again"]
    assert 1960 < got["slices"] < got["budget"] <= 2663 and got["again"] == 1960


def phase(miss_ratio, tok_s, probe="a"):
    return {
        "router_misses": {"totals": {"miss_ratio": miss_ratio}},
        "decode_1": {"median": tok_s},
        "greedy": [{"tokens": [1, 2, 3]}],
        "moe_probe": {"ranks": [{"inputs": {"seed": 0}, "layers": {"l0": {"1": probe, "8": "x"}}}]},
    }


def test_bound_from_the_0_and_100_percent_points(fr):
    # t_res = 2 ms, t_all_missed = 8 ms: h = 0.5 -> 6 ms -> 166.7 tok/s
    b = fr.bound_rows({"0": phase(1.0, 100.0), "50": phase(0.5, 160.0), "100": phase(0.0, 500.0)}, None)
    assert b["t_resident_ms"] == pytest.approx(2.0) and b["t_all_missed_ms"] == pytest.approx(8.0)
    assert b["rows"]["50"]["bound"] == pytest.approx(1000 / 6)
    assert b["rows"]["50"]["ratio"] == pytest.approx(160 / (1000 / 6))
    assert not any(r["fit"] for r in b["rows"].values())


def test_bound_without_0_and_100_uses_stock_and_fits_the_lowest_hit_rate(fr):
    stock = {"decode_1": {"median": 500.0}}  # t_res 2 ms
    b = fr.bound_rows({"core": phase(0.5, 1000 / 6), "budget": phase(0.25, 200.0)}, stock)
    assert b["t_resident_from"] == "stock" and b["rows"]["core"]["fit"]
    assert b["t_all_missed_ms"] == pytest.approx(8.0)
    assert b["rows"]["core"]["ratio"] == pytest.approx(1.0)
    assert b["rows"]["budget"]["bound"] == pytest.approx(1000 / 4)


def test_a_phase_whose_swap_failed_is_not_timed(fr):
    # run 17: every swap failed (500, rolled back), so "100 %" served the 0 % set; its time read as
    # t_resident "from reap 100 %" and every ratio as 1.000. Now the failed phases drop out, and with no
    # stock time there is no bound at all
    phases = {"0": phase(1.0, 100.0), "50": phase(1.0, 100.0), "100": phase(1.0, 100.0)}
    for k in ("50", "100"):
        phases[k]["swap"] = {"status": 500}
    b = fr.bound_rows(phases, None)
    assert b["t_resident_ms"] is None and b["t_all_missed_ms"] is None
    assert b["rows"]["100"] == {"h": 0.0, "tok_s": None, "bound": None, "ratio": None, "fit": False,
                                "swap_failed": True}  # fmt: skip
    b = fr.bound_rows(phases, {"decode_1": {"median": 500.0}})
    assert b["t_resident_from"] == "stock" and b["t_all_missed_ms"] == pytest.approx(8.0)
    assert b["rows"]["50"]["ratio"] is None and b["rows"]["0"]["ratio"] == pytest.approx(1.0)


def test_summarize_and_markdown_on_fake_arms(fr):
    from reap_swap.bench.server_driver import compare

    reap = {
        "startup_s": 200.0,
        "phases": {"0": phase(1.0, 100.0), "100": phase(0.0, 500.0, probe="b")},
        "counters": {"observed": 48, "expected": 48, "equal": True},
        "status_start": {"workers": [{"uncounted_layers": {"3": "no RoutedExperts"}}]},
        "worker_status": {"result": {"results": [{"backend": {"refused_layers": {"layer 3": "bias"}}}]}},
        "host": {"rss_peak_gib": 9.5, "hbm_peak_gib": 20.0},
    }
    reap["phases"]["100"]["swap"] = {"bytes_copied": 2**30, "gbps_workers": 40.0, "status": 200}
    stock = {"startup_s": 150.0, **phase(0.0, 520.0), "host": {"rss_peak_gib": 4.0}}
    doc = fr.summarize("mixtral", {"shape": {"layers": 2}}, reap, stock, compare)
    p0, p100 = doc["phases"]["0"], doc["phases"]["100"]
    assert p0["greedy_vs_stock"]["identical"] == 1 and p0["probe_vs_stock"]["equal"] == 2
    assert p100["probe_vs_stock"]["equal"] == 1 and p100["probe_vs_stock"]["differ"] == ["l0@1"]
    assert p100["probe_vs_startup"]["equal"] == 1 and p100["swap_bytes"] == 2**30
    assert doc["uncounted_layers"] == {"3": "no RoutedExperts"} and doc["refused_layers"] == {
        "layer 3": "bias"
    }
    text = "\n".join(fr.markdown([doc]))
    assert "| mixtral | 100 | – | 1.00 | 40.0 | 1.000 | 500.0 | 500.0 | 1.000 | 1/1 | 1/2 | 1/2 |" in text
    assert "counters 48 of 48 (equal)" in text and "refused layers: 1 (bias)" in text


def test_compare_probes_is_moe_probes_own(fr):
    pytest.importorskip("torch")
    from reap_swap.engine.moe_probe import compare_probes

    a = {"inputs": {"seed": 0}, "layers": {"l0": {"1": "a", "8": "b"}, "l1": {"1": "c"}}}
    b = {"inputs": {"seed": 0}, "layers": {"l0": {"1": "a", "8": "z"}, "l1": {"1": "c"}}}
    assert fr.compare_probes(a, b) == compare_probes(a, b)
    assert fr.compare_probes(a, {**b, "inputs": {"seed": 1}}) == compare_probes(
        a, {**b, "inputs": {"seed": 1}}
    )


def test_pin_bench_chooses_register_only_when_it_read_back_and_was_faster():
    pb = load_script("gpu_pin_bench")
    fast = {"setting": "register8", "uva_view_ok": True, "pinned": True, "gib_per_s": 3.0}
    slow = {"setting": "default", "gib_per_s": 0.6}
    assert pb.choose([slow, fast]) == "register8"
    assert pb.choose([slow, {**fast, "uva_view_ok": False}]) == "default"
    assert pb.choose([slow, {**fast, "gib_per_s": 0.62}]) == "default"
    assert pb.choose([slow, {"setting": "register8", "error": "boom"}]) == "default"


def test_an_engaged_device_cache_skips_the_bound_and_reports_its_hits(fr):
    # run 27 (Qwen3.5 + --reap-cache-device on): h from /router_misses counts only the pinned set, so a bound
    # fitted on it read 1.0 / 1.03 while the tail served most of the misses
    from reap_swap.bench.server_driver import compare

    cache = {"engaged": True, "reason": None, "policy": "core+dlfu", "layers": {"0": {}, "1": {}},
             "totals": {"hits": 30, "misses": 10, "promotions": 4, "evictions": 2, "read_through_steps": 1}}  # fmt: skip
    reap = {"phases": {"core": phase(0.8, 150.0)}, "status_end": {"cache": cache}}
    stock = {"startup_s": 150.0, **phase(0.0, 200.0)}
    doc = fr.summarize("qwen35", {}, reap, stock, compare)
    assert doc["bound"]["rows"] == {} and "pinned set only" in doc["bound"]["skipped"]
    assert doc["cache"]["hit_ratio"] == pytest.approx(0.75) and doc["cache"]["layers"] == 2
    text = "\n".join(fr.markdown([doc]))
    assert "| qwen35 | core | – | – | n/a | 0.200 | 150.0 | n/a | n/a |" in text
    assert "device cache engaged on 2 layers, core+dlfu: 0.750 of selections hit" in text
    cache["engaged"], cache["reason"] = False, "too few slots"
    doc = fr.summarize("qwen35", {}, reap, stock, compare)
    assert doc["bound"]["rows"]["core"]["fit"] and "NOT engaged (too few slots)" in "\n".join(
        fr.markdown([doc])
    )
    assert fr.summarize("qwen35", {}, {"phases": reap["phases"]}, stock, compare)["cache"] is None


def test_gpu_summarize_families_lists_tables_skips_and_unmerged(fr, tmp_path):
    from reap_swap.bench.server_driver import compare

    doc = fr.summarize("mixtral", {}, {"phases": {"0": phase(1.0, 100.0)}}, None, compare)
    (tmp_path / "mixtral").mkdir()
    (tmp_path / "mixtral" / "family.json").write_text(json.dumps(doc))
    (tmp_path / "deepseek_v3_d2").mkdir()
    (tmp_path / "deepseek_v3_d2" / "reap.skipped.json").write_text(json.dumps({"skipped": "40s left"}))
    (tmp_path / "qwen35").mkdir()
    (tmp_path / "pin_bench.json").write_text(
        json.dumps({"chosen": "default", "results": [{"setting": "default", "gib_per_s": 0.5}]})
    )
    text = "\n".join(load_script("gpu_summarize").families_section(tmp_path))
    assert "| mixtral | 0 |" in text and "- deepseek_v3_d2 reap: 40s left" in text
    assert "- qwen35: no family.json" in text and "chosen default" in text
