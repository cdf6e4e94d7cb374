"""Publishing access in chunks while copies are in flight (swap.py, issue 17's swap guard), on the
real VMM store: the bytes land, vLLM's Triton MoE kernel reads them bitwise, the overlapped
publishes happened, and a failure after overlapped publishes still rolls back cleanly; the same
for publishing when idle (-1) and remapping ahead (-2, copies read the masters' second mapping).
Run on the H200: PYTHONPATH=/tmp/site python3 -m pytest -q tests/gpu/test_swap_publish_chunks.py
(~30 s: one Qwen3-30B-A3B-shaped layer, E=128)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.gpu.standalone import standalone_bf16_layer  # noqa: E402

E, H, I, TOPK = 128, 2048, 768, 8


@pytest.fixture(scope="module")
def layer():
    yield from standalone_bf16_layer(3, E, H, I)


def _moe(x_seed: int, w13, w2):
    fm = pytest.importorskip("vllm.model_executor.layers.fused_moe")
    gen = torch.Generator(device="cuda").manual_seed(x_seed)
    x = torch.randn(8, H, device="cuda", generator=gen).to(torch.bfloat16)
    tw, ti, _ = fm.fused_topk(x, torch.randn(8, E, device="cuda", generator=gen), TOPK, renormalize=True)
    return fm.fused_experts(x, w13, w2, tw, ti)


@pytest.mark.parametrize("every", [1, 4, 8, 32, -1, -2])  # -1: PUBLISH_WHEN_IDLE, -2: PUBLISH_AHEAD
def test_chunked_swap_lands_every_byte(layer, every):
    from reap_swap.engine.residency.swap import PUBLISH_AHEAD, apply_swap
    from reap_swap.engine.residency.vmm_store import VmmStore

    st, (w13, w2), (v13, v2) = layer
    apply_swap(st.table, VmmStore(st, 0), {0: list(range(0, E, 2))})  # half, then swap to the other half
    result = apply_swap(st.table, VmmStore(st, every), {0: list(range(1, E, 2))})
    if every > 0:
        assert result.phases["publish_chunks"] == (E // 2 - 1) // every
    elif every == PUBLISH_AHEAD:  # every remap and one publish while the copies ran
        assert result.phases["publish_chunks"] == 1
    assert not st.layers[0].rng.pending_access
    assert torch.equal(v13, w13) and torch.equal(v2, w2)
    assert torch.equal(_moe(every, v13, v2), _moe(every, w13, w2))


def test_masters_stay_readable_at_their_second_mapping_while_the_units_are_remapped(layer):
    from reap_swap.engine.residency.swap import PUBLISH_AHEAD, apply_swap
    from reap_swap.engine.residency.vmm_store import VmmStore

    st, (w13, w2), (v13, v2) = layer
    rng = st.layers[0].rng
    apply_swap(st.table, VmmStore(st, PUBLISH_AHEAD), {0: list(range(E // 2))})
    assert rng.mirrored == E and rng.backing[0] is not None  # unit 0 is in HBM, its master mirrored
    unit, masters = rng.as_bytes().view(E, -1), _mirror_bytes(rng).view(E, -1)
    assert torch.equal(masters, unit)  # every master, also those of the units now in HBM
    apply_swap(st.table, VmmStore(st, 0), {})
    assert torch.equal(v13, w13) and torch.equal(v2, w2)


def _mirror_bytes(rng):
    from reap_swap.engine.vmm import _ArrayInterface

    return torch.as_tensor(_ArrayInterface(rng.mirror_base, rng.nbytes), device="cuda")


@pytest.mark.parametrize("every", [4, -2])
def test_failure_after_overlapped_publishes_rolls_back(layer, every):
    from reap_swap.engine.residency.fault import SwapFault
    from reap_swap.engine.residency.swap import SwapStepFailed, apply_swap
    from reap_swap.engine.residency.vmm_store import VmmStore

    st, (w13, w2), (v13, v2) = layer
    apply_swap(st.table, VmmStore(st, 0), {0: list(range(32))})
    before = st.table.resident()
    store = SwapFault(rank=0, after_admissions=20).wrap(
        VmmStore(st, every)
    )  # 20 remapped (every=4: 5 chunks published), then fail
    with pytest.raises(SwapStepFailed) as failed:
        apply_swap(st.table, store, {0: list(range(40, 100))})
    assert failed.value.rolled_back and st.table.resident() == before
    assert not st.layers[0].rng.pending_access
    assert torch.equal(v13, w13) and torch.equal(v2, w2)
    assert torch.equal(_moe(99, v13, v2), _moe(99, w13, w2))
