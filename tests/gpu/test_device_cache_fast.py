"""The vectorised policy step (residency.device_cache_fast) on CUDA: equal to the eager torch step
(every state tensor and the remapped ids, every step) eager and replayed in a CUDA graph with new
routing, on every path the served shapes reach (register counting at decode, tl.histogram and the
table gather at 256 rows, the scratch placement at 512 experts), with padding rows and a swap
between steps. One-line run (H200, ~30 s):

    PYTHONPATH=$PWD python -m pytest -q tests/gpu/test_device_cache_fast.py 2>&1 | tee $LOGDIR/device_cache_fast.log
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")


def _trace(experts, rows, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(steps, rows, experts, generator=gen) + torch.linspace(3, 0, experts)
    ids = torch.topk(logits, 8, dim=-1).indices.to(torch.int32)
    valid = torch.rand(steps, rows, generator=gen) > 0.1
    return ids.cuda(), valid.cuda()


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_tensors(), b.state_tensors(), strict=True))


@pytest.mark.parametrize(
    "experts,slots,rows", [(128, 64, 1), (128, 32, 8), (256, 128, 8), (128, 32, 256), (512, 128, 4)]
)
def test_fast_step_equals_torch_eager_and_in_a_graph(experts, slots, rows):
    from reap_swap.engine.device_cache.fast import fast_policy
    from reap_swap.engine.device_cache.layer import DeviceCache, _policy

    steps = 120
    ids, valid = _trace(experts, rows, steps, seed=experts + rows)
    fast, ref = DeviceCache(experts, slots, "cuda"), DeviceCache(experts, slots, "cuda")
    for t in range(steps // 2):  # eager
        assert torch.equal(fast_policy(fast, ids[t], valid[t]), _policy(ref, ids[t], valid[t])), t
        assert _equal(fast, ref), t
    for c in (fast, ref):  # a swap between steps: 5 pinned, the tail yields a quarter
        c.set_pinned(range(5), slots - slots // 4)
    s_ids, s_valid = ids[0].clone(), valid[0].clone()
    saved = [t.clone() for t in fast.state_tensors()]
    fast_policy(fast, s_ids, s_valid)  # compile/allocate before the capture
    for t, v in zip(fast.state_tensors(), saved, strict=True):
        t.copy_(v)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fast_policy(fast, s_ids, s_valid)
    admitted = 0
    for t in range(steps // 2, steps):
        s_ids.copy_(ids[t])
        s_valid.copy_(valid[t])
        g.replay()
        want = _policy(ref, ids[t], valid[t])
        assert torch.equal(out, want) and _equal(fast, ref), t
        admitted = int(ref.counters[5])
    assert admitted > 0 and fast.read_counters() == ref.read_counters()
