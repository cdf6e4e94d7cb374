"""research/gpu/group_e2e.py (gpu_quant_e2e.py --reap-group-size): the shuffled plan and the groups
a swap is expected to admit (moved from tests/test_group_wiring.py)."""

from __future__ import annotations

import json

from harness_modules import load_script


def _shuffled_two_slice_plan(ge, tmp_path):
    """A 16-expert, two-slice plan written to tmp_path and shuffled by group_e2e (seed 0)."""
    plan = {
        "mode": "dynamic_core_specialist",
        "model": "m",
        "budget": {"per_expert_bytes": 4, "swappable_expert_budget_bytes": 64, "core_budget_bytes": 0,
                   "specialist_budget_bytes": 64, "max_refreshes_per_request": 4},
        "perLayer": {"layer_0": {"rawLayerKey": "0", "numExperts": 16, "coreExperts": [], "coreByteCost": 0,
                                 "sliceCatalog": [{"sliceId": f"layer_0_slice_{i:02d}", "byteCost": 32,
                                                   "experts": list(range(8 * i, 8 * i + 8))} for i in (0, 1)]}},
    }  # fmt: skip
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    ge.shuffle_plan(path, seed=0)
    return path


def test_group_e2e_shuffles_the_plan_and_expects_admitted_groups_times_payload(tmp_path):
    ge = load_script("group_e2e")
    path = _shuffled_two_slice_plan(ge, tmp_path)
    expect = ge.GroupExpect(path, {"0": {"layout": "grouped", "group_size": 2, "group_payload_bytes": 100}})
    perm = expect.perms[0]
    assert not perm.is_identity and expect.active
    first = expect.swap({"layer_0": list(range(4))})
    groups = {perm.to_physical[e] // 2 for e in range(4)}
    assert first == {"admitted_groups": len(groups), "expected_bytes": 100 * len(groups)}
    assert expect.swap({"layer_0": list(range(4))}) == {"admitted_groups": 0, "expected_bytes": 0}


def test_group_e2e_counts_identity_order_layers_in_id_order(tmp_path):
    """INT4 identity-order groups (research.md int4perm) report `permuted: false`: ids 0..3 are one
    group of 4 whatever the plan's shuffled slices say."""
    ge = load_script("group_e2e")
    path = _shuffled_two_slice_plan(ge, tmp_path)
    lay = {"layout": "grouped", "group_size": 4, "group_payload_bytes": 100, "permuted": False}
    expect = ge.GroupExpect(path, {"0": lay})
    assert not expect.perms[0].is_identity  # the plan's order, which the identity layer ignores
    assert expect.swap({"layer_0": [0, 1, 2, 3]}) == {"admitted_groups": 1, "expected_bytes": 100}
    assert expect.swap({"layer_0": [0, 5]}) == {"admitted_groups": 1, "expected_bytes": 100}
