"""seedfix (run 12): the seeded device cache at the size it was served with (E = 128, top-8, 64
slots seeded with the core 0..31), replayed on the skewed model's H200 trace with a fake range on
CPU: after every step's copy, every id the kernel reads (a slot or the expert's own host unit)
must hold that expert's bytes -- so an evicted seeded expert read through, or admitted again, reads
its own bytes. Torch step on 3 layers x 1024 steps; the fast Triton step (what serving runs)
interpreted in a child on 1 layer x 300 steps. (The full 12 layers x 1024 steps passed on both,
once, while bisecting: research.md "seedfix".)"""

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.triton_child import INTERPRETED, run_child_pytest  # noqa: E402

TRACE = Path(__file__).resolve().parents[1] / "research-notes/cache-sim/skew12h200/skew-heldout.npz"
E, N, B = 128, 64, 4  # experts, cache slots (core 32 + tail 32), unit elements (fake)


def replay(fused: bool, layers, steps: int, pinned=False):
    """(wrong reads, evictions of seeded experts, their later reads) over the trace."""
    from reap_swap.engine.device_cache.layer import DeviceCache, LayerStep

    d = np.load(TRACE)
    ids_all, offs = d["topk_ids"], d["step_offsets"]
    bad, evicted_core, reread = 0, 0, 0
    for layer in layers:
        masters = torch.arange(E * B, dtype=torch.int64).reshape(E, B) + 10_000 * layer
        n = N // 2 if pinned else N
        units = torch.zeros(E + n, B, dtype=torch.int64)
        units[:E] = masters
        step = LayerStep(DeviceCache(E, n, "cpu", 0.8), units, step="triton" if fused else "torch")
        if pinned:  # the control (core+dlfu): the core pinned in its own units
            step.cache.set_pinned(range(32))
        else:
            step.seed(range(32))
        out_of_slots: set[int] = set()
        for t in range(min(steps, len(offs) - 1)):
            ids = torch.from_numpy(ids_all[offs[t] : offs[t + 1], layer].astype(np.int32))
            before = set(step.cache.slot_expert.tolist())
            read = step(ids)
            bad += int((units[read.long()] != masters[ids.long()]).any(dim=-1).sum())
            held = set(step.cache.slot_expert.tolist())
            gone = {e for e in before - held if 0 <= e < 32}
            evicted_core += len(gone)
            out_of_slots |= gone
            reread += len(out_of_slots & set(ids.flatten().tolist()))
    return bad, evicted_core, reread


def test_seeded_served_size_every_read_holds_its_expert_torch_step():
    bad, evicted, reread = replay(False, range(3), 1024)
    assert bad == 0 and evicted > 10 and reread > 10, (bad, evicted, reread)


def test_pinned_control_every_read_holds_its_expert():
    assert replay(False, range(1), 1024, pinned=True)[0] == 0


if not INTERPRETED:

    def test_seeded_served_size_fast_step_under_the_triton_interpreter():
        pytest.importorskip("triton")
        run_child_pytest(__file__)

else:

    def test_seeded_served_size_every_read_holds_its_expert_fast_step():
        bad, evicted, reread = replay(True, range(1), 300)
        assert bad == 0 and evicted > 0 and reread > 0, (bad, evicted, reread)
