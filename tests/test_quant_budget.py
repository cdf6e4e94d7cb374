"""Quantized checkpoints through the launcher (issue 16): model_shape reads the configs that
scripts/make_quant_checkpoint.py writes, the expert bytes match the tensors it writes, the launcher
leaves vLLM's arguments alone for formats the engine refuses, and a plan's budget maps to pool
slots by the rule of sizing/quant/budget.py."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
from quant_files import TINY as QUANT_TINY
from script_modules import load_script

from reap_swap.config.settings import Settings
from reap_swap.plan.document import validate_plan_document
from reap_swap.server import host_checks
from reap_swap.server import launcher as server
from reap_swap.sizing.model_shape import ModelShapeError, read_model_shape
from reap_swap.sizing.quant.budget import (
    UNQUANTIZED_OFFLOAD_PARAMS,
    pool_hbm_bytes,
    pool_slots,
    served_quant,
    served_quant_of,
)
from reap_swap.sizing.unit_layout import plan_unit

mqc = load_script("make_quant_checkpoint")
TINY = mqc.Shape(**QUANT_TINY, plain_attention=1)
SPECIAL = {"<|im_end|>": 1, "<|endoftext|>": 0}
H, N = TINY.hidden, TINY.moe_intermediate
WEIGHT_BITS = {
    "bf16": 16,
    "fp8-block": 8,
    "fp8-tensor": 8,
    "ct-fp8": 8,
    "awq": 4,
    "gptq": 4,
    "ct-w4a16": 4,
    "mxfp4": 4,
}
REFUSED = {"awq", "gptq", "ct-w4a16", "mxfp4"}
MiB = 2**20


def config(fmt: str, shape=TINY) -> dict:
    return mqc.gpt_oss_config(shape, SPECIAL) if fmt == "mxfp4" else mqc.qwen3_config(shape, fmt, SPECIAL)


@pytest.mark.parametrize("fmt", mqc.FORMATS)
def test_every_writer_config_is_read_with_its_stored_expert_bytes(fmt):
    shape = read_model_shape(config(fmt))
    assert shape.expert_bytes == 3 * H * N * WEIGHT_BITS[fmt] // 8
    assert shape.total_expert_bytes == shape.expert_bytes * TINY.experts * TINY.layers
    assert shape.quant_method == ("" if fmt == "bf16" else config(fmt)["quantization_config"]["quant_method"])
    if fmt == "bf16":
        assert shape.expert_kept_bytes == 0
    else:
        assert shape.expert_kept_bytes > 0  # scales (and zero points, biases) kept whole in HBM


def test_kept_bytes_by_hand():
    assert read_model_shape(config("ct-fp8")).expert_kept_bytes == 4 * (2 * N + H)  # f32 [out, 1]
    assert read_model_shape(config("fp8-block")).expert_kept_bytes == 4 * (
        2 * 2 + 2 * 1
    )  # f32 [out/128, in/128]
    assert read_model_shape(config("fp8-tensor")).expert_kept_bytes == 4 * 2
    groups = 2 * N * (H // 128) + H * (N // 128)
    assert (
        read_model_shape(config("awq")).expert_kept_bytes == 2 * groups + groups // 2
    )  # fp16 scales + int4 zeros


EXPERT_WEIGHT = re.compile(r"\.experts\.(?:\d+\.)?\w+\.(weight|qweight|weight_packed)$|_proj_blocks$")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("quantckpt")
    assert (
        mqc.main(
            [
                "--out",
                str(out),
                *(f"--format={f}" for f in mqc.FORMATS),
                *(f"--{k.replace('_', '-')}={v}" for k, v in vars(TINY).items()),
            ]
        )
        == 0
    )
    return out


@pytest.mark.parametrize("fmt", mqc.FORMATS)
def test_expert_bytes_equal_the_expert_weight_tensors_written(written, fmt):
    from safetensors import safe_open

    folder = written / fmt
    shape = read_model_shape(folder)  # the config.json the writer wrote
    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                if EXPERT_WEIGHT.search(name):
                    t = st.get_tensor(name)
                    total += t.numel() * t.element_size()
    assert total == shape.total_expert_bytes


@pytest.mark.parametrize("fmt", mqc.FORMATS)
def test_the_launcher_serves_refused_formats_on_the_stock_path(fmt):
    shape = read_model_shape(config(fmt))
    served = served_quant(shape.quant, shape.quant_method)
    assert (served.engine_refusal is not None) == (fmt in REFUSED)
    assert served.launcher_may_offload == (fmt not in REFUSED)
    assert served == served_quant_of(config(fmt).get("quantization_config"))


def test_cli_quantization_overrides():
    bf16 = read_model_shape(config("bf16"))
    online = served_quant(bf16.quant, bf16.quant_method, "fp8")
    assert online.engine_refusal is None and online.scheme.kind == "fp8"
    awq = read_model_shape(config("awq"))
    assert "moe_wna16" in served_quant(awq.quant, awq.quant_method, "moe_wna16").engine_refusal


def _launch(monkeypatch, fmt, quantization=None, group_size="1"):
    calls = []
    vs = server.vllm_serve
    monkeypatch.setattr(vs, "platform_name", lambda: "cuda")
    monkeypatch.setattr(vs, "moe_backend_is_default", lambda a: True)
    monkeypatch.setattr(vs, "use_triton_moe_backend", lambda a: calls.append("triton"))
    monkeypatch.setattr(vs, "cpu_offload_chosen", lambda a: False)
    monkeypatch.setattr(
        vs, "offload_experts_to_uva", lambda a, gib, names: calls.append(("uva", gib, tuple(names)))
    )
    monkeypatch.setattr(
        host_checks, "check_host_memory", lambda s, **kw: calls.append(("host", s.total_expert_bytes))
    )
    monkeypatch.setattr(vs, "device_total_bytes", lambda: 141 * 2**30)  # one H200
    shape = read_model_shape(config(fmt))
    # --reap-exact-pinning off: vLLM pins as it does; --reap-group-size 1 (the default): INT4 stays refused
    settings = Settings(exact_pinning=False, group_size=group_size)
    server.gpu_engine_args(settings, argparse.Namespace(quantization=quantization), shape)
    return calls, shape


@pytest.mark.parametrize("fmt", mqc.FORMATS)
def test_gpu_engine_args_per_format(monkeypatch, fmt):
    calls, shape = _launch(monkeypatch, fmt)
    if fmt in REFUSED:
        assert calls == []  # no --moe-backend triton (0.26 raises for WNA16), no UVA offload
    else:
        gib = shape.total_expert_bytes / 2**30 + 0.5  # the stored (quantized) bytes are offloaded
        assert calls == [
            "triton",
            ("host", shape.total_expert_bytes),
            ("uva", gib, ("w13_weight", "w2_weight")),
        ]
    calls, _ = _launch(monkeypatch, "awq", quantization="moe_wna16")
    assert calls == []


INT4_NAMES = {"awq": ("w13_qweight", "w2_qweight"), "gptq": ("w13_qweight", "w2_qweight")}
INT4_NAMES["ct-w4a16"] = ("w13_weight_packed", "w2_weight_packed")  # compressed-tensors' WNA16


@pytest.mark.parametrize("fmt,cli", [("awq", None), ("gptq", None), ("ct-w4a16", None), ("awq", "moe_wna16")])
def test_int4_in_contiguous_groups_keeps_marlin_and_loads_into_host_memory_under_its_own_names(
    monkeypatch, fmt, cli
):
    """--reap-group-size auto|8 (research.md int4grp, int4perm): bound in identity-order groups by
    default, no --moe-backend triton (0.26's WNA16 oracle raises on it); the packed weights load into
    pinned host memory under the names the method registers (vLLM's UVA offloader matches whole name
    segments: `w13_weight` matches no INT4 parameter), host memory checked. Group size 1: untouched."""
    checkpoint = read_model_shape(config(fmt))
    names = INT4_NAMES[fmt]
    assert served_quant(checkpoint.quant, checkpoint.quant_method, cli, "auto").offload_params == names
    for group_size in ("auto", "8"):
        calls, shape = _launch(monkeypatch, fmt, quantization=cli, group_size=group_size)
        gib = shape.total_expert_bytes / 2**30 + 0.5
        assert calls == [("host", shape.total_expert_bytes), ("uva", gib, names)]
    calls, _ = _launch(monkeypatch, fmt, quantization=cli, group_size="1")
    assert calls == []  # private units would be read at the wrong address: vLLM's arguments as given


def test_int4_offload_names_are_the_parameters_vllm_registers():
    """Each INT4 method's packed weights, as the layer fakes of the engine tests register them, are
    matched by the names the launcher passes (segment match, as vLLM 0.26.0's offloader/uva.py)."""

    def matched(param_name, names):
        return any(f".{n}." in f".{param_name}." for n in names)

    awq = served_quant_of({"quant_method": "awq", "bits": 4, "group_size": 128}, None, "auto")
    assert matched("mlp.experts.w13_qweight", awq.offload_params)
    assert not matched("mlp.experts.w13_scales", awq.offload_params)  # scales stay in HBM
    assert not matched("mlp.experts.w13_qweight", UNQUANTIZED_OFFLOAD_PARAMS)  # the old names: nothing
    ct = served_quant_of(config("ct-w4a16")["quantization_config"], None, "auto")
    assert matched("mlp.experts.w2_weight_packed", ct.offload_params)


def test_online_fp8_is_bound_but_never_uva_offloaded(monkeypatch):
    """vLLM 0.26's online fp8 builds its weights on meta: the UVA offloader would crash on them
    (run 9a, fp8-online: "Cannot copy out of meta tensor"). Triton yes, offload no, host checked."""
    calls, shape = _launch(monkeypatch, "bf16", quantization="fp8")
    assert calls == ["triton", ("host", shape.total_expert_bytes)]
    online = served_quant(shape.quant, shape.quant_method, "fp8")
    assert online.engine_refusal is None and "meta device" in online.uva_refusal
    assert served_quant(shape.quant, shape.quant_method, None).uva_refusal is None


def test_budget_to_slots_for_a_bf16_plan_served_with_online_fp8():
    """Qwen3-30B-A3B: a plan made on bf16 (9 MiB experts) for 100 experts, served with online fp8."""
    h, n = 2048, 768
    per_expert_bf16 = 3 * h * n * 2
    assert per_expert_bf16 == 9 * MiB
    budget = 100 * per_expert_bf16
    slots = pool_slots(budget, per_expert_bf16)
    assert slots == 100  # the experts the plan chose, whatever the served precision
    fp8_unit = plan_unit([("w13_weight", 2 * n * h), ("w2_weight", h * n)], 2 * MiB).unit_bytes
    bf16_unit = plan_unit([("w13_weight", 2 * n * h * 2), ("w2_weight", h * n * 2)], 2 * MiB).unit_bytes
    assert (fp8_unit, bf16_unit) == (6 * MiB, 10 * MiB)
    assert pool_hbm_bytes(slots, fp8_unit) == 600 * MiB < budget  # online fp8: under the plan's bytes
    assert pool_hbm_bytes(slots, bf16_unit) == 1000 * MiB  # bf16: the 2 MiB padding on top
    assert pool_slots(budget - 1, per_expert_bf16) == 99 and pool_slots(-5, 1) == 0
    with pytest.raises(ValueError, match="per_expert_bytes"):
        pool_slots(budget, 0)


def _plan(per_expert: int, layers=(0, 1), experts=4) -> dict:
    budget = len(layers) * experts * per_expert
    return {
        "mode": "dynamic_core_specialist",
        "model": "tiny",
        "budget": {
            "per_expert_bytes": per_expert,
            "swappable_expert_budget_bytes": budget,
            "core_budget_bytes": 0,
            "specialist_budget_bytes": budget,
            "max_refreshes_per_request": 4,
        },
        "perLayer": {
            f"layer_{i}": {
                "rawLayerKey": str(i),
                "numExperts": experts,
                "coreExperts": [],
                "coreByteCost": 0,
                "sliceCatalog": [
                    {
                        "sliceId": f"layer_{i}_slice_00",
                        "experts": list(range(experts)),
                        "byteCost": experts * per_expert,
                    }
                ],
            }
            for i in layers
        },
    }


def test_plans_count_experts_in_the_checkpoint_bytes():
    fp8 = read_model_shape(config("fp8-block"))
    assert validate_plan_document(_plan(fp8.expert_bytes), fp8).ok
    report = validate_plan_document(_plan(3 * H * N * 2), fp8)  # made on the bf16 sibling
    text = json.dumps([i.message for i in report.errors])
    assert not report.ok and "re-plan against this fp8 checkpoint" in text and "8 bits" in text


def test_unknown_quantization_is_refused_by_name():
    cfg = config("bf16")
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    with pytest.raises(ModelShapeError, match="'bitsandbytes'.*no expert byte model"):
        read_model_shape(cfg)
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 3, "group_size": 128}
    with pytest.raises(ModelShapeError, match="'gptq'"):
        read_model_shape(cfg)


def test_experts_that_load_into_hbm_first_are_refused_before_loading_when_they_cannot_fit():
    """Online FP8 and INT4 in groups load every expert into HBM before the engine re-homes them:
    a model whose experts alone exceed utilization x HBM is refused with the numbers, not OOM."""
    from reap_swap.sizing.quant.budget import device_load_refusal

    gib = 2**30
    assert device_load_refusal(100 * gib, 1, 0.9, 141 * gib, "x") is None
    why = device_load_refusal(130 * gib, 1, 0.9, 141 * gib, "INT4 experts in contiguous groups")
    assert why.startswith("INT4 experts in contiguous groups: this model's experts alone take 130.0 GiB")
    assert "0.9 x 141.0 GiB = 126.9 GiB" in why and "--tensor-parallel-size" in why
    assert device_load_refusal(130 * gib, 2, 0.9, 141 * gib, "x") is None  # 65 GiB per GPU
    assert device_load_refusal(130 * gib, 1, 0.9, None, "x") is None  # total unknown: vLLM decides


def test_the_launcher_refuses_online_fp8_too_large_for_hbm(monkeypatch):
    shape = read_model_shape(config("bf16"))
    vs = server.vllm_serve
    monkeypatch.setattr(vs, "platform_name", lambda: "cuda")
    monkeypatch.setattr(vs, "moe_backend_is_default", lambda a: False)
    tiny_hbm = shape.total_expert_bytes  # 0.9 x this < the experts
    monkeypatch.setattr(vs, "device_total_bytes", lambda: tiny_hbm)
    with pytest.raises(server.LaunchError, match="experts alone take"):
        server.gpu_engine_args(Settings(exact_pinning=False), argparse.Namespace(quantization="fp8"), shape)


def test_an_awq_model_larger_than_the_card_loads_into_pinned_host_memory(monkeypatch):
    """Qwen3-235B-A22B in AWQ at 72 layers: 81 GiB of packed experts, more than an 80 GiB card. In
    groups the launcher asks vLLM's UVA offloader for the INT4 names (no HBM-first refusal, no
    --moe-backend triton); vLLM's own offload arguments are what it reads."""
    cfg = json.loads((Path(__file__).parent / "data" / "qwen3_235b_a22b_awq_config.json").read_text())
    cfg["num_hidden_layers"] = 72
    shape = read_model_shape(cfg)
    assert shape.total_expert_bytes > 80 * 2**30 and shape.quant_method == "awq"
    vs = server.vllm_serve
    monkeypatch.setattr(vs, "platform_name", lambda: "cuda")
    monkeypatch.setattr(vs, "device_total_bytes", lambda: 80 * 2**30)
    monkeypatch.setattr(host_checks, "check_host_memory", lambda s, **kw: None)  # a 128 GiB host
    args = argparse.Namespace(quantization=None, additional_config=None)
    server.gpu_engine_args(Settings(exact_pinning=True, group_size="auto"), args, shape)
    assert args.offload_backend == "uva" and args.cpu_offload_params == {"w13_qweight", "w2_qweight"}
    assert args.cpu_offload_gb >= shape.total_expert_bytes / 2**30
    assert not hasattr(args, "moe_backend")  # Marlin stays: 0.26.0 raises on triton for WNA16
    untouched = argparse.Namespace(quantization=None, additional_config=None)
    server.gpu_engine_args(Settings(group_size="1"), untouched, shape)  # refused: stock path, as given
    assert vars(untouched) == {"quantization": None, "additional_config": None}
