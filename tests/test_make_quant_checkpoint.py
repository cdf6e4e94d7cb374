"""The quantized checkpoint writer: tensor names map through vLLM's expert_params_mapping onto the
parameters each MoE method registers (vLLM 0.26.0's create_weights), with the dtypes and element
counts those parameters hold, and the configs parse into the scheme the binding rules expect."""

from __future__ import annotations

import json
import math

import pytest
from quant_files import TINY, headers, shape_args
from script_modules import load_script

from reap_swap.sizing.quant.scheme import scheme_from_config

mqc = load_script("make_quant_checkpoint")

# Per-expert parameter shapes registered by vLLM 0.26.0's MoE methods (create_weights), for
# hidden K, intermediate N, group 128, pack factor 8 (int32 of int4).
G = 128


def registered(fmt, k, n):
    if fmt == "bf16":
        return {"w13_weight": (2 * n, k), "w2_weight": (k, n)}
    if fmt == "fp8-block":
        return {
            "w13_weight": (2 * n, k),
            "w2_weight": (k, n),
            "w13_weight_scale_inv": (2 * n // 128, k // 128),
            "w2_weight_scale_inv": (k // 128, n // 128),
        }
    if fmt == "fp8-tensor":  # w13 scale: one per shard on load, max-reduced after
        return {
            "w13_weight": (2 * n, k),
            "w2_weight": (k, n),
            "w13_weight_scale": (2,),
            "w2_weight_scale": (),
            "w13_input_scale": (),
            "w2_input_scale": (),
        }
    if fmt == "ct-fp8":
        return {
            "w13_weight": (2 * n, k),
            "w2_weight": (k, n),
            "w13_weight_scale": (2 * n, 1),
            "w2_weight_scale": (k, 1),
        }
    if fmt == "awq":  # AutoAWQMoEMethod, is_transposed
        return {
            "w13_qweight": (k, 2 * n // 8),
            "w2_qweight": (n, k // 8),
            "w13_scales": (k // G, 2 * n),
            "w2_scales": (n // G, k),
            "w13_qzeros": (k // G, 2 * n // 8),
            "w2_qzeros": (n // G, k // 8),
        }
    if fmt == "gptq":  # AutoGPTQMoEMethod
        return {
            "w13_qweight": (k // 8, 2 * n),
            "w2_qweight": (n // 8, k),
            "w13_scales": (k // G, 2 * n),
            "w2_scales": (n // G, k),
            "w13_qzeros": (k // G, 2 * n // 8),
            "w2_qzeros": (n // G, k // 8),
            "w13_g_idx": (k,),
            "w2_g_idx": (n,),
        }
    if fmt == "ct-w4a16":  # CompressedTensorsWNA16MarlinMoEMethod (Marlin shapes, transposed on load)
        return {
            "w13_weight_packed": (k // 8, 2 * n),
            "w2_weight_packed": (n // 8, k),
            "w13_weight_scale": (k // G, 2 * n),
            "w2_weight_scale": (n // G, k),
            "w13_weight_shape": (2,),
            "w2_weight_shape": (2,),
        }
    raise AssertionError(fmt)


DTYPES = {
    "weight": {"bf16": "BF16", "fp8-block": "F8_E4M3", "fp8-tensor": "F8_E4M3", "ct-fp8": "F8_E4M3"},
    "weight_scale_inv": "BF16",  # Qwen FP8 checkpoints (DeepSeek-V3: F32); vLLM casts on load
    "input_scale": "F32",
    "qweight": "I32",
    "qzeros": "I32",
    "scales": "F16",
    "g_idx": "I32",
    "weight_packed": "I32",
    "weight_shape": "I64",
}


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    args = ["--out", str(root)] + shape_args(TINY)
    assert mqc.main(args) == 0
    return root


def vllm_mapping(num_experts):
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    return RoutedExperts.build_expert_params_mapping("gate_proj", "down_proj", "up_proj", num_experts)


@pytest.mark.parametrize("fmt", [f for f in mqc.FORMATS if f != "mxfp4"])
def test_expert_tensors_map_onto_the_registered_parameters(out, fmt):
    k, n, e = TINY["hidden"], TINY["moe_intermediate"], TINY["experts"]
    h = headers(out / fmt)
    want = registered(fmt, k, n)
    mapping = vllm_mapping(e)
    per_param: dict[str, int] = {}
    for name, (dtype, shape) in h.items():
        if ".mlp.experts." not in name or not name.startswith("model.layers.0."):
            continue
        hits = [(p, w) for p, w, _, _ in mapping if w in name]
        assert len(hits) == 1, name
        param = name.replace(hits[0][1], hits[0][0]).rsplit(".", 1)[-1]
        assert param in want, f"{name} -> {param} is not a parameter vLLM registers for {fmt}"
        per_param[param] = per_param.get(param, 0) + math.prod(shape)
        suffix = name.rsplit(".", 1)[-1]
        expect = DTYPES.get(suffix)
        expect = expect.get(fmt) if isinstance(expect, dict) else expect
        if suffix == "weight_scale":
            expect = "BF16" if fmt == "ct-w4a16" else "F32"
        assert dtype == expect, (name, dtype)
    assert set(per_param) == set(want)
    for param, shape in want.items():
        # gate and up (or down alone), summed over the layer's experts; the input scales of gate
        # and up load into the same per-expert slot (vLLM requires them equal)
        shards = 2 if param in ("w13_input_scale", "w13_weight_shape", "w13_g_idx") else 1
        assert per_param[param] == math.prod(shape) * e * shards, param
    if fmt == "fp8-tensor":
        from safetensors import safe_open

        for f in (out / fmt).glob("*.safetensors"):
            with safe_open(str(f), "pt") as st:
                keys = set(st.keys())
                for key in keys:
                    if key.endswith("gate_proj.input_scale"):
                        assert st.get_tensor(key) == st.get_tensor(key.replace("gate_proj", "up_proj"))


def test_mxfp4_is_gpt_oss_layout(out):
    k, n, e = TINY["hidden"], TINY["moe_intermediate"], TINY["experts"]
    h = headers(out / "mxfp4")
    x = "model.layers.0.mlp.experts."
    assert h[x + "gate_up_proj_blocks"] == ("U8", (e, 2 * n, k // 32, 16))
    assert h[x + "gate_up_proj_scales"] == ("U8", (e, 2 * n, k // 32))
    assert h[x + "gate_up_proj_bias"] == ("BF16", (e, 2 * n))
    assert h[x + "down_proj_blocks"] == ("U8", (e, k, n // 32, 16))
    assert h["model.layers.0.self_attn.sinks"][1] == (TINY["heads"],)
    cfg = json.loads((out / "mxfp4" / "config.json").read_text())
    assert (
        cfg["architectures"] == ["GptOssForCausalLM"]
        and cfg["quantization_config"]["quant_method"] == "mxfp4"
    )


@pytest.mark.parametrize("fmt", mqc.FORMATS)
def test_config_index_and_tokenizer(out, fmt):
    folder = out / fmt
    cfg = json.loads((folder / "config.json").read_text())
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(headers(folder))
    assert (folder / "tokenizer.json").exists() and (folder / "tokenizer_config.json").exists()
    scheme = scheme_from_config(cfg.get("quantization_config"))
    assert scheme.kind != "unknown"
    assert {"bf16": 16, "awq": 4, "gptq": 4, "ct-w4a16": 4, "mxfp4": 4}.get(fmt, 8) == scheme.bits
    if fmt == "fp8-block":
        assert scheme.block == (128, 128)
        assert "model.layers.1.mlp.gate" in cfg["quantization_config"]["modules_to_not_convert"]


def test_router_and_embeddings_stay_unquantized(out):
    h = headers(out / "fp8-block")
    assert h["model.layers.0.mlp.gate.weight"][0] == "BF16"
    assert h["lm_head.weight"][0] == "BF16"
    assert h["model.layers.0.self_attn.q_proj.weight"][0] == "F8_E4M3"  # attention quantized too


def test_seeded(tmp_path):
    args = ["--format", "awq"] + shape_args(TINY)
    mqc.main(["--out", str(tmp_path / "a"), *args])
    mqc.main(["--out", str(tmp_path / "b"), *args])
    a = sorted((tmp_path / "a" / "awq").glob("*.safetensors"))
    b = sorted((tmp_path / "b" / "awq").glob("*.safetensors"))
    assert [x.read_bytes() for x in a] == [x.read_bytes() for x in b]
