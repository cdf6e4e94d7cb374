"""REAP settings: REAP_* environment variables and --reap-* flags -> one validated Settings.

Precedence is environment, then flag, then default (deployments set the environment; a flag
baked into a launch script must not silently win over it). An unknown REAP_* variable is an
error listing the known names: a typo must not start a server that silently ignores it. A retired
setting (`RETIRED`: flag or variable -> why) is accepted and ignored with a logged warning, so a
launch script that still passes it keeps working; a retired flag never reaches vLLM.

Every setting, its variable, flag, default and meaning: docs/settings.md (the `--help` text is
built from `_SPEC` below).

Settings reach the engine processes inside vLLM's `--additional-config` JSON under the key
"reap_swap" (vllm_config.additional_config), which every worker and API process receives; the
workers do not read REAP_* themselves (each worker process parses it once, into its worker
runtime: reap_swap.runtime).
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from reap_swap.memory_split import parse_budget

# the launcher's reap_swap handler (logs.get_logger, set up by reap_swap.server) prints it; a
# warning reaches stderr without one too (logging's last resort)
log = logging.getLogger("reap_swap.settings")

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


# field -> (environment variable, flag, argparse kwargs)
_SPEC: dict[str, tuple[str, str, dict]] = {
    "plan_file": ("REAP_PLAN_FILE", "--reap-plan", {"metavar": "PATH", "help": "the REAP plan JSON"}),
    "validate_only": (
        "REAP_SWAP_VALIDATE_ONLY",
        "--reap-validate-only",
        {"action": "store_const", "const": True, "help": "validate swap payloads, change nothing"},
    ),
    "masks_only": (
        "REAP_SWAP_MASKS_ONLY",
        "--reap-masks-only",
        {
            "action": "store_const",
            "const": True,
            "help": "swaps change the active set only; no expert weights move",
        },
    ),
    "router_masks": (
        "REAP_ENABLE_ROUTER_MASKS",
        "--reap-enable-router-masks",
        {
            "action": "store_const",
            "const": True,
            "help": "not implemented (destroys output quality); refused",
        },
    ),
    "max_loaded_cartridges": (
        "REAP_MAX_LOADED_CARTRIDGES",
        "--reap-max-loaded-cartridges",
        {"type": int, "metavar": "N", "help": "loaded cartridges kept (LRU)"},
    ),
    "coactivation": (
        "REAP_COACTIVATION",
        "--reap-coactivation",
        {"action": "store_const", "const": True, "help": "count expert co-activation (E*E per layer)"},
    ),
    "residency": (
        "REAP_RESIDENCY",
        "--reap-residency",
        {"choices": ["auto", "accounting", "cuda"], "help": "residency backend"},
    ),
    "budget": (
        "REAP_BUDGET",
        "--reap-budget",
        {"metavar": "auto|plan|GIB", "help": "HBM expert pool size (default: the plan's budget)"},
    ),
    "kv_tokens": (
        "REAP_KV_TOKENS",
        "--reap-kv-tokens",
        {"type": int, "metavar": "N", "help": "KV target (tokens) kept for --reap-budget auto/GiB"},
    ),
    "cache": (
        "REAP_CACHE",
        "--reap-cache",
        {
            "choices": ["on", "off", "lfu", "lru"],
            "help": "the per-layer expert cache (default on = lfu; on CUDA it runs on the device where "
            "served, else in accounting mode; lru: accounting only)",
        },
    ),
    "cache_slots": (
        "REAP_CACHE_SLOTS",
        "--reap-cache-slots",
        {
            "metavar": "N|auto|swaps",
            "help": "cache slots beyond the pinned set over all layers (auto; swaps: leave per-request swaps room)",
        },
    ),
    "cache_device": (
        "REAP_CACHE_DEVICE",
        "--reap-cache-device",
        {
            "choices": ["auto", "on", "off"],
            "help": "the device expert cache (default auto: on wherever it is served on CUDA; on: also "
            "modelled by accounting residency)",
        },
    ),
    "cache_seed": (
        "REAP_CACHE_SEED",
        "--reap-cache-seed",
        {
            "choices": ["auto", "pinned", "seeded"],
            "help": "device cache form: the plan core seeded into each layer's slots, evictable, swaps "
            "pinned inside them (seeded; auto's choice) or pinned beside a cache tail (pinned)",
        },
    ),
    "cache_record_steps": (
        "REAP_CACHE_RECORD_STEPS",
        "--reap-cache-record-steps",
        {"type": int, "metavar": "N", "help": "keep the last N steps' routing for /reap/cache/trace"},
    ),
    "cache_shadow": (
        "REAP_CACHE_SHADOW",
        "--reap-cache-shadow",
        {
            "choices": ["off", "out", "bytes"],
            "help": "debug: compare every cached MoE step with the uncached kernel (default off)",
        },
    ),
    "group_size": (
        "REAP_GROUP_SIZE",
        "--reap-group-size",
        {
            "choices": ["auto", "1", "2", "4", "8"],
            "help": "EXPERIMENTAL: experts per mapping unit (grouped units, CUDA; default 1 = private units)",
        },
    ),
    "exact_pinning": (
        "REAP_SWAP_EXACT_PINNING",
        "--reap-exact-pinning",
        {
            "action": "store_const",
            "const": True,
            "help": "pin vLLM's UVA expert copies at their exact size (cudaHostRegister) instead of PyTorch's "
            "power-of-two blocks; default auto: on where the rounded copies plus a layer in flight would hold "
            "more than 1.2x the expert bytes; REAP_SWAP_EXACT_PINNING=0 turns it off",
        },
    ),
    "swap_publish": (
        "REAP_SWAP_PUBLISH",
        "--reap-swap-publish",
        {
            "metavar": "ahead|idle|end|N",
            "help": "CUDA swaps: when remapped units are made accessible (default ahead: every remap and one "
            "publish while the copies are in flight; idle: publish while waiting on a copy; end: after the "
            "last copy; N: every N landed copies)",
        },
    ),
}
ENV_NAMES: tuple[str, ...] = tuple(spec[0] for spec in _SPEC.values())
FLAG_NAMES: tuple[str, ...] = tuple(spec[1] for spec in _SPEC.values())

INT4_GROUPS_DEFAULT = (
    "identity-order INT4 groups are the default under --reap-group-size auto|2|4|8 (AWQ, GPTQ and "
    "CT W4A16 served identical to stock: research.md); the setting is no longer needed and is ignored"
)
SEEDED_CACHE_SERVED = (
    "--reap-cache-seed seeded is served on CUDA without an opt-in (the default form there; bitwise "
    "equal to stock at every logprob: research.md); the setting is no longer needed and is ignored"
)
# Retired settings, the one place: flag (takes no value) or environment variable -> why it is
# ignored. split_argv strips the flag (vLLM never sees it) and resolve does not count the variable
# as unknown; each one given is logged once as a warning.
RETIRED: dict[str, str] = {
    "--reap-unverified-int4-groups": INT4_GROUPS_DEFAULT,
    "REAP_SWAP_UNVERIFIED_INT4_GROUPS": INT4_GROUPS_DEFAULT,
    "--reap-unverified-seeded-cache": SEEDED_CACHE_SERVED,
    "REAP_SWAP_UNVERIFIED_SEEDED_CACHE": SEEDED_CACHE_SERVED,
}


def warn_retired(name: str) -> None:
    log.warning("reap-swap: %s is retired: %s", name, RETIRED[name])


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
    from reap_swap.plan import load_plan

    settings = Settings.from_worker_config(cfg)
    plan = load_plan(str(settings.plan_file))
    if cfg.get("plan_identity") and cfg["plan_identity"] != plan.identity:
        raise RuntimeError(
            f"plan {settings.plan_file} changed since the launcher validated it "
            f"(identity {plan.identity[:12]} != {cfg['plan_identity'][:12]})"
        )
    return settings, plan


# Settings the defaults make unnecessary: still accepted (scripts, measurements), listed in
# docs/settings.md, named in one line of --help instead of described there.
DEBUG_SETTINGS = ("cache_device", "cache_seed", "cache_shadow", "swap_publish")


def help_text(prog: str) -> str:
    """The REAP part of ``--help``: each flag, its environment variable and what it does, from the
    one spec the parser is built from (vLLM prints its own arguments after it)."""
    rows = []
    for name, (env, flag, kwargs) in _SPEC.items():
        if name in DEBUG_SETTINGS:
            continue
        meta = kwargs.get("metavar") or ("|".join(kwargs["choices"]) if "choices" in kwargs else "")
        head = f"  {flag} {meta}".rstrip()
        rows.append(f"{head}\n      {kwargs.get('help', '')} [{env}]")
    return (
        f"usage: {prog} MODEL [vllm serve arguments] [--reap-* flags]\n\n"
        "Every `vllm serve` argument works as it does there (listed below). REAP settings, each also an "
        "environment variable (the environment wins over the flag):\n"
        + "\n".join(rows)
        + "\nDebug settings (docs/settings.md): "
        + ", ".join(_SPEC[n][1] for n in DEBUG_SETTINGS)
        + "\n"
    )


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add the --reap-* flags (default None, so 'not given' is distinguishable)."""
    for name, (_env, flag, kwargs) in _SPEC.items():
        parser.add_argument(flag, dest=name, default=None, **kwargs)


def split_argv(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Separate the --reap-* flags from everything else (which is vLLM's); a retired flag
    (`RETIRED`) is dropped with a warning."""
    argv = list(argv)
    retired = [a for a in argv if a.startswith("--") and a in RETIRED]
    for name in dict.fromkeys(retired):
        warn_retired(name)
    argv = [a for a in argv if a not in retired]
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_flags(parser)
    ns, rest = parser.parse_known_args(argv)
    leftover = [a for a in rest if a.split("=", 1)[0].startswith("--reap-")]
    if leftover:
        raise SettingsError(f"unknown reap flag(s) {leftover}; known: {', '.join(FLAG_NAMES)}")
    return ns, rest


@dataclass
class Resolved:
    settings: Settings
    sources: dict[str, str]  # field -> "env" | "flag" | "default"
    overrides: list[str] = field(default_factory=list)  # "REAP_X overrides --reap-x" sentences


def unknown_env(environ: Mapping[str, str]) -> list[str]:
    return sorted(k for k in environ if k.startswith("REAP_") and k not in ENV_NAMES and k not in RETIRED)


def resolve(
    flags: argparse.Namespace | Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    require_plan: bool = True,
) -> Resolved:
    """Merge environment > flags > defaults into a validated Settings (``require_plan=False``: for
    ``--help``, which must work without one)."""
    environ = os.environ if environ is None else environ
    given = vars(flags) if isinstance(flags, argparse.Namespace) else dict(flags or {})
    unknown = unknown_env(environ)
    if unknown:
        raise SettingsError(
            f"unknown REAP_* environment variable(s) {', '.join(unknown)}; known: {', '.join(ENV_NAMES)}"
        )
    for name in sorted(k for k in environ if k in RETIRED):
        warn_retired(name)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    overrides: list[str] = []
    for name, (env, flag, _kw) in _SPEC.items():
        flag_value = given.get(name)
        if env in environ:
            raw = environ[env]
            values[name] = _parse_env(name, env, raw)
            sources[name] = "env"
            if flag_value is not None:
                overrides.append(f"{env}={raw!r} overrides {flag} {flag_value!r}")
        elif flag_value is not None:
            values[name] = flag_value
            sources[name] = "flag"
        else:
            sources[name] = "default"
    try:
        settings = Settings(**values)
    except ValidationError as exc:
        err = exc.errors()[0]
        name = str(err["loc"][0])
        env, flag, _ = _SPEC[name]
        origin = env if sources.get(name) == "env" else flag
        raise SettingsError(f"{origin}: {err['msg']} (got {err.get('input')!r})") from None
    if settings.router_masks:
        raise SettingsError(ROUTER_MASKS_REFUSED)
    conflict = group_size_conflict(settings, sources) or cache_slots_conflict(settings, sources)
    if conflict:
        raise SettingsError(conflict)
    if settings.plan_file is None and require_plan:
        raise SettingsError("no plan: set REAP_PLAN_FILE or pass --reap-plan PATH")
    return Resolved(settings=settings, sources=sources, overrides=overrides)


def cache_slots_conflict(settings: Settings, sources: Mapping[str, str] | None = None) -> str | None:
    """Why --reap-cache-slots swaps cannot be combined with the other settings (None: it can). The
    split (memory_split.plan_swap_split) is the pinned form's, on the plan's pool."""
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


def _parse_env(name: str, env: str, raw: str) -> Any:
    """Environment strings -> the field's type (pydantic's lax parsing: 1/0, true/false, yes/no)."""
    if Settings.model_fields[name].annotation is bool and raw.strip() == "":
        return False
    if name in ("cache", "cache_slots", "exact_pinning"):  # aliases / "auto": the field validator parses it
        return raw.strip()
    try:
        return TypeAdapter(Settings.model_fields[name].annotation).validate_python(raw.strip())
    except ValidationError as exc:
        raise SettingsError(f"{env}={raw!r}: {exc.errors()[0]['msg']}") from None
