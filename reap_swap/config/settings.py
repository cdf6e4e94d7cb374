"""REAP settings: REAP_* environment variables and --reap-* flags -> one validated Settings.

Precedence is environment, then flag, then default (deployments set the environment; a flag
baked into a launch script must not silently win over it). An unknown REAP_* variable is an
error listing the known names: a typo must not start a server that silently ignores it. A retired
setting (`RETIRED`: flag or variable -> why) is accepted and ignored with a logged warning, so a
launch script that still passes it keeps working; a retired flag never reaches vLLM.

Every setting, its variable, flag, default and meaning: docs/settings.md. How flags and variables
become a Settings (precedence, unknown and retired names, `--help`): config/flags.py.

Settings reach the engine processes inside vLLM's `--additional-config` JSON under the key
"reap_swap" (vllm_config.additional_config), which every worker and API process receives; the
workers do not read REAP_* themselves (each worker process parses it once, into its worker
runtime: reap_swap.engine.runtime).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from reap_swap.sizing.memory_split import parse_budget

# the launcher's reap_swap handler (logs.get_logger, set up by reap_swap.server.launcher) prints it; a
# warning reaches stderr without one too (logging's last resort)
log = logging.getLogger("reap_swap.config.settings")

ADDITIONAL_CONFIG_KEY = "reap_swap"
CPU_REASON = (
    "vLLM's CPU build keeps every expert in host memory and its fused-MoE kernel "
    "ignores expert_map, so experts cannot move between memories"
)


class SettingsError(ValueError):
    """A setting that cannot be used; the message says which variable or flag and why."""


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    plan_file: Path | None = None
    validate_only: bool = False
    masks_only: bool = False
    router_masks: bool = False
    max_loaded_cartridges: int = Field(default=8, ge=1)
    coactivation: bool = False
    residency: Literal["auto", "accounting", "cuda"] = "auto"
    budget: str = "plan"
    kv_tokens: int | None = Field(default=None, ge=1)

    @field_validator("budget", mode="before")
    @classmethod
    def _budget(cls, value: Any) -> str:
        return str(parse_budget(value))

    def budget_request(self) -> str | float:
        """'plan' | 'auto' | GiB (float): memory_split.parse_budget of the setting."""
        return parse_budget(self.budget)

    cache: Literal["lfu", "lru", "off"] = "lfu"

    @field_validator("cache", mode="before")
    @classmethod
    def _cache(cls, v: Any) -> Any:
        return "lfu" if str(v).strip().lower() == "on" else v  # on: the default policy

    # "swaps": the launcher resolves it to an integer (server.resolve_cache_slots); workers never see it
    cache_slots: Literal["auto", "swaps"] | int = "auto"
    # the CUDA device cache; auto (the default): on wherever it is served (cache_form), the
    # launcher resolves it, so workers see on or off
    cache_device: Literal["auto", "on", "off"] = "auto"
    # device cache form: core+dlfu (pinned) | dlfu-seeded (seeded); auto: seeded where the device
    # cache is on (cache_form)
    cache_seed: Literal["auto", "pinned", "seeded"] = "auto"
    cache_record_steps: int = Field(default=0, ge=0)
    cache_shadow: Literal["off", "out", "bytes"] = "off"  # debug shadow of the device cache
    group_size: Literal["auto", "1", "2", "4", "8"] = "1"  # grouped units; experimental
    # cudaHostRegister vLLM's UVA expert copies (compat/pinning.py); auto: the launcher decides
    # (server.resolve_exact_pinning), the workers only ever see True or False
    exact_pinning: Literal["auto"] | bool = "auto"
    # when a swap makes its remapped units accessible (residency/swap.py); ahead: the default (the fastest measured)
    swap_publish: Literal["ahead", "idle", "end"] | int = "ahead"

    @field_validator("group_size", mode="before")
    @classmethod
    def _group_size(cls, v: Any) -> Any:
        return v if isinstance(v, bool) else str(v).strip().lower()

    @field_validator("exact_pinning", mode="before")
    @classmethod
    def _exact_pinning(cls, v: Any) -> Any:
        if isinstance(v, bool):
            return v
        text = str(v).strip().lower()
        if text == "auto":
            return "auto"
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("", "0", "false", "no", "off"):
            return False
        raise ValueError("expected auto, on (1, true) or off (0, false)")

    @field_validator("swap_publish", mode="before")
    @classmethod
    def _swap_publish(cls, v: Any) -> Any:
        text = str(v).strip().lower()
        if text in ("ahead", "idle", "end"):
            return text
        if isinstance(v, bool) or not text.isdigit() or int(text) < 1:
            raise ValueError("expected ahead, idle, end or an integer N >= 1 (publish every N landed copies)")
        return int(text)

    @field_validator("cache_slots", mode="before")
    @classmethod
    def _cache_slots(cls, v: Any) -> Any:
        text = str(v).strip().lower()
        if text in ("auto", "swaps"):
            return text
        if isinstance(v, bool) or not text.isdigit():
            raise ValueError("expected auto, swaps or an integer >= 0 (cache slots beyond the pinned set)")
        return int(text)

    def log_line(self) -> str:
        return "reap-swap settings: " + ", ".join(f"{k}={v}" for k, v in self.model_dump().items())

    def to_worker_config(self, **extra: Any) -> dict:
        """JSON-able dict for vllm's additional_config["reap_swap"] (plus e.g. plan identity)."""
        return {**self.model_dump(mode="json"), **extra}

    @classmethod
    def from_worker_config(cls, cfg: Mapping[str, Any]) -> Settings:
        settings = cls(**{k: v for k, v in cfg.items() if k in cls.model_fields})
        if settings.cache_slots == "swaps":  # needs the plan and the model's top_k: the launcher's
            raise ValueError(
                "cache_slots 'swaps' reached a worker unresolved: start the server with "
                "`python -m reap_swap.server`, which turns --reap-cache-slots swaps into a slot count"
            )
        return settings

    def accounting_reason(self, platform: str) -> str | None:
        """Why swaps on `platform` only record the resident set (accounting), or None when the
        CUDA residency engine moves the bytes. The one place launcher, model build and worker
        decide it (REAP_RESIDENCY=cuda on another platform is the worker's error to raise)."""
        if self.masks_only:
            return "REAP_SWAP_MASKS_ONLY: swaps change the active set, weights stay put"
        if self.residency == "accounting":
            return "REAP_RESIDENCY=accounting"
        if platform != "cuda":
            return CPU_REASON if platform == "cpu" else f"no residency engine for platform {platform!r}"
        return None


def cache_form(settings: Settings, platform: str, parallel: int = 1) -> tuple[Settings, str]:
    """``auto`` cache_device / cache_seed -> on|off and pinned|seeded, with the one sentence the
    launcher logs. The device cache is the serving path on CUDA wherever it is served: the device
    implements lfu, at one GPU per model (tensor or pipeline parallelism: not yet), on private
    expert units (no --reap-group-size) and on the plan's pool (--reap-budget plan). There it runs
    seeded (each layer's share of the pool is cache slots seeded with the plan core, a swap pinned
    inside them): it matched or beat the pinned form in every simulation of committed and real
    (OLMoE) traces and needs no room kept for swaps. Elsewhere the path is what it was: CPU
    accounting, or the plan's static set on CUDA. Explicit on / off / pinned / seeded are kept."""
    device, seed = settings.cache_device, settings.cache_seed
    why = ""
    if device == "auto":
        blocker = None
        if settings.cache == "off":
            blocker = "--reap-cache off"
        elif settings.accounting_reason(platform) is not None:
            blocker = f"accounting residency ({settings.accounting_reason(platform)})"
        elif settings.cache != "lfu":
            blocker = f"--reap-cache {settings.cache}: the device cache implements lfu only"
        elif parallel > 1:
            blocker = "tensor/pipeline parallelism: the device cache is served on one GPU per model only"
        elif settings.group_size != "1":
            blocker = f"--reap-group-size {settings.group_size}: the device cache knows no groups"
        elif settings.budget != "plan":
            blocker = f"--reap-budget {settings.budget}: the device cache runs on the plan's pool"
        device = "off" if blocker else "on"
        why = f"device cache off: {blocker}" if blocker else "device cache on (the default on CUDA)"
    if seed == "auto":
        seed = "seeded" if device == "on" and settings.cache_slots != "swaps" else "pinned"
        if device == "on":
            why += f", {seed} form"
    return settings.model_copy(update={"cache_device": device, "cache_seed": seed}), why


ROUTER_MASKS_REFUSED = (
    "router masking (REAP_ENABLE_ROUTER_MASKS / --reap-enable-router-masks) is not implemented: "
    "restricting routing to resident experts is known to destroy output quality. reap-swap keeps "
    "routing untouched and reads non-resident experts from host memory instead; unset it."
)


def reap_config(additional_config: Any) -> dict | None:
    """additional_config["reap_swap"] of a vLLM config (what the launcher wrote), or None."""
    cfg = additional_config.get(ADDITIONAL_CONFIG_KEY) if isinstance(additional_config, Mapping) else None
    return dict(cfg) if isinstance(cfg, Mapping) and cfg else None


def load_configured_plan(cfg: Mapping[str, Any]):
    """(Settings, Plan) from reap_config's dict: the plan file re-read in this process must still
    have the identity the launcher validated."""
    from reap_swap.plan.document import load_plan

    settings = Settings.from_worker_config(cfg)
    plan = load_plan(str(settings.plan_file))
    if cfg.get("plan_identity") and cfg["plan_identity"] != plan.identity:
        raise RuntimeError(
            f"plan {settings.plan_file} changed since the launcher validated it "
            f"(identity {plan.identity[:12]} != {cfg['plan_identity'][:12]})"
        )
    return settings, plan


def cache_slots_conflict(settings: Settings, sources: Mapping[str, str] | None = None) -> str | None:
    """Why --reap-cache-slots swaps cannot be combined with the other settings (None: it can). The
    split (cache_tail.plan_swap_split) is the pinned form's, on the plan's pool."""
    if settings.cache_slots != "swaps":
        return None
    origin = "REAP_CACHE_SLOTS" if (sources or {}).get("cache_slots") == "env" else "--reap-cache-slots"
    if settings.cache == "off":
        return f"{origin} swaps with --reap-cache off: there is no cache tail to size"
    if settings.cache_seed == "seeded":  # auto resolves to pinned beside swaps (cache_form)
        return (
            f"{origin} swaps with --reap-cache-seed seeded: that form pins a swap inside the layer's cache "
            "slots, so it needs no room beside them; use auto or N"
        )
    if settings.budget != "plan":
        return (
            f"{origin} swaps with --reap-budget {settings.budget}: the split is computed on the plan's pool "
            "before the engine starts; use --reap-budget plan or give N"
        )
    return None


def group_size_conflict(settings: Settings, sources: Mapping[str, str] | None = None) -> str | None:
    """Why --reap-group-size cannot be combined with the other settings (None: it can)."""
    if settings.group_size == "1":
        return None
    origin = "REAP_GROUP_SIZE" if (sources or {}).get("group_size") == "env" else "--reap-group-size"
    if settings.cache_device == "on":
        return (
            f"{origin} {settings.group_size} with --reap-cache-device on: the device cache maps expert "
            "ids to its own slots and knows no groups; use one of them"
        )
    if settings.budget != "plan":
        return (
            f"{origin} {settings.group_size} with --reap-budget {settings.budget}: the pool growth "
            "(residency/budget.py) adds private expert slots, not groups; use --reap-budget plan"
        )
    return None
