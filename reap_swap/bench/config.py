"""What one `reap-swap bench` invocation is asked to do: the arms, BenchConfig, its prompts."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

ARMS = ("resident", "stock-uva", "plan-static", "plan-swap", "plan-cache", "plan-swap+cache")
DEFAULT_ARMS = ARMS[:4]  # the cache arms are asked for by name (--arms ...,plan-cache,plan-swap+cache)
REAP_ARMS = ("plan-static", "plan-swap", "plan-cache", "plan-swap+cache")
BUDGET_ARMS = ("stock-uva", "plan-swap", "plan-cache", "plan-swap+cache")
# --reap-cache per reap arm: the cache arms use the default policy (lfu), the others keep their
# meaning from before the cache existed (the core only / per-request slices only)
CACHE_ARMS = {"plan-static": "off", "plan-swap": "off", "plan-cache": "lfu", "plan-swap+cache": "lfu"}
NO_CUDA = (
    "no CUDA device (vLLM {platform} build): {what} needs a GPU; the accounting arms still report "
    "router hit rates and greedy outputs"
)


class BenchConfig(BaseModel):
    """What one `reap-swap bench` invocation measures (validated before any server starts)."""

    model_config = ConfigDict(extra="forbid")
    model: str
    plan: Path
    prompts: Path
    out: Path
    arms: list[str] = Field(default_factory=lambda: list(DEFAULT_ARMS))
    budget_gib: list[float] | None = None
    batch: int = Field(default=4, ge=1)
    repeats: int = Field(default=3, ge=1)
    max_tokens: int = Field(default=32, ge=1)
    decode_tokens: int = Field(default=128, ge=2)
    max_prompts: int | None = Field(default=8, ge=1)
    prompt_chars: int = Field(default=2000, ge=1)
    strategy: str = "prior"
    refresh_every: int | None = Field(default=None, ge=1)
    timings: Literal["auto", "on", "off"] = "auto"
    startup_timeout_s: float = Field(default=900.0, gt=0)
    prefix_caching: bool = False
    measure_lock: Path | None = None  # bench_env.MeasureLock: benches side by side, one measuring
    # the cache arms on CUDA: --reap-cache-device on (without it the server's cache does not engage
    # on CUDA: engine/device_cache/serving.py); off keeps the server's default (accounting only)
    cache_device: Literal["on", "off"] = "on"
    progress: bool = True
    engine_args: list[str] = Field(default_factory=list)

    @field_validator("arms")
    @classmethod
    def _known_arms(cls, arms: list[str]) -> list[str]:
        unknown = [a for a in arms if a not in ARMS]
        if unknown or not arms:
            raise ValueError(f"unknown arm(s) {unknown}; known: {', '.join(ARMS)}")
        return list(dict.fromkeys(arms))

    @field_validator("budget_gib")
    @classmethod
    def _positive(cls, values: list[float] | None) -> list[float] | None:
        if values is not None and any(v <= 0 for v in values):
            raise ValueError("every --budget-gib must be > 0")
        return sorted(set(values)) if values else None

    @field_validator("strategy")
    @classmethod
    def _strategy(cls, name: str) -> str:
        from reap_swap.client.strategies import get_strategy

        get_strategy(name)
        return name


class BenchError(ValueError):
    """A bench that cannot run as asked (bad plan, budget, prompts); nothing was started."""


def load_prompts(path: Path, limit: int | None, chars: int) -> list[dict]:
    """Chat records as they are; prompt/text records become one user message (cut to ``chars``)."""
    from reap_swap.planner.corpus import read_corpus

    records, issues = read_corpus(path)
    if issues:
        raise BenchError(f"{path}: " + "; ".join(str(i) for i in issues[:5]))
    out = []
    for rec in records[:limit]:
        if rec.messages is not None:
            messages = rec.messages
        else:
            text = rec.text if len(rec.text) <= chars else rec.text[:chars]
            messages = [{"role": "user", "content": text}]
        preview = " ".join(str(messages[-1].get("content") or "").split())[:40]
        out.append(
            {"index": len(out), "line": rec.line, "tag": rec.tag, "messages": messages, "preview": preview}
        )
    if not out:
        raise BenchError(f"{path}: no prompts")
    return out


def flag_value(args: Sequence[str], name: str) -> str | None:
    """The value of ``--name X`` or ``--name=X`` in an argv list (the last one wins)."""
    value = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def has_flag(args: Sequence[str], *names: str) -> bool:
    return any(a == n or a.startswith(n + "=") for a in args for n in names)
