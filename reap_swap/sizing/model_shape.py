"""A model's MoE shape read from its Hugging Face ``config.json``.

A plan is only servable on the model it was measured on: the layer count, experts per layer and
the byte size of one expert must agree. This module reads those numbers from a config file, a
model folder or an already-parsed dict, across the naming schemes of the MoE families we serve
(each family's reader is in families.py):

- Qwen3-MoE / Qwen2-MoE: ``num_experts`` (``num_local_experts`` as transformers >= 5.19 saves
  Qwen3-MoE), ``moe_intermediate_size``, ``num_experts_per_tok``, ``decoder_sparse_step``,
  ``mlp_only_layers``
- Mixtral: ``num_local_experts``, ``intermediate_size`` (every layer is MoE)
- Qwen3-Next / Qwen3.5-MoE: as Qwen3-MoE, but a multimodal wrapper may nest the language model's
  fields under ``text_config``; Qwen3.5-MoE (``qwen3_5_moe_text``) puts routed experts in every
  layer (linear and full attention alike) beside one shared expert
  (``shared_expert_intermediate_size``)
- DeepSeek-V2 / V3, Moonlight, Kimi-K2: ``n_routed_experts``, ``moe_intermediate_size``,
  ``num_experts_per_tok``; layer i holds routed experts when ``i >= first_k_dense_replace`` and
  ``i % moe_layer_freq == 0`` (vLLM's rule); ``n_shared_experts`` shared experts of
  ``moe_intermediate_size`` each
- OLMoE: Qwen's names (``num_experts``) but no ``moe_intermediate_size``: ``intermediate_size``
  is the expert width, every layer is MoE (read as ``qwen``)
- GPT-OSS: ``num_local_experts``, ``experts_per_token`` (or ``num_experts_per_tok``),
  ``intermediate_size`` is the expert width, every layer is MoE, and each expert carries bias rows

One field may go by several names (``_ALIASES``): transformers' config classes alias them
(``attribute_map``) and which name a release writes changes, so a config is read by any of them,
and the family is told by ``model_type`` before the names (a Qwen3-MoE saved with
``num_local_experts`` is not Mixtral: its experts are ``moe_intermediate_size`` wide). A
transformers config object (``AutoConfig.from_pretrained(...)``) is read as its ``to_dict()``, with
its classes' ``attribute_map`` aliases besides.

Plan layers are the decoder layers that hold routed experts. Shared experts stay with vLLM (always
resident, never in a plan): their width is reported, not counted in the expert bytes.

Quantized checkpoints (``quantization_config``: fp8 block / tensor, compressed-tensors FP8 or
INT4, AWQ, GPTQ, MXFP4) count an expert as its weights are stored after vLLM loads them (FP8 one
byte, INT4 / MXFP4 half a byte per weight: ``quant_padding.expert_format``); the scales, zero
points and biases the engine keeps whole in HBM are ``expert_kept_bytes``, outside the plan's unit.
A method with no byte model is refused by name.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from reap_swap.sizing.families import family_reader, first_of
from reap_swap.sizing.quant.padding import ExpertFormat, expert_format
from reap_swap.sizing.quant.scheme import QuantScheme, scheme_from_config

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
    family: str = "qwen"
    # GPT-OSS experts carry a gate/up bias row (2 x inter) and a down bias row (hidden).
    expert_bias: bool = False
    # Width of the always-resident shared expert(s) of one MoE layer; 0 when the family has none.
    shared_expert_intermediate_size: int = 0
    # the checkpoint's quantization_config read as shapes (quant_scheme); unquantized by default
    quant: QuantScheme = QuantScheme("unquantized", 16, "none")
    quant_method: str = ""  # the HF quant_method, "" for an unquantized checkpoint

    @property
    def expert_format(self) -> ExpertFormat:
        """One expert's bytes in the stored format: re-homed w13 / w2 and the kept-whole rest."""
        return expert_format(
            self.quant, self.hidden_size, self.moe_intermediate_size, self.dtype_bytes, self.expert_bias
        )

    @property
    def expert_bytes(self) -> int:
        """One expert's weights: gate, up (hidden x inter) and down (inter x hidden), as stored.

        This is the unit a plan budgets (``per_expert_bytes``): 3 x hidden x inter x dtype bytes
        unquantized, x 1 for FP8, x 1/2 for INT4 and MXFP4. Bias rows, scales and zero points are
        not in it: they are ``expert_kept_bytes``, small, and kept whole in HBM beside the layer.
        """
        return self.expert_format.ideal

    @property
    def expert_kept_bytes(self) -> int:
        """One expert's scales, zero points and bias rows (kept whole in HBM); 0 for bf16 experts."""
        return self.expert_format.kept

    @property
    def expert_bias_bytes(self) -> int:
        """One expert's bias rows (gate/up 2 x inter, down hidden); 0 for bias-free experts."""
        if not self.expert_bias:
            return 0
        return (2 * self.moe_intermediate_size + self.hidden_size) * self.dtype_bytes

    @property
    def layer_expert_bytes(self) -> int:
        """All experts of one MoE layer (weights only)."""
        return self.expert_bytes * self.num_experts

    @property
    def total_expert_bytes(self) -> int:
        """All routed experts of the model (weights only)."""
        return self.layer_expert_bytes * len(self.moe_layers)


class ModelShapeError(ValueError):
    """The config does not describe a mixture-of-experts model we know how to read."""


_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_index_from_name(layer_name: str) -> int | None:
    """'model.layers.3.mlp.experts' -> 3 (the decoder layer; the plan's layer_N)."""
    m = _LAYER_RE.search(layer_name)
    return int(m.group(1)) if m else None


# Every name one field goes by in the families' configs. transformers' attribute_map aliases
# num_experts -> num_local_experts (Qwen3-MoE, Qwen3-VL-MoE, Mixtral, GPT-OSS), num_experts ->
# n_routed_experts (DeepSeek-V2), num_local_experts -> n_routed_experts (DeepSeek-V3), and saves
# the class's own name: transformers 5.19 writes Qwen3-MoE's expert count as num_local_experts,
# earlier releases as num_experts. tests/test_model_shape_aliases.py checks the installed classes.
_ALIASES: tuple[tuple[str, ...], ...] = (
    ("num_experts", "num_local_experts", "n_routed_experts"),
    ("num_experts_per_tok", "experts_per_token"),
)

# A transformers config object: its to_dict() and the attribute_map pairs of its class and of its
# text config's class (pure core: transformers itself is not imported here).
_AliasPairs = tuple[tuple[str, str], ...]


def _attribute_map(config: Any) -> _AliasPairs:
    pairs = getattr(type(config), "attribute_map", None) or {}
    return tuple((str(alias), str(name)) for alias, name in pairs.items() if alias != name)


def _is_transformers_config(source: Any) -> bool:
    return not isinstance(source, Mapping) and callable(getattr(source, "to_dict", None))


def _load_config(source: Any) -> tuple[Mapping[str, Any], _AliasPairs, _AliasPairs]:
    """(config dict, outer attribute_map pairs, text config attribute_map pairs)."""
    if isinstance(source, Mapping):
        return source, (), ()
    if _is_transformers_config(source):
        text = getattr(source, "text_config", None)
        return source.to_dict(), _attribute_map(source), _attribute_map(text) if text is not None else ()
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    try:
        return orjson.loads(path.read_bytes()), (), ()
    except FileNotFoundError as exc:
        raise ModelShapeError(f"{path}: no such config.json") from exc
    except orjson.JSONDecodeError as exc:
        raise ModelShapeError(f"{path}: not valid JSON ({exc})") from exc


def _resolve_aliases(config: Mapping[str, Any], pairs: _AliasPairs, architecture: str) -> dict[str, Any]:
    """``config`` with every name of a field set when any one is: the value under all of its
    names (``_ALIASES`` and ``pairs``). Two names with different values are refused: which one
    vLLM serves depends on the transformers release."""
    out = dict(config)
    for group in (*_ALIASES, *pairs):
        named = [(name, out[name]) for name in group if out.get(name) is not None]
        if not named:
            continue
        if len({orjson.dumps(value) for _, value in named}) > 1:
            both = ", ".join(f"{name} {value!r}" for name, value in named)
            raise ModelShapeError(f"{architecture}: config names one field with different values: {both}")
        for name in group:
            if out.get(name) is None:
                out[name] = named[0][1]
    return out


def _dtype_bytes(*configs: Mapping[str, Any]) -> int:
    for config in configs:
        name = first_of(config, "torch_dtype", "dtype")
        if name is not None:
            name = str(name).removeprefix("torch.")
            if name not in DTYPE_BYTES:
                raise ModelShapeError(f"unknown dtype {name!r}; known: {sorted(DTYPE_BYTES)}")
            return DTYPE_BYTES[name]
    return DTYPE_BYTES[DEFAULT_DTYPE]


def _architecture(outer: Mapping[str, Any], config: Mapping[str, Any]) -> str:
    architectures = first_of(outer, "architectures") or first_of(config, "architectures") or []
    if architectures:
        return architectures[0]
    return str(first_of(config, "model_type") or first_of(outer, "model_type") or "unknown")


def quantization_config(*configs: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The first ``quantization_config`` of the given configs (text config, then the wrapper)."""
    for config in configs:
        quant = config.get("quantization_config")
        if isinstance(quant, Mapping):
            return quant
    return None


def _quant_scheme(architecture: str, quant: Mapping[str, Any] | None) -> tuple[QuantScheme, str]:
    scheme = scheme_from_config(quant)
    method = str((quant or {}).get("quant_method", "")).lower()
    bad_int = scheme.kind == "int" and scheme.bits not in (4, 8)
    if scheme.kind == "unknown" or bad_int or scheme.strategy == "unknown":
        raise ModelShapeError(
            f"{architecture}: quantization_config.quant_method {method!r} ({scheme.kind}, "
            f"{scheme.bits} bits, {scheme.strategy}) has no expert byte model; known: fp8, "
            "compressed-tensors (fp8 / int4 / int8), awq, gptq, moe_wna16, mxfp4"
        )
    return scheme, method


def read_model_shape(source: str | os.PathLike | Mapping | Any) -> ModelShape:
    """Read a config.json file, a model folder holding one, a config dict, or a transformers
    config object (``PretrainedConfig``)."""
    outer, outer_pairs, text_pairs = _load_config(source)
    text = outer.get("text_config")
    raw = text if isinstance(text, Mapping) else outer
    architecture = _architecture(outer, raw)
    config = _resolve_aliases(raw, text_pairs if raw is text else outer_pairs, architecture)
    reader = family_reader(raw, config)
    if reader is None:
        raise ModelShapeError(
            f"{architecture}: no num_experts / num_local_experts / n_routed_experts in config; "
            "not a MoE model"
        )
    scheme, method = _quant_scheme(architecture, quantization_config(config, outer))
    num_layers = first_of(config, "num_hidden_layers")
    fields = reader(config, int(num_layers or 0))
    hidden_size = first_of(config, "hidden_size")
    missing = [
        name
        for name, value in [
            ("num_hidden_layers", num_layers),
            ("hidden_size", hidden_size),
            ("num_experts_per_tok", fields.top_k),
            (fields.width_name, fields.moe_intermediate),
        ]
        if value is None
    ]
    if missing:
        raise ModelShapeError(f"{architecture}: config lacks {', '.join(missing)}")
    return ModelShape(
        architecture=architecture,
        num_layers=int(num_layers),
        moe_layers=fields.moe_layers,
        num_experts=int(fields.num_experts),
        top_k=int(fields.top_k),
        hidden_size=int(hidden_size),
        moe_intermediate_size=int(fields.moe_intermediate),
        dtype_bytes=_dtype_bytes(config, outer),
        family=fields.family,
        expert_bias=fields.expert_bias,
        shared_expert_intermediate_size=fields.shared_intermediate,
        quant=scheme,
        quant_method=method,
    )
