"""moe.padding_source + counters.rows_from_padding: which rows of a CUDA-graph-padded batch are real tokens."""

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
fc = pytest.importorskip("vllm.forward_context")

from reap_swap.compat import moe  # noqa: E402
from reap_swap.engine.counting import counters  # noqa: E402


@pytest.fixture
def context(monkeypatch):
    holder = {}
    monkeypatch.setattr(fc, "is_forward_context_available", lambda: "ctx" in holder)
    monkeypatch.setattr(fc, "get_forward_context", lambda: holder["ctx"])
    return holder


def test_no_context_means_unknown(context):
    assert counters.rows_from_padding(moe.padding_source(4)) is None


def test_model_runner_v2_padding_mask(context, monkeypatch):
    monkeypatch.setenv("VLLM_MOE_SKIP_PADDING", "1")  # the V2 runner fills is_padding per step
    context["ctx"] = SimpleNamespace(is_padding=torch.tensor([False, False, True, True]), slot_mapping={})
    assert counters.rows_from_padding(moe.padding_source(4)).tolist() == [True, True, False, False]


def test_model_runner_v2_stale_is_padding_is_not_read(context, monkeypatch):
    """Run 13 (H200, vLLM 0.26.0, DeepSeek-V2-Lite on Model Runner V2): without
    VLLM_MOE_SKIP_PADDING the runner never rewrites is_padding after its dummy batches, so it is
    all True; read as the mask it hid every selection (0 of 6084 counted). The V2 runner's slot
    mapping (padded length, -1 past the step's tokens) is what marks the padded rows then."""
    monkeypatch.setenv("VLLM_MOE_SKIP_PADDING", "0")
    context["ctx"] = SimpleNamespace(
        is_padding=torch.ones(4, dtype=torch.bool),  # left by the profile run / capture
        slot_mapping={"model.layers.0.self_attn.attn": torch.tensor([7, 8, -1, -1])},
    )
    assert counters.rows_from_padding(moe.padding_source(4)).tolist() == [True, True, False, False]
    context["ctx"] = SimpleNamespace(is_padding=torch.ones(4, dtype=torch.bool), slot_mapping={})
    assert moe.padding_source(4) is None  # nothing else says which rows are padding: count all


def test_runner_fills_is_padding_follows_vllms_flag(monkeypatch):
    from reap_swap.compat import padding

    monkeypatch.setenv("VLLM_MOE_SKIP_PADDING", "0")
    assert padding.runner_fills_is_padding() is False
    monkeypatch.setenv("VLLM_MOE_SKIP_PADDING", "1")
    assert padding.runner_fills_is_padding() is True


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


def _slot_buffer(max_tokens: int, real: int, start: int = 100):
    """A BlockTable.slot_mapping.gpu stand-in after one step of `real` tokens: what vLLM 0.26.0's
    _compute_slot_mapping_kernel leaves there (real slots, then -1 up to max_num_batched_tokens)."""
    buf = torch.full((max_tokens,), -1, dtype=torch.int64)
    buf[:real] = torch.arange(start, start + real)
    return buf


def test_mla_only_unpadded_mapping_is_read_over_its_buffer(context):
    """DeepSeek-style (all attention MLA: forward_includes_kv_cache_update, no separate KV update)
    on a step padded from 5 to 8 rows outside a graph replay: the ForwardContext holds the
    unpadded prefix view [:5]; rows 5..7 are padding, read as -1 from the persistent buffer."""
    buf = _slot_buffer(64, real=5)
    name = "model.layers.1.self_attn.mla_attn"
    context["ctx"] = SimpleNamespace(
        is_padding=None, slot_mapping={name: buf[:5]}, no_compile_layers={name: object()}
    )
    source = moe.padding_source(8)
    assert source[0] == "slot_mapping" and source[1].data_ptr() == buf.data_ptr()
    assert counters.rows_from_padding(source).tolist() == [True] * 5 + [False] * 3
    module = torch.nn.Module()
    counters.register_counters(module, 16, coactivation=True)
    ids = torch.stack([torch.randperm(16)[:2] for _ in range(8)])
    counters.record(module, ids, torch.full((8, 2), 0.5), padding=source)
    assert sum(counters.read(module, reset=False)["counts"]) == 5 * 2  # not 8 * 2


def test_captured_view_follows_the_buffer_at_replay(context):
    """What a piecewise graph bakes in: padding_source ran at capture (_dummy_run: the padded
    length, all -1) and the counter reads that view at every replay; a later step of 3 real
    tokens in the 8-row graph rewrites the buffer (real slots, -1 tail), and the same view says so."""
    buf = torch.full((64,), -1, dtype=torch.int64)
    name = "model.layers.0.self_attn.attn"
    context["ctx"] = SimpleNamespace(
        is_padding=None, slot_mapping={name: buf[:8]}, no_compile_layers={name: object()}
    )
    captured = moe.padding_source(8)
    assert not counters.rows_from_padding(captured).any()
    buf.copy_(_slot_buffer(64, real=3))  # the replayed step's _compute_slot_mapping_kernel
    assert counters.rows_from_padding(captured).tolist() == [True] * 3 + [False] * 5
    context["ctx"] = SimpleNamespace(
        is_padding=None, slot_mapping={name: buf[:3]}, no_compile_layers={name: object()}
    )
    lazily = moe.padding_source(8)  # a graph first captured in this real step: the same view
    assert lazily[1].data_ptr() == captured[1].data_ptr() and lazily[1].shape == captured[1].shape


def test_a_shorter_mapping_without_a_buffer_behind_it_is_unknown(context):
    name = "enc.layers.0.attn"
    context["ctx"] = SimpleNamespace(
        is_padding=None,
        slot_mapping={name: torch.zeros(5, dtype=torch.int64)},
        no_compile_layers={name: object()},
    )
    assert moe.padding_source(8) is None


def test_over_buffer_keeps_the_view_offset_and_refuses_strided_views():
    from reap_swap.compat import padding

    buf = _slot_buffer(32, real=10)
    view = padding.over_buffer(buf[4:6], 5)
    assert view.tolist() == [104, 105, 106, 107, 108] and view.data_ptr() == buf[4:].data_ptr()
    assert padding.over_buffer(buf[::2][:3], 5) is None
    assert padding.over_buffer(buf[:6], 4) is None
    assert padding.over_buffer(buf[30:], 4) is None  # the storage ends at 32
