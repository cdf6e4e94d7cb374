"""The skewed-model CPU trace tooling: make_skewed_moe --rho kit-prefix, record_skew_trace's
plan input (prefill counts of a trace), sim_skew_policy's verdicts, and the committed trace."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from harness_modules import load_script

pytest.importorskip("torch")

from reap_swap.cache.trace import from_requests, load_trace  # noqa: E402

msk = load_script("make_skewed_moe")
rec = load_script("record_skew_trace")
sim = load_script("sim_skew_policy")
SKEW = Path(__file__).resolve().parents[2] / "research-notes/cache-sim/skew"


def test_kit_prefix_rho_is_the_12_layer_models_first_layers():
    assert msk.kit_prefix_rho(3) == list(msk.RHO_KIT[:3])
    assert msk.kit_prefix_rho(12) == list(msk.RHO_KIT)
    for bad in (0, 13):
        with pytest.raises(ValueError, match="kit-prefix"):
            msk.kit_prefix_rho(bad)
    con = msk.build_construction([0, 1, 2, 3, 4], hidden=16, experts=8, layers=3, rho=msk.kit_prefix_rho(3))
    full = msk.build_construction([0, 1, 2, 3, 4], hidden=16, experts=8, layers=12)
    for layer in range(3):  # same permutations and router columns as the 12-layer construction
        assert con.ranks[layer] == full.ranks[layer]
        assert bool((con.gate_cols[layer] == full.gate_cols[layer]).all())


def test_prefill_layer_stats_counts_only_prefill_steps():
    prefill = np.array([[[0, 1]], [[0, 2]]])  # 2 tokens, 1 layer, top-2
    decode = np.array([[[3, 1]]])
    trace = from_requests(
        [[prefill, decode], [np.array([[[2, 3]]])]],
        layers=[5],
        model="m",
        num_experts=4,
        top_k=2,
        per_expert_bytes=1,
    )
    stats = rec.prefill_layer_stats(trace)
    assert list(stats) == [5]
    assert stats[5].total_tokens == 3
    assert stats[5].expert_frequency.tolist() == [2, 1, 2, 1]  # the decode token (3, 1) is not counted


def _row(policy, budget, hit):
    return {"policy": policy, "budget": budget, "status": "ok", "totals": {"expert_hit_rate": hit}}


def test_verdicts_gap_and_dlearn_margin():
    rows = [_row("belady", "0.5", 0.90), _row("dlfu-seeded", "0.5", 0.88), _row("dlearn-seeded", "0.5", 0.89)]
    rows += [_row("lru", "0.5", 0.80)]
    v = sim.verdicts({"t": {"rows": rows}}, ["0.5"])["per_trace"]["t"]
    assert v["default_points_below_belady"]["0.5"] == pytest.approx(2.0)
    assert v["default_within_3"] is True
    assert v["dlearn_minus_best_other"]["0.5"] == pytest.approx(1.0)  # vs dlfu-seeded, belady excluded


@pytest.mark.skipif(not (SKEW / "skew-heldout.npz").is_file(), reason="trace not recorded")
def test_committed_skew_traces_match_the_construction():
    for split in ("calibration", "heldout"):
        t = load_trace(SKEW / f"skew-{split}.npz")
        assert t.topk_ids.dtype == np.uint8
        assert (t.num_experts, t.top_k, t.layers) == (128, 8, (0, 1, 2))
        assert t.num_requests == 32
