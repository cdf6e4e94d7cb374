"""The device cache's debug shadow (engine/device_cache/shadow.py, --reap-cache-shadow) on a fake
layer with a toy kernel (CPU tensors): silent while cached == uncached, and when a slot is
corrupted behind the cache's back it records the first mismatching step, its ids, the remapped
ids and the slots whose bytes are wrong -- what the lead reads from /reap/status on the H200."""

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from reap_swap.engine.device_cache import shadow as shadow_mod  # noqa: E402
from reap_swap.engine.device_cache.api import DeviceCaches  # noqa: E402

E, N, H = 8, 3, 4


def _layer(w_units, w_experts):
    qm = type("UnquantizedFusedMoEMethod", (), {})()
    qm.unquantized_backend = SimpleNamespace(name="TRITON")
    qm.is_monolithic = False
    experts = type("TritonExperts", (), {"_lora_context": None})()
    prepare = type("MoEPrepareAndFinalizeNoDPEPModular", (), {})()

    def apply(hidden_states, w1, w2, topk_weights, topk_ids, global_num_experts, expert_map=None, **_):
        assert w1.shape[0] == global_num_experts
        return torch.einsum("rkij,rj->ri", w1[topk_ids.long()], hidden_states)

    qm.moe_kernel = SimpleNamespace(fused_experts=experts, prepare_finalize=prepare, apply=apply)
    m = torch.nn.Module()
    m.quant_method, m.global_num_experts, m.expert_map = qm, E, None
    m.w13_weight = torch.nn.Parameter(w_experts, requires_grad=False)  # the layer's [E, ...] view
    m.w2_weight = torch.nn.Parameter(w_experts, requires_grad=False)
    m.activation, m.apply_router_weight_on_input = "silu", False
    return m


@pytest.mark.parametrize("mode", ["out", "bytes"])
def test_shadow_is_silent_when_equal_and_pinpoints_a_corrupted_slot(mode):
    raw = torch.zeros((E + N) * H * H * 4, dtype=torch.uint8)
    w = raw.view(torch.float32).view(E + N, H, H)
    w[:E] = torch.randn(E, H, H, generator=torch.Generator().manual_seed(0))
    layer = _layer(w, w[:E])
    caches = DeviceCaches(shadow=mode)
    rng = SimpleNamespace(num_experts=E, num_slots=N, unit_bytes=H * H * 4)
    assert caches.engage(layer, 0, rng, raw, (w, w))
    x = torch.randn(2, H)
    for _ in range(3):
        caches.forward(layer, 0, x, None, torch.tensor([[0, 1], [2, 0]]), None, None, None)
    rep = caches.status()["shadow"][0]
    assert rep["steps"] == 3 and rep["mismatched_steps"] == 0 and rep["first_step"] == -1, rep
    slot = caches.layers[0].cache.expert_slot[1].item()
    assert slot >= 0
    w[E + slot] += 1.0  # the slot no longer holds expert 1's bytes
    caches.forward(layer, 0, x, None, torch.tensor([[1, 0], [2, 1]]), None, None, None)
    caches.forward(layer, 0, x, None, torch.tensor([[1, 0], [2, 1]]), None, None, None)
    rep = caches.status()["shadow"][0]
    assert rep["mismatched_steps"] == 2 and rep["first_step"] == 3 and rep["first_rows"] == 2, rep
    assert rep["first_ids"] == [1, 0, 2, 1] and E + slot in rep["first_remapped"], rep
    assert rep["max_abs_diff"] > 0
    assert rep["bad_slot_steps"] == (2 if mode == "bytes" else 0), rep


def test_shadow_mode_from_the_settings():
    from reap_swap.config.settings import Settings

    assert shadow_mod.shadow_mode(Settings()) is None
    for raw, want in (("off", None), ("out", "out"), ("bytes", "bytes")):
        st = Settings(plan_file="p.json", cache_shadow=raw)
        assert shadow_mod.shadow_mode(st) == want
    assert "shadow" not in DeviceCaches().status()


def test_shadow_ignores_nan_in_both_outputs_but_counts_one_sided_nan():
    """Run 11 (H200): padding rows with garbage inputs gave NaN in the cached and the uncached output
    alike; NaN != NaN made them 'mismatched steps' with a NaN max. Both-NaN is not a difference."""
    sh = shadow_mod.Shadow(torch.device("cpu"), N, check_bytes=False)
    ids = torch.tensor([[0, 1], [2, 0]])
    copies = torch.full((N,), -1, dtype=torch.int64)
    out = torch.tensor([[1.0, float("nan")], [2.0, 3.0]])
    sh.record(out, out.clone(), ids, ids, copies)
    rep = sh.report()
    assert rep["mismatched_steps"] == 0 and rep["nan_steps"] == 1 and rep["max_abs_diff"] == 0.0, rep
    ref = torch.tensor([[1.0, 5.0], [2.0, 3.5]])
    sh.record(out, ref, ids, ids, copies)
    rep = sh.report()
    assert rep["mismatched_steps"] == 1 and rep["first_step"] == 1, rep
    assert rep["max_abs_diff"] == float("inf"), rep


def test_slot_check_reads_no_id_on_the_host():
    """slots_hold_their_experts: an empty slot (-1) is skipped, a wrong byte is caught, and the id is
    gathered as a tensor (run 20: indexing with a 0-dim tensor synced, failing graph capture)."""
    units = torch.arange(11 * 16, dtype=torch.int64).reshape(11, 16) % 251
    slot_expert = torch.tensor([5, -1, 2])
    units[8].copy_(units[5])
    units[10].copy_(units[2])
    assert bool(shadow_mod.slots_hold_their_experts(units, slot_expert, 8))
    units[10, 3] += 1
    assert not bool(shadow_mod.slots_hold_their_experts(units, slot_expert, 8))
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostReads(TorchDispatchMode):  # what .item() and a 0-dim tensor index dispatch to
        seen = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            HostReads.seen += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    with HostReads():
        shadow_mod.slots_hold_their_experts(units, slot_expert, 8)
    assert HostReads.seen == 0
