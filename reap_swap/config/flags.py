"""The --reap-* flags and REAP_* environment variables -> one validated Settings (settings.py).

Precedence is environment, then flag, then default (deployments set the environment; a flag
baked into a launch script must not silently win over it). An unknown REAP_* variable is an
error listing the known names: a typo must not start a server that silently ignores it. A retired
setting (`RETIRED`: flag or variable -> why) is accepted and ignored with a logged warning, so a
launch script that still passes it keeps working; a retired flag never reaches vLLM. The
`--help` text is built from `_SPEC`, the one table of names.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter, ValidationError

from reap_swap.config.settings import Settings, SettingsError, field_info, flat_name

log = logging.getLogger("reap_swap.config.flags")

# flat setting name (settings.FIELDS) -> (environment variable, flag, argparse kwargs); each flag's
# help is its field's docstring (settings.field_info)
_SPEC: dict[str, tuple[str, str, dict]] = {
    "plan_file": ("REAP_PLAN_FILE", "--reap-plan", {"metavar": "PATH"}),
    "validate_only": (
        "REAP_SWAP_VALIDATE_ONLY",
        "--reap-validate-only",
        {"action": "store_const", "const": True},
    ),
    "masks_only": (
        "REAP_SWAP_MASKS_ONLY",
        "--reap-masks-only",
        {"action": "store_const", "const": True},
    ),
    "router_masks": (
        "REAP_ENABLE_ROUTER_MASKS",
        "--reap-enable-router-masks",
        {"action": "store_const", "const": True},
    ),
    "max_loaded_cartridges": (
        "REAP_MAX_LOADED_CARTRIDGES",
        "--reap-max-loaded-cartridges",
        {"type": int, "metavar": "N"},
    ),
    "coactivation": (
        "REAP_COACTIVATION",
        "--reap-coactivation",
        {"action": "store_const", "const": True},
    ),
    "residency": (
        "REAP_RESIDENCY",
        "--reap-residency",
        {"choices": ["auto", "accounting", "cuda"]},
    ),
    "budget": (
        "REAP_BUDGET",
        "--reap-budget",
        {"metavar": "auto|plan|GIB"},
    ),
    "kv_tokens": (
        "REAP_KV_TOKENS",
        "--reap-kv-tokens",
        {"type": int, "metavar": "N"},
    ),
    "cache": (
        "REAP_CACHE",
        "--reap-cache",
        {"choices": ["on", "off", "lfu", "lru"]},
    ),
    "cache_slots": (
        "REAP_CACHE_SLOTS",
        "--reap-cache-slots",
        {"metavar": "N|auto|swaps"},
    ),
    "cache_device": (
        "REAP_CACHE_DEVICE",
        "--reap-cache-device",
        {"choices": ["auto", "on", "off"]},
    ),
    "cache_seed": (
        "REAP_CACHE_SEED",
        "--reap-cache-seed",
        {"choices": ["auto", "pinned", "seeded"]},
    ),
    "cache_record_steps": (
        "REAP_CACHE_RECORD_STEPS",
        "--reap-cache-record-steps",
        {"type": int, "metavar": "N"},
    ),
    "cache_shadow": (
        "REAP_CACHE_SHADOW",
        "--reap-cache-shadow",
        {"choices": ["off", "out", "bytes"]},
    ),
    "group_size": (
        "REAP_GROUP_SIZE",
        "--reap-group-size",
        {"choices": ["auto", "1", "2", "4", "8"]},
    ),
    "exact_pinning": (
        "REAP_SWAP_EXACT_PINNING",
        "--reap-exact-pinning",
        {"action": "store_const", "const": True},
    ),
    "swap_publish": (
        "REAP_SWAP_PUBLISH",
        "--reap-swap-publish",
        {"metavar": "ahead|idle|end|N"},
    ),
}
ENV_NAMES: tuple[str, ...] = tuple(spec[0] for spec in _SPEC.values())


def help_for(name: str) -> str:
    """One line of help for flat setting ``name``: its field's docstring."""
    return " ".join((field_info(name).description or "").split())


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


# Settings the defaults make unnecessary: still accepted (scripts, measurements), described in
# docs/settings.md and left out of --help.
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
        rows.append(f"{head}\n      {help_for(name)} [{env}]")
    return (
        f"usage: {prog} MODEL [vllm serve arguments] [--reap-* flags]\n\n"
        "Every `vllm serve` argument works as it does there (listed below). REAP settings, each also an "
        "environment variable (the environment wins over the flag):\n"
        + "\n".join(rows)
        + "\nDebug settings for measurements (the defaults make them unnecessary): docs/settings.md\n"
    )


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add the --reap-* flags (default None, so 'not given' is distinguishable)."""
    for name, (_env, flag, kwargs) in _SPEC.items():
        parser.add_argument(flag, dest=name, default=None, help=help_for(name), **kwargs)


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
) -> Resolved:
    """Merge environment > flags > defaults into a validated Settings (a plan is optional: the
    launcher makes a bare one without it, plan/bare.py)."""
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
        settings = Settings.model_validate(values, context={"sources": sources})
    except ValidationError as exc:
        err = exc.errors()[0]
        if not err["loc"]:  # a rule across settings (Settings._conflicts): its message names them
            raise SettingsError(str(err["msg"]).removeprefix("Value error, ")) from None
        name = flat_name(tuple(err["loc"]))
        env, flag, _ = _SPEC[name]
        origin = env if sources.get(name) == "env" else flag
        raise SettingsError(f"{origin}: {err['msg']} (got {err.get('input')!r})") from None
    return Resolved(settings=settings, sources=sources, overrides=overrides)


def _parse_env(name: str, env: str, raw: str) -> Any:
    """Environment strings -> the field's type (pydantic's lax parsing: 1/0, true/false, yes/no)."""
    annotation = field_info(name).annotation
    if annotation is bool and raw.strip() == "":
        return False
    if name in ("cache", "cache_slots", "exact_pinning"):  # aliases / "auto": the field validator parses it
        return raw.strip()
    try:
        return TypeAdapter(annotation).validate_python(raw.strip())
    except ValidationError as exc:
        raise SettingsError(f"{env}={raw!r}: {exc.errors()[0]['msg']}") from None
