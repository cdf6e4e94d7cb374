"""The fused Triton counter kernel equals the torch path, masks padding, and replays in CUDA graphs."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from reap_swap.engine.counting import count_kernel, counters  # noqa: E402

E, K = 128, 8
KERNEL = count_kernel.CountKernel()  # one per process, as the worker runtime holds it


def _module():
    m = torch.nn.Module()
    counters.register_counters(m, E, coactivation=False)
    return m.to("cuda")


def _batch(rows, seed):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(-1, E, (rows, K), generator=gen).to("cuda", torch.int32)
    w = torch.rand(rows, K, generator=gen).to("cuda")
    return ids, w


def test_self_test_passes():
    assert KERNEL.available(torch.device("cuda")), KERNEL.status()


@pytest.mark.parametrize("rows", [1, 7, 8, 200, 8192])
@pytest.mark.parametrize("mode", ["none", "is_padding", "slot_mapping"])
def test_equals_torch_path(rows, mode):
    ids, w = _batch(rows, rows)
    padding = None
    if mode == "is_padding":
        pad = torch.zeros(rows, dtype=torch.bool, device="cuda")
        pad[rows // 2 :] = True
        padding = ("is_padding", pad)
    elif mode == "slot_mapping":
        slots = torch.arange(rows, device="cuda")
        slots[rows // 3 :] = -1
        padding = ("slot_mapping", slots)
    fused, ref = _module(), _module()
    counters.record(fused, ids, w, padding=padding, kernel=KERNEL)
    counters.record_torch(ref, ids, w, valid_rows=counters.rows_from_padding(padding))
    assert torch.equal(getattr(fused, counters.COUNTS), getattr(ref, counters.COUNTS))
    torch.testing.assert_close(getattr(fused, counters.WEIGHTS), getattr(ref, counters.WEIGHTS))


def test_counts_replay_under_cuda_graph():
    m = _module()
    ids, w = _batch(8, 1)
    pad = torch.zeros(8, dtype=torch.bool, device="cuda")
    pad[6:] = True
    counters.record(m, ids, w, padding=("is_padding", pad), kernel=KERNEL)  # warm-up outside capture
    counters.zero(m)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        counters.record(m, ids, w, padding=("is_padding", pad), kernel=KERNEL)
    counters.zero(m)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    ref = _module()
    counters.record_torch(ref, ids, w, valid_rows=~pad)
    assert torch.equal(getattr(m, counters.COUNTS), 3 * getattr(ref, counters.COUNTS))
    assert int(getattr(m, counters.COUNTS).sum()) == 3 * int(((ids >= 0) & ~pad[:, None]).sum())


def test_slot_mapping_view_captured_then_rewritten_counts_each_replays_real_rows():
    """What a piecewise graph of an MLA-only model bakes in (research.md, mlapad): the view of the
    persistent slot-mapping buffer taken at capture (the padded length, all -1), then per replay
    the runner's slot kernel rewrites the buffer (n real slots, -1 to the end). The unpadded view a
    real step hands over, widened by compat.padding.over_buffer, is the same rows."""
    from reap_swap.compat import padding as vllm_padding

    buf = torch.full((64,), -1, dtype=torch.int64, device="cuda")  # BlockTable.slot_mapping.gpu
    m = _module()
    ids, w = _batch(8, 2)
    captured = ("slot_mapping", vllm_padding.over_buffer(buf[:8], 8))
    counters.record(m, ids, w, padding=captured, kernel=KERNEL)  # warm-up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        counters.record(m, ids, w, padding=captured, kernel=KERNEL)
    expected = 0
    counters.zero(m)
    for real in (3, 8, 5):
        buf.fill_(-1)
        buf[:real] = torch.arange(100, 100 + real, device="cuda")
        graph.replay()
        expected += int((ids[:real] >= 0).sum())
    torch.cuda.synchronize()
    assert int(getattr(m, counters.COUNTS).sum()) == expected
    widened = vllm_padding.over_buffer(buf[:5], 8)  # after the last step: 5 real rows
    assert (
        widened.data_ptr() == buf.data_ptr()
        and counters.rows_from_padding(("slot_mapping", widened)).sum() == 5
    )
