"""The worker runtime: the one object per worker process that holds its reap-swap state.

Built once from `additional_config["reap_swap"]` (what the launcher wrote): settings parsed once,
the plan loaded once (and checked against the identity the launcher validated). It owns the CUDA
engine's load-time state, the per-layer refusals and the process's counter kernel, and is handed
explicitly to the MoE layers, the engine and the worker extension.

Why one registry (`for_config` / `current`): vLLM constructs the MoE layers itself, inside its
model build (ReapRoutedExperts.__init__ gets only vLLM's arguments), and mixes the worker
extension into a worker class it instantiates. Neither lets us pass an object in, so both find
the process's runtime here -- the layers through the vLLM config current during the build, the
extension through its worker's `vllm_config` -- and everything below them gets it as an argument.
A process builds one model with one config, so the registry holds one runtime; a second,
different config in the same process is an error rather than a silent mix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from reap_swap import get_logger
from reap_swap.config.settings import Settings, load_configured_plan, reap_config
from reap_swap.engine.counting.count_kernel import CountKernel
from reap_swap.engine.residency.refusals import LayerRefusals

log = get_logger("reap_swap.engine.runtime")


@dataclass
class WorkerRuntime:
    config: dict  # additional_config["reap_swap"] ({} when the launcher did not write one)
    settings: Settings
    plan: Any | None  # reap_swap.plan.document.Plan; None without a plan file
    refusals: LayerRefusals = field(default_factory=LayerRefusals)
    count_kernel: CountKernel = field(default_factory=CountKernel)
    engine: Any | None = None  # residency.engine.CudaEngine, made by the first CUDA MoE layer
    engine_error: str | None = None  # why the engine could not be imported (accounting fallback)
    cache_reason: str | None = None  # why the CUDA device cache is not built, None: built
    kv_hooked: bool = False  # accounting: the KV-target hook is installed (routed_experts.py)
    kv_report: dict | None = None  # accounting: kv_target.decide's report (--reap-budget auto | GiB)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any] | None) -> WorkerRuntime:
        cfg = dict(cfg or {})
        if cfg.get("plan_file"):
            settings, plan = load_configured_plan(cfg)
        else:
            settings, plan = Settings.from_worker_config(cfg), None
        return cls(config=cfg, settings=settings, plan=plan)

    @property
    def configured(self) -> bool:
        """Did the launcher hand this process a plan (python -m reap_swap.server)?"""
        return self.plan is not None

    def cuda_engine(self, platform: str):
        """The process's CUDA engine when this worker moves bytes on CUDA, else None.

        Made on first call; an engine that cannot be imported is an error under
        REAP_RESIDENCY=cuda and otherwise logged (swaps then only record the resident set).
        """
        if self.engine is not None or self.engine_error is not None:
            return self.engine
        if self.settings.accounting_reason(platform) is not None:
            return None
        try:
            from reap_swap.engine.residency.engine import CudaEngine
        except Exception as exc:  # noqa: BLE001
            if self.settings.residency.backend == "cuda":
                raise
            self.engine_error = f"{type(exc).__name__}: {exc}"
            log.error(
                "reap-swap: CUDA residency engine not importable (%s); experts stay where vLLM "
                "puts them and swaps will be accounting-only",
                self.engine_error,
            )
            return None
        from reap_swap.engine.device_cache.serving import cache_config_for
        from reap_swap.engine.residency.swap import publish_every_of

        cache, self.cache_reason = cache_config_for(self.settings, self.plan)
        self.engine = CudaEngine(
            self.plan,
            self.refusals,
            cache=cache,
            group_size=self.settings.residency.group_size,
            publish_every=publish_every_of(self.settings.residency.swap_publish),
        )
        if self.settings.budget.pool != "plan":  # --reap-budget auto | GiB (engine/residency/budget.py)
            from reap_swap.engine.residency.budget import BudgetHook

            self.engine.on_state = BudgetHook(self.settings).on_state
        return self.engine

    def decide_kv(self) -> None:
        """Accounting residency, at the first MoE layer's post-load: size vLLM's KV cache to the
        KV target (kv_target.py); the CUDA engine does this in engine/residency/budget.py instead."""
        from reap_swap.engine.kv_target import decide

        self.kv_report = decide(self.settings.budget.kv_tokens, self.settings.budget.request())

    def close(self) -> None:
        """Release what the process holds on the device (the HBM pool); called at worker shutdown."""
        if self.engine is not None:
            try:
                self.engine.release()
            except Exception as exc:  # noqa: BLE001 - shutdown must go on
                log.error("reap-swap: releasing the HBM pool failed: %s: %s", type(exc).__name__, exc)


class _Registry:
    """Where this process's runtime is (see the module docstring for why there is one)."""

    def __init__(self) -> None:
        self.runtime: WorkerRuntime | None = None

    def for_config(self, additional_config: Any) -> WorkerRuntime:
        cfg = reap_config(additional_config) or {}
        if self.runtime is None:
            self.runtime = WorkerRuntime.from_config(cfg)
        elif self.runtime.config != cfg:
            raise RuntimeError(
                "reap-swap: a second, different additional_config['reap_swap'] in one worker "
                f"process ({self.runtime.config} vs {cfg}); one runtime per process"
            )
        return self.runtime

    def clear(self) -> None:
        self.runtime = None


REGISTRY = _Registry()


def for_config(additional_config: Any) -> WorkerRuntime:
    """The process's runtime for this `additional_config` (built on first call)."""
    return REGISTRY.for_config(additional_config)


def current() -> WorkerRuntime:
    """The process's runtime for the vLLM config being built (MoE layer construction)."""
    from reap_swap.compat import moe as vllm_moe

    return REGISTRY.for_config(vllm_moe.current_additional_config())
