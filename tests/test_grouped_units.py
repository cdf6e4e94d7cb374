"""residency.grouped on CPU (no CUDA): the in-place permutation of kept-whole per-expert tensors,
the logical -> physical id remap, and the grouped swap (logical set -> groups) over a fake store.
The VMM data path itself runs in tests/gpu/test_grouped_engine.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from reap_swap.cache.slot_table import PoolCapacityError, SlotTable  # noqa: E402
from reap_swap.engine.residency import grouped  # noqa: E402
from reap_swap.sizing.groups import Permutation, physical_order, plan_groups  # noqa: E402

E = 8
FP8 = (("w13_weight", 1536 * 2048), ("w2_weight", 2048 * 768))


def _perm():
    return Permutation.from_order(physical_order(E, core=[6, 1], slices=[[4, 2], [7]]))


def test_permute_rows_in_place_keeps_the_storage_and_skips_shared_tensors():
    perm = _perm()
    scales = torch.arange(E * 3, dtype=torch.float32).view(E, 3)
    original, ptr = scales.clone(), scales.data_ptr()
    alias = scales  # what vLLM's quant config would hold
    assert grouped.permute_rows_(scales, perm)
    assert scales.data_ptr() == ptr
    for p in range(E):
        assert torch.equal(alias[p], original[perm.to_logical[p]])
    scalar = torch.tensor(2.0)
    shared = torch.ones(3, 4)
    assert not grouped.permute_rows_(scalar, perm) and not grouped.permute_rows_(shared, perm)
    assert torch.equal(shared, torch.ones(3, 4))


def test_remap_ids_maps_logical_to_physical_and_keeps_shape_and_dtype():
    perm = _perm()
    layer = grouped.GroupedLayer(
        0, plan_groups(FP8, E, 2), perm, {}, {}, torch.tensor(perm.to_physical, dtype=torch.int32)
    )
    ids = torch.tensor([[6, 1], [7, 0], [3, 3]], dtype=torch.int32)
    out = grouped.remap_ids(layer, ids)
    assert out.dtype == ids.dtype and out.shape == ids.shape
    assert out.tolist() == [[perm.to_physical[e] for e in row] for row in ids.tolist()]
    # a weight row read at the physical id is the logical expert's row
    w = torch.arange(E).float()
    w_phys = w.index_select(0, torch.tensor(perm.to_logical))
    assert torch.equal(w_phys[out.long()], w[ids.long()])


class GroupStore:
    """A fake ExpertStore over groups: remembers which group each slot holds."""

    def __init__(self, payload: int):
        self.bytes_per_expert = payload
        self.slots: dict[int, tuple[int, int]] = {}
        self.copies = 0

    def quiesce(self):
        pass

    def map_host(self, layer, group):
        self.slots = {s: k for s, k in self.slots.items() if k != (layer, group)}

    def start_copy(self, layer, group, slot):
        self.copies += 1
        return (layer, group, slot)

    def wait_copy(self, token):
        pass

    def map_slot(self, layer, group, slot):
        self.slots[slot] = (layer, group)

    def publish(self):
        pass


def _state(num_slots):
    st = grouped.GroupedState(device=0, granularity=2 * 2**20)
    perm = _perm()
    lay = plan_groups(FP8, E, 2)
    st.layers[0] = grouped.GroupedLayer(0, lay, perm, {}, {}, torch.tensor(perm.to_physical), "test")
    st.table = SlotTable(num_slots)
    return st, lay, perm


def test_apply_logical_makes_whole_groups_resident_and_counts_bytes_and_hbm():
    st, lay, perm = _state(num_slots=3)
    store = GroupStore(lay.group_payload_bytes)
    # physical order 6 1 4 2 7 0 3 5: groups {6,1} {4,2} {7,0} {3,5}
    out = grouped.apply_logical(st, {0: [6, 1, 4]}, store)
    assert st.table.resident()[0] == {0, 1}
    assert out["bytes_copied"] == 2 * lay.group_payload_bytes and store.copies == 2
    assert out["hbm_bytes"] == 2 * lay.group_bytes
    assert (out["wanted_experts"], out["resident_experts"]) == (3, 4)  # 2 rides along with 4
    out = grouped.apply_logical(st, {0: [2, 7]}, store)  # keeps group 1, evicts 0, admits 2
    assert st.table.resident()[0] == {1, 2}
    assert (out["admitted_groups"], out["evicted_groups"]) == (1, 1)
    assert out["bytes_copied"] == lay.group_payload_bytes
    status = grouped.status(st)["0"]
    assert status["layout"] == "grouped" and status["group_size"] == 2 and status["resident_groups"] == [1, 2]


def test_capacity_is_checked_in_groups_before_anything_moves():
    st, lay, _ = _state(num_slots=1)
    store = GroupStore(lay.group_payload_bytes)
    with pytest.raises(PoolCapacityError):
        grouped.apply_logical(st, {0: [6, 4]}, store)  # two groups, one slot
    assert store.copies == 0 and st.table.resident() == {}
    grouped.apply_logical(st, {0: [6, 1]}, store)  # one group holds both: fits
    assert st.table.resident()[0] == {0}
