"""A model's MoE shape read from its Hugging Face ``config.json``.

A plan is only servable on the model it was measured on: the layer count, experts per layer and
the byte size of one expert must agree. This module reads those numbers from a config file, a
model folder or an already-parsed dict, across the naming schemes of the MoE families we serve:

- Qwen3-MoE / Qwen2-MoE: ``num_experts``, ``moe_intermediate_size``, ``num_experts_per_tok``,
  ``decoder_sparse_step``, ``mlp_only_layers``
- Mixtral: ``num_local_experts``, ``intermediate_size`` (every layer is MoE)
- Qwen3-Next / Qwen3.5: as Qwen3-MoE, but a multimodal wrapper may nest the language model's
  fields under ``text_config``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

# torch dtype names as they appear in config.json -> bytes per element.
DTYPE_BYTES = {
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "fp8": 1,
    "int8": 1,
    "uint8": 1,
}
DEFAULT_DTYPE = "bfloat16"


@dataclass(frozen=True)
class ModelShape:
    architecture: str
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    hidden_size: int
    moe_intermediate_size: int
    dtype_bytes: int

    @property
    def expert_bytes(self) -> int:
        """One expert is three matrices (gate, up: hidden x inter; down: inter x hidden)."""
        return 3 * self.hidden_size * self.moe_intermediate_size * self.dtype_bytes

    @property
    def layer_expert_bytes(self) -> int:
        """All experts of one MoE layer."""
        return self.expert_bytes * self.num_experts

    @property
    def total_expert_bytes(self) -> int:
        """All experts of the model."""
        return self.layer_expert_bytes * len(self.moe_layers)


class ModelShapeError(ValueError):
    """The config does not describe a mixture-of-experts model we know how to read."""


_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_index_from_name(layer_name: str) -> int | None:
    """'model.layers.3.mlp.experts' -> 3 (the decoder layer; the plan's layer_N)."""
    m = _LAYER_RE.search(layer_name)
    return int(m.group(1)) if m else None


def _load_config(source: str | os.PathLike | Mapping) -> Mapping[str, Any]:
    if isinstance(source, Mapping):
        return source
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    try:
        return orjson.loads(path.read_bytes())
    except FileNotFoundError as exc:
        raise ModelShapeError(f"{path}: no such config.json") from exc
    except orjson.JSONDecodeError as exc:
        raise ModelShapeError(f"{path}: not valid JSON ({exc})") from exc


def _first(config: Mapping[str, Any], *names: str) -> Any:
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return None


def _dtype_bytes(*configs: Mapping[str, Any]) -> int:
    for config in configs:
        name = _first(config, "torch_dtype", "dtype")
        if name is not None:
            name = str(name).removeprefix("torch.")
            if name not in DTYPE_BYTES:
                raise ModelShapeError(f"unknown dtype {name!r}; known: {sorted(DTYPE_BYTES)}")
            return DTYPE_BYTES[name]
    return DTYPE_BYTES[DEFAULT_DTYPE]


def read_model_shape(source: str | os.PathLike | Mapping) -> ModelShape:
    """Read a config.json file, a model folder holding one, or a config dict."""
    outer = _load_config(source)
    text = outer.get("text_config")
    config = text if isinstance(text, Mapping) else outer

    architectures = _first(outer, "architectures") or _first(config, "architectures") or []
    architecture = (
        architectures[0]
        if architectures
        else str(_first(config, "model_type") or _first(outer, "model_type") or "unknown")
    )

    num_experts = _first(config, "num_experts", "num_local_experts")
    if not num_experts:
        raise ModelShapeError(
            f"{architecture}: no num_experts / num_local_experts in config; not a MoE model"
        )
    num_layers = _first(config, "num_hidden_layers")
    hidden_size = _first(config, "hidden_size")
    top_k = _first(config, "num_experts_per_tok")
    # Mixtral names the expert width intermediate_size; Qwen MoE keeps that name for dense MLPs.
    moe_intermediate = _first(config, "moe_intermediate_size", "intermediate_size")
    missing = [
        name
        for name, value in [
            ("num_hidden_layers", num_layers),
            ("hidden_size", hidden_size),
            ("num_experts_per_tok", top_k),
            ("moe_intermediate_size", moe_intermediate),
        ]
        if value is None
    ]
    if missing:
        raise ModelShapeError(f"{architecture}: config lacks {', '.join(missing)}")

    # Qwen MoE: layer i is sparse when (i + 1) % decoder_sparse_step == 0 and not in mlp_only_layers.
    step = int(config.get("decoder_sparse_step") or 1)
    dense = set(config.get("mlp_only_layers") or [])
    moe_layers = tuple(i for i in range(int(num_layers)) if i not in dense and (i + 1) % step == 0)

    return ModelShape(
        architecture=architecture,
        num_layers=int(num_layers),
        moe_layers=moe_layers,
        num_experts=int(num_experts),
        top_k=int(top_k),
        hidden_size=int(hidden_size),
        moe_intermediate_size=int(moe_intermediate),
        dtype_bytes=_dtype_bytes(config, outer),
    )
