"""How reap-swap plugs into vLLM: the names vLLM is told, and the general plugin.

Each name means one thing:
- ENDPOINT_PLUGIN: the `vllm.endpoint_plugins` entry point (routes.endpoint_plugin), the REAP
  HTTP routes in the API process; also that plugin object's `name`.
- LAYERS_PLUGIN: the `vllm.general_plugins` entry point (`register` below), which vLLM runs once
  in every process (API server, engine core, each worker before its model is built): it makes
  vLLM build the counting ReapRoutedExperts wherever it would build RoutedExperts.
- WORKER_EXTENSION_CLS: the `--worker-extension-cls` value (worker RPCs).

The general plugin acts only where it is named in VLLM_PLUGINS, as the launcher and `observe` do
(`vllm_plugins_allowlist`): vLLM loads every installed general plugin when VLLM_PLUGINS is unset,
and a stock `vllm serve` on a machine with reap-swap installed must stay stock.

Importable without torch or vLLM (the launcher imports it before choosing anything).
"""

from __future__ import annotations

import os
from importlib.metadata import entry_points

ENDPOINT_PLUGIN = "reap_swap"
LAYERS_PLUGIN = "reap_swap_layers"
WORKER_EXTENSION_CLS = "reap_swap.engine.worker.ReapWorkerExtension"
OUR_PLUGINS = (ENDPOINT_PLUGIN, LAYERS_PLUGIN)

# groups VLLM_PLUGINS allowlists once it is set (endpoint plugins load only when named anyway)
_ALLOWLISTED_GROUPS = (
    "vllm.general_plugins",
    "vllm.platform_plugins",
    "vllm.stat_logger_plugins",
    "vllm.io_processor_plugins",
)


def vllm_plugins_allowlist(current: str | None, names: tuple[str, ...] = OUR_PLUGINS) -> str:
    """VLLM_PLUGINS value that adds `names` without disabling anything that loaded before.

    When VLLM_PLUGINS was unset, every installed general/platform/stat-logger/io-processor plugin
    is listed too, because setting the variable turns it into an allowlist for those groups."""
    if current is not None:
        listed = [n for n in current.split(",") if n]
    else:
        listed = sorted({ep.name for group in _ALLOWLISTED_GROUPS for ep in entry_points(group=group)})
    listed += [n for n in names if n not in listed]
    return ",".join(listed)


def layers_plugin_enabled(environ=os.environ) -> bool:
    """True when VLLM_PLUGINS names LAYERS_PLUGIN explicitly (see the module docstring)."""
    return LAYERS_PLUGIN in (environ.get("VLLM_PLUGINS") or "").split(",")


def register() -> None:
    """Entry point `vllm.general_plugins: reap_swap_layers`: register ReapRoutedExperts as the
    out-of-tree RoutedExperts (idempotent: vLLM may call it more than once per process). Where
    REAPSWAP_TORCHVISION_STAND_IN is set (the launcher sets it; compat/torchvision_stub.py), it first
    imports a text-only Qwen3.5 without torchvision, also in a stock vLLM given that variable."""
    from reap_swap.compat import torchvision_stub

    # before the allowlist check: stock vLLM (the comparison arm) given the same environment
    # variable imports a text-only Qwen3.5 the same way; a no-op while the variable is unset
    torchvision_stub.install_if_requested()
    if not layers_plugin_enabled():
        return
    import logging

    from reap_swap.compat import pinning, runner
    from reap_swap.engine import routed_experts as experts

    experts.register()
    log = logging.getLogger("reap_swap.compat")
    why = pinning.install()  # acts only where the config being built sets exact_pinning
    if why is not None:
        log.info("reap-swap: exact pinning not available: %s", why)
    why = runner.install_v2_offloader()  # Model Runner V2 of 0.26.x: load experts into host memory
    if why is not None:
        log.warning("reap-swap: Model Runner V2 offload hook: %s", why)
