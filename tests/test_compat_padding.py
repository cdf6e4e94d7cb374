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


def _mamba_like():
    """An instance of vLLM's MambaBase (what a Gated DeltaNet / linear-attention layer is)."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    fake = type("FakeGatedDeltaNet", (MambaBase,), {})
    fake.__abstractmethods__ = frozenset()  # an instance without building a real layer
    return object.__new__(fake)


def test_hybrid_model_reads_the_attention_groups_slot_mapping(context):
    """The H200 Qwen3.5-35B-A3B case (issue 15): layer 0 is Gated DeltaNet, so the first slot
    mapping is a Mamba group's, which vLLM never computes (SlotMappingMode.NONE): -1 on the rows
    CUDA-graph capture filled (the 16 below the largest captured size), 0 above. Read as padding
    it hid 16 of 38 prompt tokens; the attention group's mapping is the real one."""
    rows, top_k, experts = 38, 8, 256
    stale_gdn = torch.cat([torch.full((16,), -1), torch.zeros(rows - 16, dtype=torch.long)])
    attention = torch.arange(544, 544 + rows)
    names = ["lm.model.layers.0.linear_attn", "lm.model.layers.3.self_attn.attn"]
    context["ctx"] = SimpleNamespace(
        is_padding=None,
        slot_mapping={names[0]: stale_gdn, names[1]: attention},
        no_compile_layers={names[0]: _mamba_like(), names[1]: object()},
    )
    source = moe.padding_source(rows)
    assert source[1] is attention
    module = torch.nn.Module()
    counters.register_counters(module, experts, coactivation=False)
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(rows)])
    counters.record(module, ids, torch.full((rows, top_k), 0.125), padding=source)
    assert sum(counters.read(module, reset=False)["counts"]) == rows * top_k  # 304, not 176


def test_hybrid_attention_padding_still_excluded(context):
    names = ["m.layers.0.linear_attn", "m.layers.1.linear_attn", "m.layers.3.self_attn.attn"]
    context["ctx"] = SimpleNamespace(
        is_padding=None,
        slot_mapping={
            names[0]: torch.full((8,), -1), names[1]: torch.full((8,), -1),
            names[2]: torch.tensor([5, 6, 7, 8, 9, -1, -1, -1]),
        },
        no_compile_layers={names[0]: _mamba_like(), names[1]: _mamba_like(), names[2]: object()},
    )  # fmt: skip
    assert counters.rows_from_padding(moe.padding_source(8)).tolist() == [True] * 5 + [False] * 3


def test_only_mamba_groups_means_unknown(context):
    names = ["only.layers.0.mixer", "only.layers.1.mixer"]
    context["ctx"] = SimpleNamespace(
        is_padding=None,
        slot_mapping={n: torch.full((4,), -1) for n in names},
        no_compile_layers={n: _mamba_like() for n in names},
    )
    assert moe.padding_source(4) is None
