"""compat.runner: what differs for reap-swap between vLLM's model runners V1 and V2 (research.md
"Model Runner V2 audit"). Model Runner V2 needs Triton, which the CPU build lacks, so its behaviour is
faked here from vLLM 0.26.0's source (cited in compat/runner.py); the GPU check is
research/gpu/check_mrv2.py over a families-lane run."""

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


def test_the_launcher_offloads_v2_models_to_host_memory_through_the_hook(vllm026):
    gib = 2**30
    vllm026.setattr(runner, "v2_offloader_hook_missing", lambda: None)
    calls, shape = _launch(vllm026, 48 * gib, pool_bytes=29 * gib)  # 26.8 + 29 GiB would not fit in HBM
    assert shape.architecture == "DeepseekV2ForCausalLM"
    assert calls == ["triton", "host", "uva"]  # loaded into host memory, as on V1


def test_without_the_hook_the_launcher_adds_no_ignored_offload_on_v2_and_checks_hbm(vllm026):
    gib = 2**30
    vllm026.setattr(runner, "v2_offloader_hook_missing", lambda: "no hook here")
    calls, shape = _launch(vllm026, 141 * gib, pool_bytes=29 * gib)  # run 13's V2-Lite: 26.8 + 29 fit
    assert calls == ["triton", "host"]  # no --cpu-offload-gb (V2 would ignore it), host still checked
    with pytest.raises(server.LaunchError, match="Model Runner V2.*every expert.*HBM pool"):
        _launch(vllm026, 48 * gib, pool_bytes=29 * gib)  # 26.8 + 29 > 48 GiB: refused, not an OOM
    vllm026.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")  # V1: the offload works and is used
    calls, _ = _launch(vllm026, 141 * gib)
    assert calls == ["triton", "host", "uva"]


class _Noop:
    def post_init(self):
        pass


class _Uva:  # not a _Noop: an offloader that is set
    def __init__(self, config):
        self.config, self.posted = config, False

    def post_init(self):
        self.posted = True


def _offloader_base():
    """vLLM's offloader.base as the hook uses it (0.26.0 offloader/base.py:108-162): one global."""
    base = NS(NoopOffloader=_Noop, instance=_Noop())
    base.get_offloader = lambda: base.instance
    base.set_offloader = lambda o: setattr(base, "instance", o)
    base.create_offloader = _Uva
    return base


class _FakeV2:
    """Model Runner V2's load_model, recording the offloader the model is built under."""

    def __init__(self, base, offload_config):
        self.base, self.vllm_config, self.seen = base, NS(offload_config=offload_config), []

    def load_model(self, load_dummy_weights=False, *args, **kwargs):
        offloader = self.base.get_offloader()
        self.seen.append((offloader, getattr(offloader, "posted", None), load_dummy_weights, args, kwargs))
        return "loaded"


def test_the_v2_hook_sets_the_uva_offloader_before_the_model_is_built(monkeypatch):
    base = _offloader_base()
    monkeypatch.setattr(_FakeV2, "load_model", _FakeV2.load_model)  # restored after the test
    assert runner.install_v2_offloader((_FakeV2, base)) is None
    assert runner.install_v2_offloader((_FakeV2, base)) is None  # idempotent: wrapped once
    config = _offload_config()
    model = _FakeV2(base, config)
    assert model.load_model(True, 7, x=1) == "loaded"
    [(offloader, posted, dummy, args, kwargs)] = model.seen
    assert isinstance(offloader, _Uva) and offloader.config is config  # built under the offloader
    assert posted is False and base.instance.posted  # post_init after loading, as V1 does
    assert (dummy, args, kwargs) == (True, (7,), {"x": 1})  # arguments passed through


@pytest.mark.parametrize(
    "config, preset",
    [
        (None, None),  # no offload asked for
        (_offload_config(gib=0), None),
        (_offload_config(backend="prefetch"), None),
        (_offload_config(), "set"),  # an offloader is set already (a V1 worker, vLLM >= 0.32.0)
    ],
)
def test_the_v2_hook_leaves_the_offloader_alone_unless_uva_is_asked_and_none_is_set(
    monkeypatch, config, preset
):
    base = _offloader_base()
    before = base.instance = _Uva("theirs") if preset else base.instance
    monkeypatch.setattr(_FakeV2, "load_model", _FakeV2.load_model)
    runner.install_v2_offloader((_FakeV2, base))
    model = _FakeV2(base, config)
    model.load_model()
    assert model.seen[0][0] is before and base.instance is before
    assert getattr(before, "posted", False) is False


def test_the_v2_hook_finds_its_seams_in_this_vllm(monkeypatch):
    from reap_swap.compat import serve

    cls, base = runner._v2_seams()
    assert cls.__module__ == "vllm.v1.worker.gpu.model_runner" and callable(cls.load_model)
    assert all(hasattr(base, n) for n in runner._OFFLOADER_NAMES)
    monkeypatch.setattr(serve, "vllm_version", lambda: (0, 26, 0))
    assert runner.v2_offloader_hook_missing() is None
    monkeypatch.setattr(serve, "vllm_version", lambda: (0, 25, 0))
    assert "older than" in runner.v2_offloader_hook_missing()
    monkeypatch.setattr(serve, "vllm_version", lambda: (0, 32, 0))  # its V2 runner sets it itself
    assert runner.v2_offloader_hook_missing() is None
    original = cls.load_model
    assert runner.install_v2_offloader() is None and cls.load_model is original  # nothing to patch there


def test_a_v2_runner_that_fails_to_import_is_a_reason_not_a_crash(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def failing(name, *args, **kwargs):
        if name == "vllm.v1.worker.gpu.model_runner":
            raise RuntimeError("no triton here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", failing)
    why = runner._v2_seams()
    assert isinstance(why, str) and "RuntimeError: no triton here" in why


def test_the_v2_hook_on_the_real_runner_class_and_offloader(monkeypatch):
    """vLLM's own V2 class and offloader module: inside load_model the global offloader is a UVA one
    with the arguments' byte cap and names."""
    cls, base = runner._v2_seams()
    seen = []
    monkeypatch.setattr(cls, "load_model", lambda self, *a, **k: seen.append(base.get_offloader()))
    monkeypatch.setattr(base, "_instance", base.NoopOffloader())
    runner.install_v2_offloader((cls, base))
    config = _offload_config(gib=1.5)
    config.uva.cpu_offload_params = {"w13_weight", "w2_weight"}
    cls.load_model(NS(vllm_config=NS(offload_config=config)))
    [offloader] = seen
    assert type(offloader).__name__ == "UVAOffloader"
    assert offloader.cpu_offload_max_bytes == int(1.5 * 2**30)
    assert set(offloader.cpu_offload_params) == {"w13_weight", "w2_weight"}


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
