"""Worker extension: mixes into vLLM's CPU worker without clashes, registers the counting layer,
picks the accounting backend on CPU, re-checks keep-sets."""

import pytest
from reap_fakes import PLAN

from reap_swap.compat import moe as vllm_moe
from reap_swap.residency.accounting import AccountingResidency
from reap_swap.settings import CPU_REASON, Settings
from reap_swap.worker import ReapWorkerExtension, _parse_keep, make_residency_backend


def test_extension_adds_only_new_names_to_vllm_workers():
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    names = [n for n in dir(ReapWorkerExtension) if not n.startswith("__")]
    assert {"reap_status", "reap_apply_residency", "reap_read_stats", "reap_reset_stats"} <= set(names)
    for cls in (Worker, CPUWorker):
        assert not [n for n in names if hasattr(cls, n)]  # vLLM asserts exactly this


def test_importing_the_worker_module_registers_the_counting_layer():
    from reap_swap.residency.experts import ReapRoutedExperts, layer_index_from_name

    assert vllm_moe.oot_registry()["RoutedExperts"] is ReapRoutedExperts
    assert issubclass(ReapRoutedExperts, vllm_moe.routed_experts_class())
    assert layer_index_from_name("model.layers.3.mlp.experts.routed_experts") == 3
    assert layer_index_from_name("language_model.model.layers.17.mlp.experts") == 17
    assert layer_index_from_name("lm_head") is None


def test_register_refuses_a_foreign_replacement(monkeypatch):
    from reap_swap.residency import experts

    registry = vllm_moe.oot_registry()
    monkeypatch.setitem(registry, "RoutedExperts", type("Other", (), {}))
    with pytest.raises(RuntimeError, match="already registered"):
        experts.register()


def test_cpu_gets_the_accounting_backend_with_the_reason():
    backend = make_residency_backend(None, PLAN, Settings(plan_file="p"))
    assert isinstance(backend, AccountingResidency) and backend.reason == CPU_REASON
    assert backend.resident() == PLAN.core_sets()
    out = backend.apply({**PLAN.core_sets(), 0: PLAN.core_sets()[0] | {4}})
    assert out["bytes_copied"] == 0 and "no expert weights were copied" in out["note"]
    masks = make_residency_backend(None, PLAN, Settings(plan_file="p", masks_only=True))
    assert "REAP_SWAP_MASKS_ONLY" in masks.reason
    with pytest.raises(RuntimeError, match="platform"):
        make_residency_backend(None, PLAN, Settings(plan_file="p", residency="cuda"))


def test_dry_run_changes_nothing():
    backend = AccountingResidency(PLAN.core_sets(), PLAN.per_expert_bytes, "x")
    backend.apply({**PLAN.core_sets(), 1: PLAN.core_sets()[1] | {9}}, dry_run=True)
    assert backend.resident() == PLAN.core_sets()


@pytest.mark.parametrize(
    "keep,needle",
    [
        ({"0": [0], "1": [5], "2": [10], "3": [0], "4": [0]}, "layer 4"),
        ({"0": [0], "1": [5], "2": [10], "3": [14]}, "experts \\[14\\]"),
        ({"0": [0], "1": [5]}, "lacks plan layers \\[2, 3\\]"),
    ],
)
def test_parse_keep_rechecks_against_the_plan(keep, needle):
    with pytest.raises(ValueError, match=needle):
        _parse_keep(PLAN, keep)
