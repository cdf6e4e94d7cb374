"""moe.padding_source + counters.rows_from_padding: which rows of a CUDA-graph-padded batch are real tokens."""

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
fc = pytest.importorskip("vllm.forward_context")

from reap_swap.compat import moe  # noqa: E402
from reap_swap.counting import counters  # noqa: E402


@pytest.fixture
def context(monkeypatch):
    holder = {}
    monkeypatch.setattr(fc, "is_forward_context_available", lambda: "ctx" in holder)
    monkeypatch.setattr(fc, "get_forward_context", lambda: holder["ctx"])
    return holder


def test_no_context_means_unknown(context):
    assert counters.rows_from_padding(moe.padding_source(4)) is None


def test_model_runner_v2_padding_mask(context):
    context["ctx"] = SimpleNamespace(is_padding=torch.tensor([False, False, True, True]), slot_mapping={})
    assert counters.rows_from_padding(moe.padding_source(4)).tolist() == [True, True, False, False]


def test_v1_slot_mapping_pad_slots(context):
    context["ctx"] = SimpleNamespace(
        is_padding=None, slot_mapping={"model.layers.0.self_attn.attn": torch.tensor([7, 8, 9, -1])}
    )
    assert counters.rows_from_padding(moe.padding_source(4)).tolist() == [True, True, True, False]


def test_shape_mismatch_is_unknown(context):
    context["ctx"] = SimpleNamespace(
        is_padding=torch.zeros(8, dtype=torch.bool), slot_mapping={"a": torch.zeros(8, dtype=torch.long)}
    )
    assert counters.rows_from_padding(moe.padding_source(4)) is None


def test_padded_rows_are_not_counted():
    module = torch.nn.Module()
    counters.register_counters(module, 4, coactivation=True)
    ids = torch.tensor([[0, 1], [1, 2], [3, 0]])
    weights = torch.full((3, 2), 0.5)
    counters.record(module, ids, weights, valid_rows=torch.tensor([True, True, False]))
    got = counters.read(module, reset=False)
    assert got["counts"] == [1, 2, 1, 0]
    assert got["coact"][3] == [0, 0, 0, 0]
