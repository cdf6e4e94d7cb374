"""REAP settings: one validated model with nested groups (residency, cache, budget), built once by
the launcher and passed down, like vLLM's own config objects.

Each field's help is its docstring (the `--help` text is built from it);
every rule that spans fields is in ``Settings._conflicts``, the one validator. A setting has one
flat name (``cache_slots``), which is its flag's and variable's name (``--reap-cache-slots``,
``REAP_CACHE_SLOTS``; ``FIELDS`` maps it to ``cache.slots``); the model also accepts flat names as
input, so a flag namespace or an environment reads straight in.

Every setting, its variable, flag, default and meaning: docs/settings.md. How flags and variables
become a Settings (precedence, unknown and retired names, `--help`): config/flags.py.

Settings reach the engine processes inside vLLM's `--additional-config` JSON under the key
"reap_swap" (vllm_config.additional_config), which every worker and API process receives; the
workers do not read REAP_* themselves (each worker process parses it once, into its worker
runtime: reap_swap.engine.runtime).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from reap_swap.sizing.memory_split import parse_budget

ADDITIONAL_CONFIG_KEY = "reap_swap"
CPU_REASON = (
    "vLLM's CPU build keeps every expert in host memory and its fused-MoE kernel "
    "ignores expert_map, so experts cannot move between memories"
)


class SettingsError(ValueError):
    """A setting that cannot be used; the message says which variable or flag and why."""


class _Group(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class ResidencySettings(_Group):
    """Where expert bytes live and how a swap moves them."""

    backend: Literal["auto", "accounting", "cuda"] = "auto"
    """residency backend: cuda moves expert bytes (the default on CUDA); accounting records the resident set only"""
    masks_only: bool = False
    """swaps change the active set only; no expert weights move"""
    group_size: Literal["auto", "1", "2", "4", "8"] = "1"
    """experts per mapping unit (CUDA; default 1 = private units, except INT4 models, whose kernels read
    contiguous experts: served in groups as with auto)"""
    exact_pinning: Literal["auto"] | bool = "auto"
    """pin vLLM's UVA expert copies at their exact size (cudaHostRegister) instead of PyTorch's power-of-two
    blocks; default auto: on where the rounded copies plus a layer in flight would hold more than 1.2x the
    expert bytes; REAP_SWAP_EXACT_PINNING=0 turns it off"""
    swap_publish: Literal["ahead", "idle", "end"] | int = "ahead"
    """CUDA swaps: when remapped units are made accessible (default ahead: every remap and one publish while
    the copies are in flight; idle: publish while waiting on a copy; end: after the last copy; N: every N
    landed copies)"""

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


class CacheSettings(_Group):
    """The per-layer expert cache: on the device where it is served (CUDA), else in accounting mode."""

    policy: Literal["lfu", "lru", "off"] = "lfu"
    """the per-layer expert cache (default on = lfu; on CUDA it runs on the device where served, else in
    accounting mode; lru: accounting only)"""
    slots: Literal["auto", "swaps"] | int = "auto"
    """cache slots beyond the pinned set over all layers (auto; swaps: leave per-request swaps room); the
    launcher turns swaps into a count, workers never see it"""
    device: Literal["auto", "on", "off"] = "auto"
    """the device expert cache (default auto: on wherever it is served on CUDA; on: also modelled by
    accounting residency); the launcher resolves auto, workers see on or off"""
    seed: Literal["auto", "pinned", "seeded"] = "auto"
    """device cache form: the plan core seeded into each layer's slots, evictable, swaps pinned inside them
    (seeded; auto's choice) or pinned beside a cache tail (pinned)"""
    record_steps: int = Field(default=0, ge=0)
    """keep the last N steps' routing for /reap/cache/trace"""
    shadow: Literal["off", "out", "bytes"] = "off"
    """debug: compare every cached MoE step with the uncached kernel (default off)"""

    @field_validator("policy", mode="before")
    @classmethod
    def _policy(cls, v: Any) -> Any:
        return "lfu" if str(v).strip().lower() == "on" else v  # on: the default policy

    @field_validator("slots", mode="before")
    @classmethod
    def _slots(cls, v: Any) -> Any:
        text = str(v).strip().lower()
        if text in ("auto", "swaps"):
            return text
        if isinstance(v, bool) or not text.isdigit():
            raise ValueError("expected auto, swaps or an integer >= 0 (cache slots beyond the pinned set)")
        return int(text)


class BudgetSettings(_Group):
    """How much HBM the expert pool gets."""

    pool: str = "plan"
    """HBM expert pool size: plan (the plan's budget, the default), auto (what the card holds beside the
    KV target) or GiB"""
    kv_tokens: int | None = Field(default=None, ge=1)
    """KV target (tokens) kept for --reap-budget auto/GiB"""

    @field_validator("pool", mode="before")
    @classmethod
    def _pool(cls, value: Any) -> str:
        return str(parse_budget(value))

    def request(self) -> str | float:
        """'plan' | 'auto' | GiB (float): memory_split.parse_budget of the setting."""
        return parse_budget(self.pool)


# flat setting name (its flag --reap-NAME and variable, config/flags.py) -> (group, field); None: top level
FIELDS: dict[str, tuple[str | None, str]] = {
    "plan_file": (None, "plan_file"),
    "validate_only": (None, "validate_only"),
    "masks_only": ("residency", "masks_only"),
    "router_masks": (None, "router_masks"),
    "max_loaded_cartridges": (None, "max_loaded_cartridges"),
    "coactivation": (None, "coactivation"),
    "residency": ("residency", "backend"),
    "budget": ("budget", "pool"),
    "kv_tokens": ("budget", "kv_tokens"),
    "cache": ("cache", "policy"),
    "cache_slots": ("cache", "slots"),
    "cache_device": ("cache", "device"),
    "cache_seed": ("cache", "seed"),
    "cache_record_steps": ("cache", "record_steps"),
    "cache_shadow": ("cache", "shadow"),
    "group_size": ("residency", "group_size"),
    "exact_pinning": ("residency", "exact_pinning"),
    "swap_publish": ("residency", "swap_publish"),
}
GROUPS = {"residency": ResidencySettings, "cache": CacheSettings, "budget": BudgetSettings}


def field_info(name: str):
    """The pydantic FieldInfo of flat setting ``name`` (its annotation, default, docstring help)."""
    group, attr = FIELDS[name]
    return (GROUPS[group] if group else Settings).model_fields[attr]


_BY_LOCATION = {(group, attr) if group else (attr,): name for name, (group, attr) in FIELDS.items()}


def flat_name(loc: tuple) -> str:
    """The flat setting name of a validation error's location (("cache", "slots") -> cache_slots)."""
    return _BY_LOCATION.get(tuple(loc[:2])) or _BY_LOCATION.get(tuple(loc[:1])) or str(loc[0] if loc else "")


def _origin(info: ValidationInfo, name: str, env: str, flag: str) -> str:
    """The variable or flag of setting ``name`` that a conflict message names: where it came from."""
    return env if (info.context or {}).get("sources", {}).get(name) == "env" else flag


class Settings(BaseModel):
    """Every REAP setting of one server, validated once."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    plan_file: Path | None = None
    """the REAP plan JSON; without one, no core and no slices: the device cache learns each layer's
    experts from the routing"""
    validate_only: bool = False
    """validate swap payloads, change nothing"""
    router_masks: bool = False
    """not implemented (destroys output quality); refused"""
    max_loaded_cartridges: int = Field(default=8, ge=1)
    """loaded cartridges kept (LRU)"""
    coactivation: bool = False
    """count expert co-activation (E*E per layer)"""
    residency: ResidencySettings = Field(default_factory=ResidencySettings)
    cache: CacheSettings = Field(default_factory=CacheSettings)
    budget: BudgetSettings = Field(default_factory=BudgetSettings)

    @model_validator(mode="before")
    @classmethod
    def _nest(cls, data: Any) -> Any:
        """Flat setting names (a flag namespace, the environment) -> their groups."""
        if not isinstance(data, Mapping):
            return data

        # "cache", "budget", "residency" name a group (a mapping) and a flat setting (a value)
        def is_group(key: str, value: Any) -> bool:
            return key in GROUPS and isinstance(value, Mapping | BaseModel)

        out: dict[str, Any] = {}
        for key, value in data.items():  # the groups first (copied), then flat names on top of them
            if is_group(key, value):
                out[key] = value.model_dump() if isinstance(value, BaseModel) else dict(value)
            elif FIELDS.get(key, (None, key))[0] is None:
                out[key] = value
        for key, value in data.items():
            group, attr = FIELDS.get(key, (None, key))
            if group is not None and not is_group(key, value):
                out.setdefault(group, {})[attr] = value
        return out

    @model_validator(mode="after")
    def _conflicts(self, info: ValidationInfo) -> Settings:
        """Every rule that spans settings, in one place (each message names the flag or variable)."""
        if self.router_masks:
            raise ValueError(ROUTER_MASKS_REFUSED)
        res, cache, pool = self.residency, self.cache, self.budget.pool
        if res.group_size != "1":
            origin = _origin(info, "group_size", "REAP_GROUP_SIZE", "--reap-group-size")
            if cache.device == "on":
                raise ValueError(
                    f"{origin} {res.group_size} with --reap-cache-device on: the device cache maps expert "
                    "ids to its own slots and knows no groups; use one of them"
                )
            if pool != "plan":
                raise ValueError(
                    f"{origin} {res.group_size} with --reap-budget {pool}: the pool growth "
                    "(engine/residency/budget.py) adds private expert slots, not groups; use --reap-budget plan"
                )
        if cache.slots == "swaps":
            origin = _origin(info, "cache_slots", "REAP_CACHE_SLOTS", "--reap-cache-slots")
            if cache.policy == "off":
                raise ValueError(f"{origin} swaps with --reap-cache off: there is no cache tail to size")
            if cache.seed == "seeded":  # auto resolves to pinned beside swaps (cache_form)
                raise ValueError(
                    f"{origin} swaps with --reap-cache-seed seeded: that form pins a swap inside the layer's "
                    "cache slots, so it needs no room beside them; use auto or N"
                )
            if pool != "plan":
                raise ValueError(
                    f"{origin} swaps with --reap-budget {pool}: the split is computed on the plan's pool "
                    "before the engine starts; use --reap-budget plan or give N"
                )
        return self

    def updated(self, **flat: Any) -> Settings:
        """A copy with settings replaced by flat name (``updated(cache_device="on")``), validated again."""
        data = self.model_dump()
        for name, value in flat.items():
            group, attr = FIELDS[name]
            (data[group] if group else data)[attr] = value
        return Settings.model_validate(data)

    def flat(self) -> dict[str, Any]:
        """Every setting by flat name."""
        return {
            name: getattr(getattr(self, group), attr) if group else getattr(self, attr)
            for name, (group, attr) in FIELDS.items()
        }

    def log_line(self) -> str:
        return "reap-swap settings: " + ", ".join(f"{k}={v}" for k, v in self.flat().items())

    def to_worker_config(self, **extra: Any) -> dict:
        """JSON-able dict for vllm's additional_config["reap_swap"] (plus e.g. plan identity)."""
        return {**self.model_dump(mode="json"), **extra}

    @classmethod
    def from_worker_config(cls, cfg: Mapping[str, Any]) -> Settings:
        keys = set(cls.model_fields) | set(FIELDS)
        settings = cls.model_validate({k: v for k, v in cfg.items() if k in keys})
        if settings.cache.slots == "swaps":  # needs the plan and the model's top_k: the launcher's
            raise ValueError(
                "cache_slots 'swaps' reached a worker unresolved: start the server with "
                "`python -m reap_swap.server`, which turns --reap-cache-slots swaps into a slot count"
            )
        return settings

    def accounting_reason(self, platform: str) -> str | None:
        """Why swaps on `platform` only record the resident set (accounting), or None when the
        CUDA residency engine moves the bytes. The one place launcher, model build and worker
        decide it (REAP_RESIDENCY=cuda on another platform is the worker's error to raise)."""
        if self.residency.masks_only:
            return "REAP_SWAP_MASKS_ONLY: swaps change the active set, weights stay put"
        if self.residency.backend == "accounting":
            return "REAP_RESIDENCY=accounting"
        if platform != "cuda":
            return CPU_REASON if platform == "cpu" else f"no residency engine for platform {platform!r}"
        return None


def cache_form(settings: Settings, platform: str, parallel: int = 1) -> tuple[Settings, str]:
    """``auto`` cache device / seed -> on|off and pinned|seeded, with the one sentence the
    launcher logs. The device cache is the serving path on CUDA wherever it is served: the device
    implements lfu, at one GPU per model (tensor or pipeline parallelism: not yet), on private
    expert units (no --reap-group-size) and on the plan's pool (--reap-budget plan). There it runs
    seeded (each layer's share of the pool is cache slots seeded with the plan core, a swap pinned
    inside them): it matched or beat the pinned form in every simulation of committed and real
    (OLMoE) traces and needs no room kept for swaps. Elsewhere the path is what it was: CPU
    accounting, or the plan's static set on CUDA. Explicit on / off / pinned / seeded are kept."""
    cache = settings.cache
    device, seed = cache.device, cache.seed
    why = ""
    if device == "auto":
        blocker = None
        if cache.policy == "off":
            blocker = "--reap-cache off"
        elif settings.accounting_reason(platform) is not None:
            blocker = f"accounting residency ({settings.accounting_reason(platform)})"
        elif cache.policy != "lfu":
            blocker = f"--reap-cache {cache.policy}: the device cache implements lfu only"
        elif parallel > 1:
            blocker = "tensor/pipeline parallelism: the device cache is served on one GPU per model only"
        elif settings.residency.group_size != "1":
            blocker = f"--reap-group-size {settings.residency.group_size}: the device cache knows no groups"
        elif settings.budget.pool != "plan":
            blocker = f"--reap-budget {settings.budget.pool}: the device cache runs on the plan's pool"
        device = "off" if blocker else "on"
        why = f"device cache off: {blocker}" if blocker else "device cache on (the default on CUDA)"
    if seed == "auto":
        seed = "seeded" if device == "on" and cache.slots != "swaps" else "pinned"
        if device == "on":
            why += f", {seed} form"
    return settings.updated(cache_device=device, cache_seed=seed), why


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
