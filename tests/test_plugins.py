"""The general plugin registers the counting RoutedExperts only where VLLM_PLUGINS names it, once."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

from reap_swap.engine import plugins


def test_entry_points_are_installed_under_their_names():
    general = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    endpoint = {ep.name: ep.value for ep in entry_points(group="vllm.endpoint_plugins")}
    if plugins.LAYERS_PLUGIN not in general:
        pytest.skip("reap-swap's metadata predates the general plugin: pip install -e . again")
    assert general[plugins.LAYERS_PLUGIN] == "reap_swap.engine.plugins:register"
    assert endpoint[plugins.ENDPOINT_PLUGIN] == "reap_swap.server.routes:endpoint_plugin"


def test_layers_plugin_acts_only_when_named(monkeypatch):
    assert not plugins.layers_plugin_enabled({})  # stock vLLM (VLLM_PLUGINS unset) stays stock
    assert not plugins.layers_plugin_enabled({"VLLM_PLUGINS": "reap_swap"})
    assert plugins.layers_plugin_enabled({"VLLM_PLUGINS": "x,reap_swap_layers"})


def test_register_is_idempotent_and_registers_the_counting_layer(monkeypatch):
    pytest.importorskip("vllm")
    from reap_swap.compat import moe as compat
    from reap_swap.engine import routed_experts as experts

    registry = compat.oot_registry()
    monkeypatch.delitem(registry, experts.RoutedExperts.__name__, raising=False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    plugins.register()
    assert experts.RoutedExperts.__name__ not in registry  # not named: nothing registered
    monkeypatch.setenv("VLLM_PLUGINS", plugins.vllm_plugins_allowlist(""))
    plugins.register()
    plugins.register()
    assert registry[experts.RoutedExperts.__name__] is experts.ReapRoutedExperts
