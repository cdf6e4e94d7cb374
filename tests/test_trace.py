"""trace: build, save, load round trip; every malformed field is refused with its name."""

import numpy as np
import orjson
import pytest

from reap_swap.cache.trace import (
    TRACE_VERSION,
    Trace,
    TraceError,
    from_requests,
    load_trace,
    save_trace,
    steps_of_sequence,
)


def small_trace(**overrides) -> Trace:
    """Two requests on 2 layers x 4 experts, top-2: prefill of 3 tokens + 2 decode steps, then 2 + 1."""
    r0 = [
        np.array([[[0, 1], [2, 3]], [[1, 2], [0, 3]], [[0, 3], [1, 2]]]),
        np.array([[[0, 1], [2, 3]]]),
        np.array([[[2, 3], [0, 1]]]),
    ]
    r1 = [np.array([[[3, 2], [1, 0]], [[0, 2], [1, 3]]]), np.array([[[1, 0], [3, 2]]])]
    kw = dict(layers=[5, 7], model="m", num_experts=4, top_k=2, per_expert_bytes=100, request_tags=["a", "b"])
    kw.update(overrides)
    return from_requests([r0, r1], **kw)


def test_build_shapes_and_counts():
    t = small_trace()
    assert (t.num_requests, t.num_steps, t.num_tokens) == (2, 5, 8)
    assert t.topk_ids.dtype == np.uint8
    assert list(t.step_offsets) == [0, 3, 4, 5, 7, 8]
    assert list(t.request_offsets) == [0, 3, 5]
    assert list(t.request_first_steps()) == [0, 3]
    c = t.step_counts(5)
    assert c.shape == (5, 4)
    assert list(c[0]) == [2, 2, 1, 1]  # prefill: tokens [0,1] [1,2] [0,3] on layer 5
    assert list(c[1]) == [1, 1, 0, 0]
    assert c.sum() == t.num_tokens * t.top_k
    assert list(t.step_counts(7)[4]) == [0, 0, 1, 1]


def test_round_trip(tmp_path):
    t = small_trace(source={"recorder": "test"})
    path = tmp_path / "t.npz"
    save_trace(path, t)
    u = load_trace(path)
    assert np.array_equal(u.topk_ids, t.topk_ids) and u.topk_ids.dtype == np.uint8
    assert np.array_equal(u.step_offsets, t.step_offsets)
    assert np.array_equal(u.request_offsets, t.request_offsets)
    assert (u.layers, u.model, u.num_experts, u.top_k, u.per_expert_bytes) == ((5, 7), "m", 4, 2, 100)
    assert u.request_tags == ("a", "b") and u.source == {"recorder": "test"}


def test_wide_ids_use_uint16():
    reqs = [[np.array([[[300, 1]]])]]
    t = from_requests(reqs, layers=[0], model="m", num_experts=512, top_k=2, per_expert_bytes=1)
    assert t.topk_ids.dtype == np.uint16


def _rewrite(tmp_path, t: Trace, **arrays):
    meta = arrays.pop("meta", None) or t.meta()
    base = {
        "topk_ids": t.topk_ids,
        "step_offsets": t.step_offsets,
        "request_offsets": t.request_offsets,
        "layers": np.asarray(t.layers),
        "meta": np.frombuffer(orjson.dumps(meta), dtype=np.uint8),
    }
    base.update(arrays)
    base = {k: v for k, v in base.items() if v is not None}
    path = tmp_path / "bad.npz"
    np.savez(path, **base)
    return path


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda t: {"topk_ids": np.where(t.topk_ids == 3, 9, t.topk_ids).astype(np.uint8)}, "num_experts"),
        (lambda t: {"topk_ids": t.topk_ids.astype(np.int32)}, "dtype"),
        (lambda t: {"topk_ids": t.topk_ids[:, :1, :]}, "topk_ids: shape"),
        (lambda t: {"step_offsets": t.step_offsets[:-1]}, "step_offsets"),
        (lambda t: {"step_offsets": np.array([0, 3, 3, 5, 7, 8])}, "step_offsets: entry 1 is empty"),
        (lambda t: {"request_offsets": np.array([0, 2, 4])}, "request_offsets"),
        (lambda t: {"layers": np.array([5, 5])}, "layers"),
        (lambda t: {"meta": {**t.meta(), "version": TRACE_VERSION + 1}}, "meta.version"),
        (lambda t: {"meta": {k: v for k, v in t.meta().items() if k != "top_k"}}, "meta.top_k: missing"),
        (lambda t: {"meta": {**t.meta(), "request_tags": ["a"]}}, "meta.request_tags"),
        (lambda t: {"request_offsets": None}, "missing arrays ['request_offsets']"),
    ],
)
def test_load_refuses_bad_fields(tmp_path, change, field):
    t = small_trace()
    path = _rewrite(tmp_path, t, **change(t))
    with pytest.raises(TraceError, match=field.replace("[", r"\[").replace("]", r"\]")) as info:
        load_trace(path)
    assert str(path) in str(info.value)


def test_duplicate_expert_in_one_token_is_refused():
    with pytest.raises(TraceError, match="routes one expert twice"):
        from_requests(
            [[np.array([[[1, 1]]])]], layers=[0], model="m", num_experts=4, top_k=2, per_expert_bytes=1
        )


def test_not_an_npz(tmp_path):
    path = tmp_path / "x.npz"
    path.write_text("hello")
    with pytest.raises(TraceError, match="not a readable .npz trace"):
        load_trace(path)


def test_empty_and_out_of_range_requests():
    with pytest.raises(TraceError, match="at least one request"):
        from_requests([], layers=[0], model="m", num_experts=4, top_k=1, per_expert_bytes=1)
    with pytest.raises(TraceError, match="outside"):
        from_requests(
            [[np.array([[[4]]])]], layers=[0], model="m", num_experts=4, top_k=1, per_expert_bytes=1
        )


def test_steps_of_sequence():
    routed = np.arange(5 * 2 * 1).reshape(5, 2, 1) % 4
    steps = steps_of_sequence(routed, 3)
    assert [len(s) for s in steps] == [3, 1, 1]
    t = from_requests([steps], layers=[0, 1], model="m", num_experts=4, top_k=1, per_expert_bytes=1)
    assert np.array_equal(t.topk_ids, routed.astype(np.uint8)) and list(t.step_offsets) == [0, 3, 4, 5]
    with pytest.raises(TraceError, match="prompt_tokens"):
        steps_of_sequence(routed, 6)
    with pytest.raises(TraceError, match="routed: shape"):
        steps_of_sequence(routed[:, 0], 2)
