"""Model-specific RoutedExperts subclasses (GPT-OSS) are counted, and plan layers that reap-swap
cannot count are named with their reason instead of failing the worker (issue 15)."""

import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM's RoutedExperts")

from reap_swap.compat import moe as vllm_moe  # noqa: E402
from reap_swap.engine import routed_experts as experts  # noqa: E402


def bare(cls: type, layer_name: str) -> torch.nn.Module:
    """An instance of a RoutedExperts (sub)class without vLLM's constructor (no model config)."""
    module = torch.nn.Module.__new__(cls)
    torch.nn.Module.__init__(module)
    module.layer_name = layer_name
    return module


def test_gpt_oss_routed_experts_get_a_counting_variant():
    from vllm.model_executor.models.gpt_oss import GptOssRoutedExperts

    experts.register()
    variant = vllm_moe.oot_registry()["GptOssRoutedExperts"]
    assert issubclass(variant, experts.ReapRoutedExperts) and issubclass(variant, GptOssRoutedExperts)
    # counting first, then the model's own loading code, then vLLM's RoutedExperts
    mro = variant.__mro__
    assert (
        mro.index(experts.ReapRoutedExperts)
        < mro.index(GptOssRoutedExperts)
        < mro.index(experts.RoutedExperts)
    )
    # idempotent: registering again returns the same class instead of a duplicate-name assertion
    assert experts.register_counting_variant(GptOssRoutedExperts) is variant


def test_absent_model_class_registers_nothing(monkeypatch):
    monkeypatch.setattr(
        vllm_moe, "MODEL_ROUTED_EXPERTS", ("vllm.model_executor.models.no_such_model.NoExperts",)
    )
    assert vllm_moe.model_routed_experts_classes(experts.log) == []


def test_uncounted_plan_layers_are_named_with_their_reason():
    class ForeignExperts(experts.RoutedExperts):
        """A model-specific subclass reap-swap has no variant for."""

    model = torch.nn.ModuleDict(
        {
            "counted": bare(experts.ReapRoutedExperts, "model.layers.2.mlp.experts"),
            "foreign": bare(ForeignExperts, "model.layers.1.mlp.experts"),
        }
    )
    model["counted"].reap_layer_index = 2
    reasons = experts.uncounted_layers(model, [0, 1, 2])
    assert sorted(reasons) == [0, 1]
    assert "ForeignExperts" in reasons[1] and "not counted" in reasons[1]
    assert "no vLLM RoutedExperts module" in reasons[0]
