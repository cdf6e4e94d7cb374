"""A layer's quant config read as the shapes its per-expert tensors must have.

Why: binding a tensor to an expert is only safe if its rows really are that expert's; the check is
that each tensor's per-expert size is what the method's own quant config implies (block size,
group size, bits and packing), for every scheme alike rather than one path per scheme. Pure.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from reap_swap.sizing.unit_layout import round_up


@dataclass(frozen=True)
class QuantScheme:
    """What the shapes of a layer's tensors must be, read from the method's quant config."""

    kind: str  # unquantized / fp8 / int / mxfp4
    bits: int
    strategy: str  # none / tensor / channel / group / block
    group_size: int = 0
    block: tuple[int, int] | None = None
    zero_point: bool = True  # False: symmetric GPTQ, whose zero-point tensors the kernel never gets


def _ct_weights(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    groups = cfg.get("config_groups") or {}
    for group in groups.values():
        if group.get("weights"):
            return group["weights"]
    return {}


def scheme_from_config(cfg: Mapping[str, Any] | None) -> QuantScheme:
    """Normalise an HF `quantization_config` (fp8, awq, gptq, compressed-tensors, mxfp4, none)."""
    if not cfg:
        return QuantScheme("unquantized", 16, "none")
    method = str(cfg.get("quant_method", "")).lower()
    if method == "fp8":
        block = cfg.get("weight_block_size")
        if block:
            return QuantScheme("fp8", 8, "block", block=(int(block[0]), int(block[1])))
        return QuantScheme("fp8", 8, "tensor")
    if method in ("awq", "awq_marlin", "gptq", "gptq_marlin", "moe_wna16"):
        bits = int(cfg.get("bits", cfg.get("w_bit", 4)))
        group = int(cfg.get("group_size", cfg.get("q_group_size", 128)))
        # vLLM 0.26 auto_gptq.py:780-790 passes w13/w2_qzeros to the kernel only when not sym (CUDA)
        zp = not (method.startswith("gptq") and cfg.get("sym") is True)
        strategy = "group" if group > 0 else "channel"
        return QuantScheme("int", bits, strategy, group_size=max(group, 0), zero_point=zp)
    if method == "mxfp4":
        return QuantScheme("mxfp4", 4, "group", group_size=32)
    if method == "compressed-tensors":
        w = _ct_weights(cfg)
        strategy = str(w.get("strategy", "tensor")).lower()
        kind = "fp8" if str(w.get("type", "int")).lower() == "float" else "int"
        block = w.get("block_structure")
        return QuantScheme(
            kind,
            int(w.get("num_bits", 8)),
            strategy,
            group_size=int(w.get("group_size") or 0),
            block=(int(block[0]), int(block[1])) if block else None,
        )
    return QuantScheme("unknown", 0, "unknown")


# triton_kernels' Hopper MX scale swizzle pads rows to 2 * num_warps(8) * 2 * 8 and vLLM pads the
# scale groups to a multiple of 4 before it (mxfp4_utils.py _swizzle_mxfp4, hopper_scale.py)
HOPPER_SCALE_ROWS, HOPPER_SCALE_GROUPS = 256, 4
HOPPER_MX_SCALE = "hopper_mx_scale"  # the ParamSpec.layout tag of a scale with that padding


def expected_numels(
    role: str, outs: set[int], k_in: int, scheme: QuantScheme, layout: str = ""
) -> set[float] | None:
    """Per-expert element (or, for weights and zero points, byte) counts the config allows for a
    projection with out features `outs` (either allowed) and in features `k_in`; None: no check.
    `layout` HOPPER_MX_SCALE: a scale swizzled for Hopper, padded as that swizzle pads it."""
    if role == "scale" and layout == HOPPER_MX_SCALE and scheme.group_size:
        groups = round_up(math.ceil(k_in / scheme.group_size), HOPPER_SCALE_GROUPS)
        return {round_up(o, HOPPER_SCALE_ROWS) * groups for o in outs}
    if role == "weight":
        return {o * k_in * scheme.bits / 8 for o in outs}  # bytes
    if role == "scale":
        if scheme.strategy == "block" and scheme.block:
            bn, bk = scheme.block
            return {math.ceil(o / bn) * math.ceil(k_in / bk) for o in outs}
        if scheme.strategy == "group" and scheme.group_size:
            return {o * math.ceil(k_in / scheme.group_size) for o in outs}
        if scheme.strategy == "channel":
            return set(outs)
        if scheme.strategy == "tensor":
            return {1, 2}
        return None
    if role == "zero" and scheme.group_size:
        return {o * math.ceil(k_in / scheme.group_size) * scheme.bits / 8 for o in outs}  # bytes
    if role == "g_idx":
        return {0, k_in}
    if role == "bias":
        return set(outs)
    if role in ("input_scale", "shape"):
        return {1, 2}
    return None
