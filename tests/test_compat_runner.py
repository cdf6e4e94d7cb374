"""compat.runner: what differs for reap-swap between vLLM's model runners V1 and V2 (research.md
"Model Runner V2 audit"). Model Runner V2 needs Triton, which the CPU build lacks, so its behaviour is
faked here from vLLM 0.26.0's source (cited in compat/runner.py); the GPU check is
scripts/gpu_mrv2_check.sh."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from reap_swap.compat import moe as vllm_moe
from reap_swap.compat import runner
from reap_swap.config.settings import Settings
from reap_swap.server import host_checks
from reap_swap.server import launcher as server
from reap_swap.sizing.model_shape import read_model_shape

DATA = Path(__file__).resolve().parent / "data"


def _out(new=(), cached=(), resumed=(), finished=()):
    """A SchedulerOutput's fields StepStarts reads (v1/core/sched/output.py, 0.26.0)."""
    return NS(
        scheduled_new_reqs=[NS(req_id=r) for r in new],
        scheduled_cached_reqs=NS(req_ids=list(cached), resumed_req_ids=set(resumed)),
        finished_req_ids=set(finished),
    )


# The same serving history as each runner's scheduler sends it: request a prefills, decodes, is
# preempted, resumes; b arrives; a finishes; a new request reuses the id "a".
V1_STEPS = [
    _out(new=["a"]),
    _out(cached=["a"]),
    _out(),  # a preempted: nothing scheduled
    _out(cached=["a"], resumed=["a"]),  # V1: a resumed request is a cached one (resumed_req_ids)
    _out(new=["b"], cached=["a"]),
    _out(cached=["b"], finished=["a"]),
    _out(new=["a"], cached=["b"]),
]
V2_STEPS = [
    _out(new=["a"]),
    _out(cached=["a"]),
    _out(),
    _out(new=["a"]),  # V2: scheduler.py:1088-1090 folds resumed requests into scheduled_new_reqs
    _out(new=["b"], cached=["a"]),
    _out(cached=["b"], finished=["a"]),
    _out(new=["a"], cached=["b"]),
]
STARTS = [True, False, False, False, True, False, True]


@pytest.mark.parametrize("steps", [V1_STEPS, V2_STEPS], ids=["v1", "v2"])
def test_step_starts_are_the_same_on_both_runners(steps):
    starts = runner.StepStarts()
    assert [starts(s) for s in steps] == STARTS


def test_a_finished_id_scheduled_again_in_the_same_output_starts():
    starts = runner.StepStarts()
    assert starts(_out(new=["a"]))
    assert starts(_out(new=["a"], finished=["a"]))  # the old a finished, a new a starts


def test_wrap_execute_model_feeds_request_starts_on_v2():
    seen = []

    class Worker:
        def execute_model(self, scheduler_output):
            seen.append("forward")
            return None  # V2: the output comes from sample_tokens

    w = Worker()
    assert (
        vllm_moe.wrap_execute_model(w, lambda: seen.append("before"), seen.append) == "worker.execute_model"
    )
    for s in V2_STEPS[:4]:
        assert w.execute_model(s) is None
    assert seen == ["before", "forward", True] + ["before", "forward", False] * 3


def _offload_config(gib=10.0, backend="uva", group=0):
    return NS(offload_backend=backend, uva=NS(cpu_offload_gb=gib), prefetch=NS(offload_group_size=group))


def test_uva_requested():
    assert runner.uva_requested(_offload_config())
    assert runner.uva_requested(_offload_config(backend="auto"))
    assert not runner.uva_requested(_offload_config(backend="auto", group=2))  # auto -> prefetch
    assert not runner.uva_requested(_offload_config(gib=0))
    assert not runner.uva_requested(_offload_config(backend="prefetch"))
    assert not runner.uva_requested(None)


def _worker(v2: bool, offload=None):
    return NS(
        use_v2_model_runner=v2,
        model_runner=NS(),
        vllm_config=NS(offload_config=offload, use_v2_model_runner=v2),
    )


def test_offload_not_applied_names_model_runner_v2(monkeypatch):
    from vllm.model_executor.offloader import base

    monkeypatch.setattr(base, "get_offloader", lambda: base.NoopOffloader())
    why = runner.offload_not_applied(_worker(True, _offload_config()))
    assert why.startswith("Model Runner V2 created no weight offloader") and "--cpu-offload-gb" in why
    assert runner.offload_not_applied(_worker(True, None)) is None  # nothing was asked
    monkeypatch.setattr(base, "get_offloader", lambda: object())  # an offloader exists (V1, or 0.32 V2)
    assert runner.offload_not_applied(_worker(True, _offload_config())) is None


def test_runner_status(monkeypatch):
    from vllm.model_executor.offloader import base

    monkeypatch.setattr(base, "get_offloader", lambda: base.NoopOffloader())
    st = runner.runner_status(_worker(True, _offload_config()))
    assert st["model_runner"] == "v2" and len(st["notes"]) == 1
    assert st["padding_mask"] in ("is_padding", "slot_mapping")
    st = runner.runner_status(_worker(False))
    assert st == {"model_runner": "v1", "class": st["class"], "padding_mask": "slot_mapping", "notes": []}
    assert runner.uses_v2(NS(vllm_config=NS(use_v2_model_runner=True)))  # no worker attribute


@pytest.fixture
def vllm026(monkeypatch):
    """This process's vLLM made to answer as 0.26.0 with Triton, DEFAULT_V2 as in its config/vllm.py:68."""
    import vllm.envs as envs
    import vllm.triton_utils as tu
    from vllm.config import vllm as cfg

    from reap_swap.compat import serve

    monkeypatch.setattr(serve, "vllm_version", lambda: (0, 26, 0))
    monkeypatch.setattr(tu, "HAS_TRITON", True)
    monkeypatch.setattr(cfg, "DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES",
                        frozenset({"DeepseekV2ForCausalLM", "GraniteMoeForCausalLM", "Qwen2MoeForCausalLM"}),
                        raising=False)  # fmt: skip
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    assert envs.VLLM_USE_V2_MODEL_RUNNER is None  # read from the environment at each access
    return monkeypatch


def test_offload_ignored_reason_predicts_v2_on_0_26(vllm026):
    why = runner.offload_ignored_reason(["DeepseekV2ForCausalLM"])
    assert why.startswith("vLLM 0.26.0 runs DeepseekV2ForCausalLM on Model Runner V2 by default")
    assert runner.offload_ignored_reason(["MixtralForCausalLM"]) is None  # V1: the offloader works
    assert runner.offload_ignored_reason(["Qwen2MoeForCausalLM"], enable_return_routed_experts=True) is None
    vllm026.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert runner.offload_ignored_reason(["MixtralForCausalLM"]).startswith("VLLM_USE_V2_MODEL_RUNNER=1")
    vllm026.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert runner.offload_ignored_reason(["DeepseekV2ForCausalLM"]) is None


def test_offload_ignored_reason_is_none_where_v2_creates_the_offloader(monkeypatch):
    from reap_swap.compat import serve

    monkeypatch.setattr(serve, "vllm_version", lambda: (0, 32, 0))
    assert runner.offload_ignored_reason(["DeepseekV2ForCausalLM"]) is None


def _launch(monkeypatch, device_total: int, pool_bytes: int = 0):
    calls = []
    vs = server.vllm_serve
    monkeypatch.setattr(vs, "platform_name", lambda: "cuda")
    monkeypatch.setattr(vs, "moe_backend_is_default", lambda a: True)
    monkeypatch.setattr(vs, "use_triton_moe_backend", lambda a: calls.append("triton"))
    monkeypatch.setattr(vs, "cpu_offload_chosen", lambda a: False)
    monkeypatch.setattr(vs, "offload_experts_to_uva", lambda a, gib, names: calls.append("uva"))
    monkeypatch.setattr(host_checks, "check_host_memory", lambda s, **kw: calls.append("host"))
    monkeypatch.setattr(vs, "device_total_bytes", lambda: device_total)

    shape = read_model_shape(json.loads((DATA / "deepseek_v2_lite_config.json").read_text()))
    args = argparse.Namespace(quantization=None, gpu_memory_utilization=0.1)  # the families lane's
    server.gpu_engine_args(Settings(exact_pinning=False), args, shape, pool_bytes)
    return calls, shape


def test_the_launcher_adds_no_ignored_offload_on_v2_and_checks_hbm(vllm026):
    gib = 2**30
    calls, shape = _launch(vllm026, 141 * gib, pool_bytes=29 * gib)  # run 13's V2-Lite: 26.8 + 29 fit
    assert shape.architecture == "DeepseekV2ForCausalLM"
    assert calls == ["triton", "host"]  # no --cpu-offload-gb (V2 would ignore it), host still checked
    with pytest.raises(server.LaunchError, match="Model Runner V2.*every expert.*HBM pool"):
        _launch(vllm026, 48 * gib, pool_bytes=29 * gib)  # 26.8 + 29 > 48 GiB: refused, not an OOM
    vllm026.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")  # V1: the offload works and is used
    calls, _ = _launch(vllm026, 141 * gib)
    assert calls == ["triton", "host", "uva"]


def test_hbm_first_load_refusal():
    from reap_swap.sizing.quant.budget import hbm_first_load_refusal

    gib = 2**30
    assert hbm_first_load_refusal(27 * gib, 29 * gib, 1, 139 * gib, "x") is None
    why = hbm_first_load_refusal(27 * gib, 29 * gib, 1, 48 * gib, "x")
    assert (
        why.startswith("x: while loading") and "27.0 GiB" in why and "56.0 GiB, over the device's 48.0" in why
    )
    assert hbm_first_load_refusal(27 * gib, 29 * gib, 2, 48 * gib, "x") is None  # 28 GiB per GPU
    assert hbm_first_load_refusal(27 * gib, 29 * gib, 1, None, "x") is None


def test_the_bench_refuses_stock_uva_where_the_runner_ignores_it(monkeypatch):
    from reap_swap.bench import arms as bench_arms

    spec = bench_arms.RunSpec(arm="stock-uva", label="stock-uva", budget_bytes=2**20, budget_dependent=True)
    shape = NS(architecture="DeepseekV2ForCausalLM", layer_expert_bytes=2**20, moe_layers=[1, 2])
    monkeypatch.setattr(runner, "offload_ignored_reason", lambda archs: f"{archs[0]} on Model Runner V2")
    bench_arms._stock_uva(spec, ["python"], shape, 2**21, "cuda")
    assert spec.skip_reason.startswith("stock-uva refused: DeepseekV2ForCausalLM on Model Runner V2")
    monkeypatch.setattr(runner, "offload_ignored_reason", lambda archs: None)
    spec = bench_arms.RunSpec(arm="stock-uva", label="stock-uva", budget_bytes=2**20, budget_dependent=True)
    bench_arms._stock_uva(spec, ["python"], shape, 2**21, "cuda")
    assert spec.skip_reason is None
