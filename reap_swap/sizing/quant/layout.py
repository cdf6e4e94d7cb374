"""Which of a quantized MoE layer's tensors move with their expert, which stay whole in HBM, and
which the residency engine cannot bind -- decided from shapes and the method's quant config alone.

Why: the engine re-homes a layer's expert tensors into a CUDA virtual range whose per-expert
pieces are backed by pinned host memory or an HBM slot, and the unchanged kernel reads expert e at
`base + e * stride`. Expert ids are never remapped, so any per-expert tensor that is *not* re-homed
(scales, zero points, g_idx, biases) can stay whole in HBM: row e of `w13_weight_scale_inv` still
belongs to expert e whatever is resident, because the kernel indexes it by the same expert id as
the weights. (vLLM PR #50562 broke exactly this: it moved weights into *slots* and remapped the
routed ids to slot ids, but kept indexing the FP8 scales by expert, so slot s read expert s's
scales -- silently wrong. With no remapping there is no second index to get out of step. The
device cache does remap ids to slot units; it gives every kept-whole side tensor N slot
rows that follow the slots each step: engine/device_cache/side.py.)

A tensor is re-homed when it is large and per-expert (the weights, packed int4 included); kept
whole when it is small or not per-expert; refused -- by name, with the reason -- when the stride
model cannot describe it (leading dim not the expert dim, an inner layout that is not row-major,
an expert stride not a multiple of 16 bytes, a padded stride where the kernel implies it: Marlin
and moe_wna16_gemm compute expert e's address from the shape) or when its shape disagrees with
the quant config (its rows might not belong to the expert the engine thinks). One refused tensor
refuses the layer: the layer keeps vLLM's stock path.

Pure: no torch or vLLM. The input is a description (name, shape, element bytes, strides) that the
GPU survey (`research/gpu/gpu_quant_survey.py`) or the engine builds from the real parameters.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from reap_swap.sizing.quant.scheme import QuantScheme, expected_numels, scheme_from_config

REHOME_MIN_EXPERT_BYTES = 64 * 1024  # below this per expert a tensor is cheaper kept whole in HBM
STRIDE_ALIGN = 16  # bytes: the kernels' vector loads; an expert stride must be a multiple


class Decision(StrEnum):
    REHOME = "rehome"  # moves with its expert (host master / HBM slot)
    KEEP_WHOLE = "keep_whole"  # stays in HBM for every expert, indexed by expert id
    REFUSE = "refuse"  # the engine cannot bind it: the layer keeps vLLM's stock path


class StrideMode(StrEnum):
    """How the layer's kernel finds expert e inside a weight tensor."""

    STRIDED = "strided"  # base + e * tensor.stride(0): any stride (vLLM's Triton fused_moe)
    CONTIGUOUS = "contiguous"  # base + e * expert_bytes, implied by the shape (Marlin, moe_wna16_gemm)
    OPAQUE = "opaque"  # weights held outside the parameters or routed inside the kernel


@dataclass(frozen=True)
class ParamSpec:
    """One registered tensor of a MoE layer, as the engine would see it after loading."""

    name: str
    shape: tuple[int, ...]
    elem_bytes: float  # bytes per element of the storage dtype (int32-packed int4: 4)
    dtype: str = ""
    strides: tuple[int, ...] | None = None  # in elements; None = row-major contiguous
    layout: str = ""  # a swizzle whose padding the shape rules know (scheme.HOPPER_MX_SCALE), else ""

    @property
    def row_major_strides(self) -> tuple[int, ...]:
        out, acc = [], 1
        for d in reversed(self.shape):
            out.append(acc)
            acc *= d
        return tuple(reversed(out))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return int(self.numel * self.elem_bytes)


@dataclass(frozen=True)
class LayerSpec:
    """A layer: its tensors, its expert count and shapes, the method's own quant config."""

    params: tuple[ParamSpec, ...]
    num_experts: int
    hidden_size: int
    intermediate_size: int  # per partition (moe_intermediate / TP)
    quant_config: Mapping[str, Any] = field(default_factory=dict)
    method: str = ""  # the quant method class name, e.g. "Fp8MoEMethod"
    stride_mode: StrideMode = StrideMode.STRIDED
    kernel: str = ""  # the experts (kernel) class name, e.g. "TritonExperts"


@dataclass(frozen=True)
class TensorBinding:
    name: str
    role: str  # weight / scale / zero / g_idx / bias / shape / input_scale / unknown
    decision: Decision
    reason: str
    expert_bytes: int  # bytes of one expert's slab (0 for a tensor that is not per-expert)


@dataclass(frozen=True)
class LayerBinding:
    tensors: tuple[TensorBinding, ...]

    @property
    def refusals(self) -> dict[str, str]:
        return {t.name: t.reason for t in self.tensors if t.decision is Decision.REFUSE}

    @property
    def ok(self) -> bool:
        return not self.refusals

    @property
    def refusal(self) -> str | None:
        """One line naming every tensor the engine cannot bind, or None."""
        return "; ".join(f"{n}: {r}" for n, r in self.refusals.items()) or None

    def names(self, decision: Decision) -> list[str]:
        return [t.name for t in self.tensors if t.decision is decision]

    @property
    def rehomed_expert_bytes(self) -> int:
        return sum(t.expert_bytes for t in self.tensors if t.decision is Decision.REHOME)

    def kept_bytes(self, num_experts: int) -> int:
        """HBM held for every expert whatever is resident (the kept-whole per-expert tensors)."""
        return sum(t.expert_bytes * num_experts for t in self.tensors if t.decision is Decision.KEEP_WHOLE)

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "refusal": self.refusal,
            "rehome": self.names(Decision.REHOME),
            "keep_whole": self.names(Decision.KEEP_WHOLE),
            "tensors": [
                {
                    "name": t.name,
                    "role": t.role,
                    "decision": t.decision.value,
                    "reason": t.reason,
                    "expert_bytes": t.expert_bytes,
                }
                for t in self.tensors
            ],
        }


# Roles by parameter-name suffix, as vLLM 0.26's MoE methods register them (checked against
# fp8.py, auto_awq.py, auto_gptq.py, moe_wna16.py, compressed_tensors_moe_*.py, mxfp4.py).
_ROLE_SUFFIXES = (
    ("_weight_g_idx", "g_idx"),
    ("_g_idx_sort_indices", "g_idx"),
    ("_g_idx", "g_idx"),
    ("_weight_scale_inv", "scale"),
    ("_weight_scale_2", "scale"),
    ("_weight_scale", "scale"),
    ("_input_global_scale", "input_scale"),
    ("_input_scale", "input_scale"),
    ("_scales", "scale"),
    ("_weight_zero_point", "zero"),
    ("_qzeros", "zero"),
    ("_weight_shape", "shape"),
    ("_weight_packed", "weight"),
    ("_qweight", "weight"),
    ("_weight", "weight"),
    ("_bias", "bias"),
)


def role_of(name: str) -> str:
    base = name.rsplit(".", 1)[-1]
    if not (base.startswith("w13_") or base.startswith("w2_")):
        return "unknown"
    for suffix, role in _ROLE_SUFFIXES:
        if base.endswith(suffix):
            return role
    return "unknown"


def projection_of(name: str) -> str:
    """'w13' or 'w2' (the gate_up and down projections), from the parameter name."""
    return "w13" if name.rsplit(".", 1)[-1].startswith("w13_") else "w2"


def _features(proj: str, spec: LayerSpec) -> tuple[set[int], int]:
    """(allowed out features, in features) of one expert's projection (gated or not for w13)."""
    n, k = spec.intermediate_size, spec.hidden_size
    return ({2 * n, n}, k) if proj == "w13" else ({k}, n)


def _shape_problem(p: ParamSpec, role: str, spec: LayerSpec, scheme: QuantScheme) -> str | None:
    outs, k_in = _features(projection_of(p.name), spec)
    expected = expected_numels(role, outs, k_in, scheme, p.layout)
    if expected is None or scheme.kind == "unknown":
        return None
    per_expert = p.numel / spec.num_experts
    measured = per_expert * p.elem_bytes if role in ("weight", "zero") else per_expert
    if measured in expected:
        return None
    unit = "bytes" if role in ("weight", "zero") else "elements"
    want = " or ".join(str(int(x)) for x in sorted(expected))
    return (
        f"{int(measured)} {unit} per expert, the {scheme.kind}/{scheme.strategy} config implies {want}: "
        "its rows may not belong to the expert the engine assumes"
    )


def _layout_problem(p: ParamSpec) -> str | None:
    """Inner dimensions must be row-major: the stride model is base + e * stride(0) + row-major."""
    if p.strides is None:
        return None
    if len(p.strides) != len(p.shape):
        return f"strides {p.strides} do not match shape {p.shape}"
    if tuple(p.strides[1:]) != p.row_major_strides[1:]:
        return (
            f"inner strides {tuple(p.strides[1:])} are not row-major {p.row_major_strides[1:]} "
            "(a transposed or interleaved layout the per-expert stride model does not cover)"
        )
    if p.shape[0] > 1 and p.strides[0] * p.elem_bytes < p.nbytes / p.shape[0]:
        return f"expert stride {p.strides[0]} elements overlaps the next expert's slab"
    return None


def _expert_stride_bytes(p: ParamSpec) -> float:
    stride0 = p.strides[0] if p.strides is not None else p.row_major_strides[0]
    return stride0 * p.elem_bytes


def _not_per_expert(p: ParamSpec, role: str, spec: LayerSpec) -> TensorBinding:
    e = spec.num_experts
    if role == "weight":
        where = f"at dim {p.shape.index(e)}" if e in p.shape else "nowhere"
        return TensorBinding(
            p.name,
            role,
            Decision.REFUSE,
            f"leading dim {p.shape[0] if p.shape else None} is not num_experts {e} (expert dim {where}): "
            "no per-expert slab to re-home",
            0,
        )
    if e in p.shape[1:] and p.numel >= REHOME_MIN_EXPERT_BYTES:
        return TensorBinding(
            p.name,
            role,
            Decision.REFUSE,
            f"expert dim {p.shape.index(e)} is not leading: cannot bind rows",
            0,
        )
    return TensorBinding(p.name, role, Decision.KEEP_WHOLE, "not per-expert: shared by all experts", 0)


def _implied_stride_problem(p: ParamSpec, spec: LayerSpec) -> str | None:
    """A kernel that implies the expert stride (Marlin, moe_wna16_gemm) reads expert e at
    e * slab bytes, weights and scales alike: any other stride is read wrongly, silently."""
    if spec.stride_mode is not StrideMode.CONTIGUOUS or p.strides is None or p.shape[0] < 2:
        return None
    slab_elems = p.numel // p.shape[0]
    if p.strides[0] != slab_elems:
        return (
            f"expert stride {p.strides[0]} elements, but {spec.kernel or spec.method} implies "
            f"{slab_elems} (contiguous experts): it would read the wrong rows"
        )
    return None


def bind_tensor(
    p: ParamSpec, spec: LayerSpec, scheme: QuantScheme, min_rehome: int = REHOME_MIN_EXPERT_BYTES
) -> TensorBinding:
    """The decision for one tensor of a layer (see the module docstring)."""
    role = role_of(p.name)
    if not p.shape or p.shape[0] != spec.num_experts:
        return _not_per_expert(p, role, spec)
    slab = int(p.nbytes / spec.num_experts)
    if p.numel == 0:  # e.g. Marlin's [E, 0] g_idx_sort_indices without act-order: no rows to bind
        return TensorBinding(p.name, role, Decision.KEEP_WHOLE, "empty (0 bytes): nothing to bind", 0)
    if role == "zero" and not scheme.zero_point:  # sym GPTQ: auto_gptq.py:581-603's params_dtype placeholders
        why = "zero points of a symmetric scheme: never passed to the kernel; kept whole, unchecked"
        return TensorBinding(p.name, role, Decision.KEEP_WHOLE, why, slab)
    problem = _layout_problem(p) or _shape_problem(p, role, spec, scheme) or _implied_stride_problem(p, spec)
    if problem:
        return TensorBinding(p.name, role, Decision.REFUSE, problem, slab)
    if role == "weight" and spec.stride_mode is StrideMode.OPAQUE:
        return TensorBinding(
            p.name,
            role,
            Decision.REFUSE,
            f"{spec.method} / {spec.kernel or 'unknown kernel'} does not read this parameter by expert "
            "stride (not a kernel known to take or imply the expert stride)",
            slab,
        )
    if role == "unknown":
        if slab >= min_rehome:
            return TensorBinding(p.name, role, Decision.REFUSE, "unknown large per-expert tensor", slab)
        return TensorBinding(
            p.name, role, Decision.KEEP_WHOLE, "small per-expert tensor of unknown role", slab
        )
    if role != "weight" or slab < min_rehome:
        why = "small per-expert tensor, indexed by expert id (the device cache adds slot rows)"
        return TensorBinding(p.name, role, Decision.KEEP_WHOLE, why, slab)
    stride = _expert_stride_bytes(p)
    if stride % STRIDE_ALIGN:
        return TensorBinding(
            p.name,
            role,
            Decision.REFUSE,
            f"expert stride {stride:g} B is not a multiple of {STRIDE_ALIGN}",
            slab,
        )
    if spec.stride_mode is StrideMode.CONTIGUOUS:
        why = "re-homed contiguously: the kernel implies expert stride = slab bytes (no padding)"
        return TensorBinding(p.name, role, Decision.REHOME, why, slab)
    return TensorBinding(p.name, role, Decision.REHOME, "re-homed: the kernel takes the expert stride", slab)


def bind_layer(spec: LayerSpec, min_rehome: int = REHOME_MIN_EXPERT_BYTES) -> LayerBinding:
    """Bind every tensor; aliases of the same storage (AWQ's w13_weight = w13_qweight) bind once."""
    scheme = scheme_from_config(spec.quant_config)
    out = [bind_tensor(p, spec, scheme, min_rehome) for p in spec.params]
    if scheme.kind == "unknown":
        out.append(
            TensorBinding(
                "<quant_config>",
                "config",
                Decision.REFUSE,
                f"quant method {spec.quant_config.get('quant_method')!r} has no binding rules",
                0,
            )
        )
    if not any(t.decision is Decision.REHOME for t in out) and all(
        t.decision is not Decision.REFUSE for t in out
    ):
        out.append(TensorBinding("<layer>", "layer", Decision.REFUSE, "no per-expert weight to re-home", 0))
    return LayerBinding(tuple(out))


def layer_spec_from_dict(d: Mapping[str, Any]) -> LayerSpec:
    """A LayerSpec from the JSON the GPU survey writes (see research/gpu/gpu_quant_survey.py)."""
    params = tuple(
        ParamSpec(
            name=str(p["name"]),
            shape=tuple(int(x) for x in p["shape"]),
            elem_bytes=float(p["elem_bytes"]),
            dtype=str(p.get("dtype", "")),
            strides=tuple(int(x) for x in p["strides"]) if p.get("strides") is not None else None,
        )
        for p in d["params"]
    )
    return LayerSpec(
        params=params,
        num_experts=int(d["num_experts"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        quant_config=d.get("quant_config") or {},
        method=str(d.get("method", "")),
        stride_mode=StrideMode(d.get("stride_mode", StrideMode.STRIDED.value)),
        kernel=str(d.get("kernel") or ""),
    )
