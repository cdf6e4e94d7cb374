"""reap_swap/compat/torchvision_stub.py: the text-only Qwen3.5 import without torchvision.

A fake "qwen3_5" module stands in for vLLM's (which takes ~10 s to import): it does what the real
chain does at import time (`from torchvision.transforms.v2 import functional as tvF`). The real
import ran in the e2e case (tests/e2e/test_families_dummy.py, qwen3_5_moe_tiny)."""

from __future__ import annotations

import argparse
import os
import sys

import pytest

from reap_swap.compat import torchvision_stub as tv

pytestmark = pytest.mark.skipif(tv.torchvision_installed(), reason="a real torchvision is installed here")


def test_launcher_refuses_the_multimodal_class_and_names_the_text_only_one():
    why = tv.launch_refusal("Qwen3_5MoeForConditionalGeneration", blocked=True)
    assert "torchvision" in why and "[Qwen3_5MoeForCausalLM]" in why and "text_config" in why
    assert tv.launch_refusal("Qwen3_5MoeForConditionalGeneration", blocked=False) is None
    assert tv.launch_refusal("MixtralForCausalLM", blocked=True) is None


def test_only_a_text_only_qwen35_without_torchvision_gets_the_environment():
    assert tv.launch_env("Qwen3_5MoeForCausalLM", blocked=True) == {tv.ENV: "Qwen3_5MoeForCausalLM"}
    assert tv.launch_env("Qwen3_5MoeForCausalLM", blocked=False) == {}
    assert tv.launch_env("Qwen3NextForCausalLM", blocked=True) == {}
    assert tv.launch_env("Qwen3_5MoeForConditionalGeneration", blocked=True) == {}


def test_the_stand_in_refuses_every_public_use():
    mods = tv._stand_ins()
    fn = mods[tv.STUB_FUNCTIONAL]
    assert mods["torchvision.transforms.v2"].functional is fn
    with pytest.raises(tv.TorchvisionStubUsed, match="functional.resize was used"):
        fn.resize  # noqa: B018
    assert not hasattr(fn, "__wrapped__")  # dunders stay ordinary AttributeErrors (inspect, pickle)
    assert not hasattr(mods["torchvision"], "ops")


@pytest.fixture
def fake_qwen35(tmp_path, monkeypatch):
    pkg = tmp_path / "fakevllm_q35"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "qwen3_5.py").write_text("from torchvision.transforms.v2 import functional as tvF\n")
    (pkg / "qwen3_5_mtp.py").write_text("from .qwen3_5 import tvF\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(tv, "QWEN35_MODULE", "fakevllm_q35.qwen3_5")
    monkeypatch.setattr(tv, "MTP_MODULE", "fakevllm_q35.qwen3_5_mtp")
    yield
    for name in [n for n in sys.modules if n.startswith("fakevllm_q35")]:
        del sys.modules[name]


def test_import_succeeds_and_leaves_no_torchvision_behind(fake_qwen35):
    assert tv.install_if_requested({tv.ENV: "Qwen3_5MoeForCausalLM"}) is True
    mod = sys.modules["fakevllm_q35.qwen3_5"]
    assert "fakevllm_q35.qwen3_5_mtp" in sys.modules
    assert not [n for n in sys.modules if n.split(".")[0] == "torchvision"]
    assert not tv.torchvision_installed()
    with pytest.raises(ImportError):
        import torchvision  # noqa: F401
    with pytest.raises(tv.TorchvisionStubUsed):
        mod.tvF.to_image  # noqa: B018
    from transformers.utils import import_utils

    assert import_utils.is_torchvision_available() is False


def test_nothing_happens_without_the_variable_and_a_bad_name_is_refused(fake_qwen35):
    assert tv.install_if_requested({}) is False
    assert "fakevllm_q35.qwen3_5" not in sys.modules
    with pytest.raises(RuntimeError, match="Qwen3NextForCausalLM"):
        tv.install_if_requested({tv.ENV: "Qwen3NextForCausalLM"})


def test_a_torchvision_already_in_sys_modules_is_not_replaced(fake_qwen35, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchvision", object())
    with pytest.raises(RuntimeError, match="already imported"):
        tv.import_text_only_qwen35()


def test_the_launcher_refuses_multimodal_and_arranges_text_only(monkeypatch):
    from reap_swap.server import launcher as server

    calls = []
    monkeypatch.setattr(tv, "import_blocked", lambda arch: arch.startswith("Qwen3_5"))
    monkeypatch.setattr(tv, "install_if_requested", lambda env: calls.append(env.get(tv.ENV)))
    monkeypatch.setattr(tv, "registered", lambda arch: arch != "Qwen3_5ForCausalLM")
    monkeypatch.delenv(tv.ENV, raising=False)
    args = argparse.Namespace(model="/m")
    with pytest.raises(
        server.LaunchError, match="model /m: Qwen3_5MoeForConditionalGeneration needs torchvision"
    ):
        server.arrange_torchvision(args, "Qwen3_5MoeForConditionalGeneration")
    server.arrange_torchvision(args, "MixtralForCausalLM")
    assert calls == [] and tv.ENV not in os.environ
    server.arrange_torchvision(args, "Qwen3_5MoeForCausalLM")
    assert calls == ["Qwen3_5MoeForCausalLM"] and os.environ[tv.ENV] == "Qwen3_5MoeForCausalLM"
    with pytest.raises(server.LaunchError, match="does not register Qwen3_5ForCausalLM"):
        server.arrange_torchvision(args, "Qwen3_5ForCausalLM")


def test_import_blocked_is_found_by_importing_and_only_for_qwen35(fake_qwen35, tmp_path, monkeypatch):
    assert tv.import_blocked("Qwen3_5MoeForCausalLM") is True  # the fake imports torchvision
    assert "fakevllm_q35.qwen3_5" not in sys.modules
    assert tv.import_blocked("MixtralForCausalLM") is False
    (tmp_path / "fakevllm_q35" / "fine.py").write_text("X = 1\n")
    monkeypatch.setattr(tv, "QWEN35_MODULE", "fakevllm_q35.fine")
    assert tv.import_blocked("Qwen3_5MoeForConditionalGeneration") is False  # imports: no stand-in
    (tmp_path / "fakevllm_q35" / "other.py").write_text("import not_a_module_here\n")
    monkeypatch.setattr(tv, "QWEN35_MODULE", "fakevllm_q35.other")
    with pytest.raises(ModuleNotFoundError, match="not_a_module_here"):
        tv.import_blocked("Qwen3_5MoeForCausalLM")
