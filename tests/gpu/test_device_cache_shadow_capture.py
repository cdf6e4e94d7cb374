"""--reap-cache-shadow under CUDA-graph capture (run 20: `bytes` failed vLLM's capture with
cudaErrorStreamCaptureUnsupported, because slots_hold_their_experts indexed the units with a 0-dim
tensor, which reads the id on the host). The slot check and the record are captured in one graph,
then replayed: correct slots pass, a slot corrupted behind the cache's back is counted, an empty
slot (-1) is skipped, and a mismatching output is recorded. Torch only (no vLLM, no model); one-line
run (H200, seconds):

    PYTHONPATH=$PWD python -m pytest -q tests/gpu/test_device_cache_shadow_capture.py
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("CUDA graphs need a GPU", allow_module_level=True)

from reap_swap.engine.device_cache.shadow import Shadow, slots_hold_their_experts  # noqa: E402

E, N, U = 8, 3, 4096  # experts, slots, bytes per unit


def test_slot_check_and_record_are_captured_and_replayed():
    units = torch.randint(0, 255, (E + N, U), dtype=torch.uint8, device="cuda")
    slot_expert = torch.tensor([5, -1, 2], dtype=torch.int64, device="cuda")
    units[E + 0].copy_(units[5])
    units[E + 2].copy_(units[2])
    shadow = Shadow("cuda", N, True)
    out = torch.zeros(4, 6, device="cuda")
    ref = torch.zeros(4, 6, device="cuda")
    ids = torch.zeros(4, 2, dtype=torch.int64, device="cuda")
    copies = torch.full((N,), -1, dtype=torch.int64, device="cuda")
    ok_seen = torch.zeros((), dtype=torch.bool, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside capture, as vLLM does
        slots_hold_their_experts(units, slot_expert, E)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ok = slots_hold_their_experts(units, slot_expert, E)
        ok_seen.copy_(ok)
        shadow.record(out, ref, ids, ids, copies, ok)
    g.replay()
    torch.cuda.synchronize()
    assert bool(ok_seen) and shadow.report()["bad_slot_steps"] == 0
    units[E + 2, 7] ^= 1  # corrupt slot 2 (expert 2)
    out[1, 3] = 1.0  # and make the cached output differ from the uncached one
    g.replay()
    torch.cuda.synchronize()
    rep = shadow.report()
    assert not bool(ok_seen)
    assert rep["steps"] == 2 and rep["bad_slot_steps"] == 1 and rep["mismatched_steps"] == 1
    assert rep["first_step"] == 1 and rep["max_abs_diff"] == 1.0
