"""The MoE families' config readers: where each family keeps its routed experts and how wide they
are. The families name the same facts differently (DeepSeek's dense first layers and
``moe_layer_freq``, Qwen's ``decoder_sparse_step`` and ``mlp_only_layers``, GPT-OSS's bias rows,
Mixtral's and OLMoE's ``intermediate_size`` as the expert width), so each reader turns a config
whose field aliases are already resolved into one FamilyFields, and family_reader picks the
reader by ``model_type`` or, failing that, by the names only one family writes; model_shape.py
reads the file, resolves the aliases and builds the ModelShape from these fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def first_of(config: Mapping[str, Any], *names: str) -> Any:
    """The value of the first of ``names`` that ``config`` sets (not None), else None."""
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return None


@dataclass(frozen=True)
class FamilyFields:
    """What each family names differently: where its experts live and how wide they are."""

    family: str
    num_experts: Any
    top_k: Any
    moe_intermediate: Any
    moe_layers: tuple[int, ...]
    expert_bias: bool = False
    shared_intermediate: int = 0
    width_name: str = "moe_intermediate_size"


def _deepseek(config: Mapping[str, Any], num_layers: int) -> FamilyFields:
    """DeepSeek-V2/V3, Moonlight, Kimi-K2: dense first layers, then MoE every moe_layer_freq."""
    first_dense = int(config.get("first_k_dense_replace") or 0)
    freq = int(config.get("moe_layer_freq") or 1)
    width = first_of(config, "moe_intermediate_size")
    shared = int(config.get("n_shared_experts") or 0) * int(width or 0)
    return FamilyFields(
        family="deepseek",
        num_experts=config.get("n_routed_experts"),
        top_k=config.get("num_experts_per_tok"),
        moe_intermediate=width,
        moe_layers=tuple(i for i in range(num_layers) if i >= first_dense and i % freq == 0),
        shared_intermediate=shared,
    )


def _gpt_oss(config: Mapping[str, Any], num_layers: int) -> FamilyFields:
    """GPT-OSS: every layer MoE, experts as wide as intermediate_size, with bias rows."""
    return FamilyFields(
        family="gpt_oss",
        num_experts=config.get("num_local_experts"),
        top_k=config.get("num_experts_per_tok"),
        moe_intermediate=first_of(config, "intermediate_size"),
        moe_layers=tuple(range(num_layers)),
        expert_bias=True,
        width_name="intermediate_size",
    )


def _mixtral(config: Mapping[str, Any], num_layers: int) -> FamilyFields:
    """Mixtral: every layer MoE; intermediate_size is the expert width."""
    return FamilyFields(
        family="mixtral",
        num_experts=config.get("num_local_experts"),
        top_k=config.get("num_experts_per_tok"),
        moe_intermediate=first_of(config, "intermediate_size"),
        moe_layers=tuple(range(num_layers)),
        width_name="intermediate_size",
    )


def _qwen(config: Mapping[str, Any], num_layers: int) -> FamilyFields:
    """Qwen2/3-MoE, Qwen3-Next, Qwen3.5-MoE: num_experts, optional sparse step and dense layers."""
    if config.get("model_type") == "qwen3_5_moe_text":
        moe_layers = tuple(range(num_layers))  # vLLM builds a sparse block in every Qwen3.5-MoE layer
    else:
        # layer i is sparse when (i + 1) % decoder_sparse_step == 0 and not in mlp_only_layers
        step = int(config.get("decoder_sparse_step") or 1)
        dense = set(config.get("mlp_only_layers") or [])
        moe_layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    # A Qwen model's intermediate_size is its dense MLP's width, never an expert's: one
    # without moe_intermediate_size is refused (transformers would use its class default). Configs
    # with Qwen's names and no moe_ width (OLMoE) have experts intermediate_size wide.
    qwen_type = str(config.get("model_type") or "").startswith("qwen")
    widths = ("moe_intermediate_size",) if qwen_type else ("moe_intermediate_size", "intermediate_size")
    return FamilyFields(
        family="qwen",
        num_experts=config.get("num_experts"),
        top_k=config.get("num_experts_per_tok"),
        moe_intermediate=first_of(config, *widths),
        moe_layers=moe_layers,
        shared_intermediate=int(config.get("shared_expert_intermediate_size") or 0),
    )


_FAMILY_BY_MODEL_TYPE = {
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
    "kimi_k2": _deepseek,
    "gpt_oss": _gpt_oss,
    "mixtral": _mixtral,
    "olmoe": _qwen,
}


def family_reader(raw: Mapping[str, Any], config: Mapping[str, Any]):
    """The family of a MoE config (``raw`` as written, ``config`` with its aliases resolved): by
    model_type, else by the names only one family writes. Experts as wide as intermediate_size
    (Mixtral) only when the config has no moe_intermediate_size."""
    if config.get("num_experts") is None:
        return None
    model_type = str(raw.get("model_type") or "")
    reader = _FAMILY_BY_MODEL_TYPE.get(model_type)
    if reader is not None:
        return reader
    if model_type.startswith("qwen"):  # qwen2_moe, qwen3_moe, qwen3_next, qwen3_5_moe_text, ...
        return _qwen
    if raw.get("n_routed_experts") is not None:
        return _deepseek
    if raw.get("experts_per_token") is not None:
        return _gpt_oss
    if raw.get("moe_intermediate_size") is not None or raw.get("num_experts") is not None:
        return _qwen
    return _mixtral
