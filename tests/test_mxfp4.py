"""GPT-OSS MXFP4 on Hopper (compat/mxfp4.py): the binding rules over fakes built the way vLLM 0.26.0's
TRITON backend leaves a layer -- `layer.w13_weight` a triton_kernels Tensor whose `storage.data` is the
`.mT` of a contiguous [E, rows, cols] base (HopperMXValueLayout), the scales on the quant method
(`w13_precision_config.weight_scale`, HopperMXScaleLayout, rows padded to 256 and scale groups to 4),
fp32 biases as Parameters. triton_kernels is not installed here; the GPU check is research/gpu's."""

from __future__ import annotations

import argparse
import json
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

from reap_swap.compat import moe as vllm_moe
from reap_swap.compat import moe_cache, mxfp4
from reap_swap.config.settings import Settings
from reap_swap.engine.residency import engine as residency_engine
from reap_swap.engine.residency.binding import LayerSizes, bind_module
from reap_swap.engine.residency.refusals import LayerRefusals
from reap_swap.server import host_checks
from reap_swap.server import launcher as server
from reap_swap.sizing.model_shape import read_model_shape
from reap_swap.sizing.quant.budget import served_quant
from reap_swap.sizing.quant.layout import Decision, LayerSpec, ParamSpec, bind_tensor
from reap_swap.sizing.quant.scheme import HOPPER_MX_SCALE, expected_numels, scheme_from_config

DATA = Path(__file__).resolve().parent / "data"
MXFP4 = {"quant_method": "mxfp4"}
E, H, I = 4, 512, 512  # noqa: E741 - I is the expert width, as in vLLM's code
G = 2 * 2**20


@dataclass
class Layout:
    name: str


@dataclass
class Storage:  # triton_kernels.tensor.Storage: a plain dataclass
    data: torch.Tensor
    layout: Layout


@dataclass
class TkTensor:  # triton_kernels.tensor.Tensor: the kernel reads .storage
    storage: Storage


def _roundup(x, m):
    return -(-x // m) * m


def swizzled_value(out_features: int, in_features: int, layout: str = mxfp4.VALUE_LAYOUT) -> TkTensor:
    """What HopperMXValueLayout leaves: base [E, out/4, in/2*4] uint8 (padded to 16 / 32), stored .mT."""
    rows, cols = _roundup(out_features, 16) // 4, _roundup(in_features // 2, 32) * 4
    base = torch.randint(0, 255, (E, rows, cols), dtype=torch.uint8)
    return TkTensor(Storage(base.mT, Layout(layout)))


def swizzled_scale(out_features: int, in_features: int) -> TkTensor:
    """What HopperMXScaleLayout leaves: base [E, rows/32, groups*32], rows to 256, groups (to 4) to 2."""
    rows, groups = _roundup(out_features, 256), _roundup(_roundup(in_features // 32, 4), 2)
    base = torch.randint(0, 255, (E, rows // 32, groups * 32), dtype=torch.uint8)
    return TkTensor(Storage(base.mT, Layout(mxfp4.SCALE_LAYOUT)))


def oai_layer(backend="TRITON", value_layout=mxfp4.VALUE_LAYOUT, topk=4, renormalize=True):
    experts = type(mxfp4.KERNEL, (), {"topk": topk, "renormalize": renormalize})()
    method = type(mxfp4.METHOD, (), {"is_monolithic": True})()
    method.moe_kernel = NS(fused_experts=experts)
    method.mxfp4_backend = NS(name=backend)
    method.w13_precision_config = NS(weight_scale=swizzled_scale(2 * I, H))
    method.w2_precision_config = NS(weight_scale=swizzled_scale(H, I))
    layer = torch.nn.Module()
    layer.quant_method = method
    layer.w13_weight = swizzled_value(2 * I, H, value_layout)  # plain attributes, as mxfp4.py:351-353
    layer.w2_weight = swizzled_value(H, I, value_layout)
    layer.w13_bias = torch.nn.Parameter(torch.zeros(E, 2 * I), requires_grad=False)  # fp32, as the oracle
    layer.w2_bias = torch.nn.Parameter(torch.zeros(E, H), requires_grad=False)
    layer.expert_map = None
    layer.local_num_experts, layer.hidden_size, layer.intermediate_size_per_partition = E, H, I
    return layer


def bind(layer, unwrapped):
    names = vllm_moe.moe_kernel_names(layer)
    return bind_module(
        layer, LayerSizes(E, H, I), MXFP4, names, G, on_device=lambda t: True, unwrapped=unwrapped
    )


def test_unwrap_reads_the_swizzled_bases_and_the_scales_on_the_method():
    layer = oai_layer()
    u = mxfp4.unwrap(layer)
    assert set(u.bases) == {"w13_weight", "w2_weight"} and all(b.is_contiguous() for b in u.bases.values())
    assert u.bases["w13_weight"].shape == (E, 2 * I // 4, H // 2 * 4)
    assert u.bases["w13_weight"].data_ptr() == layer.w13_weight.storage.data.data_ptr()
    assert set(u.scales) == {"w13_weight_scale", "w2_weight_scale"}
    assert set(u.layouts.values()) == {HOPPER_MX_SCALE}


def test_the_weights_rehome_and_the_scales_and_biases_stay_whole():
    layer = oai_layer()
    bound = bind(layer, mxfp4.unwrap(layer))
    assert bound.refusal is None, bound.refusal
    assert sorted(bound.rehome) == ["w13_weight", "w2_weight"]
    assert sorted(bound.kept) == ["w13_bias", "w13_weight_scale", "w2_bias", "w2_weight_scale"]
    scale_bytes = (1024 * 16 + 512 * 16) * E  # rows padded to 256 x scale groups padded to 4
    bias_bytes = (2 * I + H) * 4 * E
    assert bound.kept_bytes == scale_bytes + bias_bytes
    assert bound.layout.names == ("w13_weight", "w2_weight")
    assert bound.layout.payload_bytes == 2 * I * H // 2 + H * I // 2  # 3 * H * I / 2: the plan's expert bytes
    assert bound.repoint is not None


def test_repoint_moves_the_wrapper_the_kernel_reads_to_the_engines_view():
    layer = oai_layer()
    u = mxfp4.unwrap(layer)
    base = u.bases["w13_weight"]
    unit = 2**20  # a strided view into a bigger range, as the engine's units are
    rng = torch.zeros(E * unit, dtype=torch.uint8)
    view = rng.as_strided(base.shape, (unit, base.stride(1), 1))
    u.repoint("w13_weight", view)
    data = layer.w13_weight.storage.data
    assert data.data_ptr() == rng.data_ptr() and data.stride() == (unit, 1, base.stride(1))  # .mT of the view
    assert "w13_weight" not in u.bases  # the swizzled copy is not kept alive past the re-home
    with pytest.raises(ValueError, match="not the base"):
        u.repoint("w2_weight", view)


def test_point_params_uses_the_repoint_and_marks_the_layer():
    layer = oai_layer()
    bound = bind(layer, mxfp4.unwrap(layer))
    views = {n: t.clone() for n, t in bound.rehome.items()}
    residency_engine._point_params(layer, bound, views)
    assert layer.w13_weight.storage.data.data_ptr() == views["w13_weight"].data_ptr()
    assert layer.w2_weight.storage.data.data_ptr() == views["w2_weight"].data_ptr()
    assert layer._reap_vmm and not hasattr(layer.w13_bias, vllm_moe.UVA_FLAG)
    assert all(bound.rehome[n] is views[n] for n in views)  # the old bases are no longer referenced


def test_a_refused_layer_gives_back_the_loaded_copies_of_the_weights_the_method_deleted():
    layer = oai_layer()
    # the UVA-offloaded parameters as loaded (only the weights are offloaded: launcher's names)
    setattr(layer, vllm_moe.LOADED_PTRS_ATTR, {"w13_weight": 111, "w2_weight": 222})
    # neither is a Parameter any more: the swizzle deleted them and keeps triton_kernels tensors
    assert vllm_moe.keep_replaced_on_device(layer, on_device=lambda p: True) == [111, 222]


@pytest.mark.parametrize(
    "make, why",
    [
        (lambda: oai_layer(backend="MARLIN"), "MXFP4 backend MARLIN, not TRITON"),
        (
            lambda: oai_layer(value_layout="BLACKWELL_VALUE"),
            "w13_weight: layout BLACKWELL_VALUE, not HOPPER_VALUE",
        ),
    ],
)
def test_unwrap_refuses_by_name(make, why):
    assert mxfp4.unwrap(make()).startswith(why)


def test_unwrap_refuses_expert_parallel_other_kernels_and_plain_storage():
    layer = oai_layer()
    layer.expert_map = torch.arange(E)
    assert "expert_map" in mxfp4.unwrap(layer)
    layer = oai_layer()
    layer.quant_method.moe_kernel = NS(fused_experts=type("TrtLlmMxfp4ExpertsMonolithic", (), {})())
    assert mxfp4.unwrap(layer).endswith(f"only {mxfp4.METHOD} on {mxfp4.KERNEL} is read")
    layer = oai_layer()
    layer.w2_weight = torch.zeros(E, H, I // 2, dtype=torch.uint8)  # not a wrapper
    assert mxfp4.unwrap(layer).startswith("w2_weight: not a triton_kernels tensor")


def test_a_padded_weight_is_refused_as_rows_of_another_expert():
    layer = oai_layer()
    layer.w13_weight = swizzled_value(2 * I, H + 64)  # another in-width: the config's bytes disagree
    bound = bind(layer, mxfp4.unwrap(layer))
    assert bound.refusal is not None and bound.refusal.startswith("w13_weight: ")
    assert "its rows may not belong to the expert" in bound.refusal


def test_hopper_scale_padding_is_part_of_the_shape_rules():
    scheme = scheme_from_config(MXFP4)
    # GPT-OSS-120B: w13 5760 x 2880 -> rows 5888, groups 90 -> 92; w2 2880 x 2880 -> rows 3072
    assert expected_numels("scale", {5760}, 2880, scheme, "hopper_mx_scale") == {5888 * 92}
    assert expected_numels("scale", {2880}, 2880, scheme, "hopper_mx_scale") == {3072 * 92}
    assert expected_numels("scale", {5760}, 2880, scheme) == {5760 * 90}  # the checkpoint's layout
    spec = LayerSpec(params=(), num_experts=128, hidden_size=2880, intermediate_size=2880, quant_config=MXFP4)
    padded = ParamSpec("w13_weight_scale", (128, 184, 2944), 1, layout="hopper_mx_scale")
    assert bind_tensor(padded, spec, scheme).decision is Decision.KEEP_WHOLE
    unpadded_told_padded = ParamSpec("w13_weight_scale", (128, 5760, 90), 1, layout="hopper_mx_scale")
    assert bind_tensor(unpadded_told_padded, spec, scheme).decision is Decision.REFUSE
    weight = ParamSpec("w13_weight", (128, 1440, 5760), 1)  # the 120B base: 8,294,400 B per expert
    assert bind_tensor(weight, spec, scheme).decision is Decision.REHOME


def test_the_gate_keeps_mxfp4_on_vllms_path_until_turned_on(monkeypatch):
    layer = oai_layer()
    monkeypatch.delenv(mxfp4.GATE_ENV, raising=False)
    assert "not yet verified on a GPU" in vllm_moe.unsupported_moe_method(layer)
    assert "not yet verified on a GPU" in moe_cache.cache_refusal(layer)
    monkeypatch.setenv(mxfp4.GATE_ENV, "1")
    assert vllm_moe.unsupported_moe_method(layer) is None
    assert moe_cache.cache_refusal(layer) == (
        "the kernel routes inside itself: routed ids cannot be remapped to slot units"
    )


def test_grouped_units_are_refused_for_mxfp4(monkeypatch):
    monkeypatch.setenv(mxfp4.GATE_ENV, "1")
    layer = oai_layer()
    engine = residency_engine.CudaEngine(None, LayerRefusals(), group_size="auto")
    engine._quant_configs[id(layer)] = MXFP4
    assert "routes inside itself" in engine._bind(layer, G)


@pytest.mark.parametrize("renormalize", [True, False])
def test_the_counting_router_calls_the_kernels_own_topk(monkeypatch, renormalize):
    calls = []

    def topk(logits, k, apply_softmax=True):
        calls.append((logits.clone(), k, apply_softmax))
        vals, idx = torch.topk(logits, k)
        return vals, idx.to(torch.int16), None

    monkeypatch.setitem(sys.modules, "triton_kernels", types.ModuleType("triton_kernels"))
    monkeypatch.setitem(sys.modules, "triton_kernels.topk", NS(topk=topk))
    route = mxfp4.router(oai_layer(topk=2, renormalize=renormalize))
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    weights, ids = route(None, logits)
    assert ids.dtype == torch.int32 and ids.tolist() == [[1, 3]]
    seen, k, apply_softmax = calls[0]
    assert k == 2 and apply_softmax is renormalize  # renormalize: top-k of raw logits, softmax after
    assert torch.equal(seen, logits if renormalize else torch.softmax(logits, -1))


def test_no_counting_router_without_triton_kernels_or_off_that_kernel(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_kernels.topk", None)  # import fails
    assert mxfp4.router(oai_layer()) is None
    layer = oai_layer()
    layer.quant_method.moe_kernel = NS(fused_experts=object())
    assert mxfp4.router(layer) is None


def test_served_quant_loads_gpt_oss_mxfp4_into_host_memory_only_with_the_path_on():
    shape = read_model_shape(json.loads((DATA / "gpt_oss_120b_config.json").read_text()))
    assert shape.expert_bytes == 12_441_600 and len(shape.moe_layers) == 36
    on = served_quant(shape.quant, shape.quant_method, None, "1", oai_mxfp4=True)
    assert on.engine_refusal is None and on.triton and on.offload_params == ("w13_weight", "w2_weight")
    off = served_quant(shape.quant, shape.quant_method, None, "1")
    assert "MXFP4" in off.engine_refusal
    assert served_quant(shape.quant, shape.quant_method, "mxfp4", "1", oai_mxfp4=True).engine_refusal
    assert served_quant(shape.quant, shape.quant_method, None, "auto", oai_mxfp4=True).engine_refusal


@pytest.mark.parametrize(
    "gate, capability, expected",
    [("1", (9, 0), ["triton", "host", "uva"]), ("", (9, 0), []), ("1", (10, 0), [])],
)
def test_the_launcher_offloads_gpt_oss_120b_with_the_path_on_hopper(monkeypatch, gate, capability, expected):
    calls = []
    vs = server.vllm_serve
    monkeypatch.setenv(mxfp4.GATE_ENV, gate)
    monkeypatch.setattr(vs, "platform_name", lambda: "cuda")
    monkeypatch.setattr(vs, "moe_backend_is_default", lambda a: True)
    monkeypatch.setattr(vs, "use_triton_moe_backend", lambda a: calls.append("triton"))
    monkeypatch.setattr(vs, "cpu_offload_chosen", lambda a: False)
    monkeypatch.setattr(vs, "offload_experts_to_uva", lambda a, gib, names: calls.append("uva") or names)
    monkeypatch.setattr(host_checks, "check_host_memory", lambda s, **kw: calls.append("host"))
    monkeypatch.setattr(server.vllm_runner, "offload_ignored_reason", lambda *a: None)
    monkeypatch.setattr(vs, "device_total_bytes", lambda: 80 * 2**30)
    monkeypatch.setattr(vs, "device_capability", lambda: capability)  # Blackwell: another swizzle
    shape = read_model_shape(json.loads((DATA / "gpt_oss_120b_config.json").read_text()))
    args = argparse.Namespace(quantization=None, gpu_memory_utilization=0.9)
    server.gpu_engine_args(Settings(exact_pinning=False), args, shape, 0)
    assert calls == expected
