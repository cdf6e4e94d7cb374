"""The pure core of grouped residency units (reap_swap.sizing.groups): order, groups, set costs."""

from __future__ import annotations

from pathlib import Path

import pytest

from reap_swap.sizing import groups as gl
from reap_swap.sizing.quant.padding import MiB, group_bytes_per_expert, qwen3_30b_formats

BF16 = (("w13_weight", 1536 * 2048 * 2), ("w2_weight", 2048 * 768 * 2))
FP8 = (("w13_weight", 1536 * 2048), ("w2_weight", 2048 * 768))
PLAN = Path(__file__).resolve().parents[1] / "plans" / "reap-mini-moe.plan.json"


def test_physical_order_core_then_slices_then_fill_then_rest():
    order = gl.physical_order(10, core=[7, 3], slices=[[5, 3, 1], [9, 5]], fill=[0, 42, 9])
    assert order == [3, 7, 5, 1, 9, 0, 2, 4, 6, 8]
    perm = gl.Permutation.from_order(order)
    assert all(perm.to_logical[perm.to_physical[e]] == e for e in range(10))
    assert perm.to_physical[3] == 0 and perm.to_physical[9] == 4
    assert not perm.is_identity and gl.Permutation.identity(4).is_identity


def test_permutation_rejects_a_non_permutation():
    with pytest.raises(ValueError, match="not a permutation"):
        gl.Permutation.from_order([0, 0, 1])


def test_group_size_auto_per_format():
    assert gl.choose_group_size(BF16)[0] == 1  # 10 MiB private unit: 11.1 % already
    assert gl.choose_group_size(FP8)[0] == 2  # 6 MiB private (33 %) -> pair of 10 MiB (11.1 %)
    assert gl.choose_group_size(FP8, "4")[0] == 4
    assert gl.choose_group_size((("w13_weight", 4096), ("w13_bias", 64)))[0] == 1
    with pytest.raises(ValueError, match="--reap-group-size"):
        gl.choose_group_size(FP8, "3")


def test_fp8_pair_layout_strides_pages_and_payload():
    lay = gl.plan_groups(FP8, 128, 2)
    assert lay.strides == (3 * MiB, 2 * MiB)  # w13 3 MiB slab, w2 1.5 MiB slab padded to 2 MiB
    assert lay.unit_bytes == (6 * MiB, 4 * MiB)  # 3 + 2 pages per pair
    assert lay.group_bytes == 10 * MiB and lay.bytes_per_expert == 5 * MiB
    assert lay.group_payload_bytes == (3 + 3) * MiB + (2 + 1.5) * MiB
    assert lay.num_groups == 64 and list(lay.members(63)) == [126, 127]
    assert abs(lay.padding_overhead - 1 / 9) < 1e-9


def test_layout_agrees_with_quant_padding_for_every_strided_format():
    for fmt in qwen3_30b_formats():
        if fmt.kernel != "strided":
            continue
        slabs = (("w13_weight", fmt.w13), ("w2_weight", fmt.w2))
        for b in (1, 2, 4):
            lay = gl.plan_groups(slabs, 128, b)
            assert lay.bytes_per_expert == group_bytes_per_expert(fmt, b), (fmt.name, b)
        b, _ = gl.choose_group_size(slabs)
        assert gl.plan_groups(slabs, 128, b).padding_overhead < gl.MAX_WASTE, fmt.name


def test_b1_is_one_private_unit_per_tensor_and_odd_expert_counts_keep_a_partial_group():
    lay = gl.plan_groups(FP8, 7, 1)
    assert lay.unit_bytes == (4 * MiB, 2 * MiB) and lay.group_payload_bytes == int(4.5 * MiB)
    lay = gl.plan_groups(FP8, 7, 2)
    assert lay.num_groups == 4 and list(lay.members(3)) == [6]
    assert lay.payload(0, 1) == 3 * MiB  # the lone last expert's w13 slab


def test_stride_must_be_16_byte_aligned():
    with pytest.raises(ValueError, match="16 B"):
        gl.plan_groups((("w13_weight", 100),), 8, 2, granule=24)


def test_set_translation_any_member_makes_a_group_resident():
    perm = gl.Permutation.from_order(gl.physical_order(8, core=[6, 1], slices=[[4, 2]]))
    # physical: 0:1 1:6 2:2 3:4 4:0 5:3 6:5 7:7
    assert gl.groups_for([1, 6, 2], perm, 2) == {0, 1}
    assert gl.residents_of({0, 1}, perm, 2) == {1, 6, 2, 4}  # 4 rides along with 2
    lay = gl.plan_groups(FP8, 8, 2)
    cost = gl.set_cost([1, 6, 2], perm, lay)
    assert (cost.wanted, cost.groups, cost.resident, cost.hbm_bytes) == (3, 2, 4, 20 * MiB)
    assert gl.group_target({0: [1, 6, 2], 9: [1]}, {0: perm}, {0: 2}) == {0: [0, 1]}


def test_plan_order_makes_plan_sets_cheap_and_id_order_does_not():
    fp8 = [f for f in qwen3_30b_formats() if f.name.startswith("FP8 block")]
    rows = gl.plan_ordered_rows(fp8, shapes=((16, 8),))
    for r in rows:  # aligned core and slices: exactly the pair cost, far below the private unit
        assert r["grouped_plan_order_mib"] == pytest.approx(5.0)
        assert r["private_mib"] == pytest.approx(6.0)
        assert r["grouped_id_order_mib"] > r["private_mib"]  # groups without the order lose
    assert "grouped, plan order" in gl.plan_ordered_markdown(rows)


def test_plan_permutations_from_a_real_plan():
    from reap_swap.plan.document import load_plan

    plan = load_plan(PLAN)
    perms = gl.plan_permutations(plan)
    assert set(perms) == set(plan.layers)
    for index, lp in plan.layers.items():
        perm = perms[index]
        assert sorted(perm.to_logical) == list(range(lp.num_experts))
        core_phys = sorted(perm.to_physical[e] for e in lp.core)
        assert core_phys == list(range(len(lp.core)))  # the core comes first
        if lp.slices:
            first = [e for e in lp.slices[0].experts if e not in lp.core]
            assert sorted(perm.to_physical[e] for e in first) == list(
                range(len(lp.core), len(lp.core) + len(first))
            )


def test_layer_status_names_layout_and_b():
    lay = gl.plan_groups(FP8, 128, 2)
    st = gl.layer_status(lay, gl.Permutation.identity(128), "auto")
    assert st["layout"] == "grouped" and st["group_size"] == 2 and st["bytes_per_expert"] == 5 * MiB
    assert (
        gl.layer_status(gl.plan_groups(BF16, 128, 1), gl.Permutation.identity(128), "x")["layout"]
        == "private"
    )
