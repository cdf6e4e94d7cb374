"""model_shape: expert geometry from the config.json naming of each supported MoE family."""

from pathlib import Path

import orjson
import pytest

from reap_swap.sizing.model_shape import ModelShapeError, read_model_shape

DATA = Path(__file__).parent / "data"
QWEN35 = DATA / "qwen3_5_moe_35b_a3b_config.json"


@pytest.mark.parametrize("source", [QWEN35, str(QWEN35), "folder", "dict"])
def test_qwen3_5_nested_text_config_from_file_folder_or_dict(source, tmp_path):
    if source == "folder":
        (tmp_path / "config.json").write_bytes(QWEN35.read_bytes())
        source = tmp_path
    elif source == "dict":
        source = orjson.loads(QWEN35.read_bytes())
    shape = read_model_shape(source)
    assert shape.architecture == "Qwen3_5MoeForConditionalGeneration"
    assert (shape.num_layers, shape.num_experts, shape.top_k) == (40, 256, 8)
    assert shape.moe_layers == tuple(range(40))
    assert (shape.hidden_size, shape.moe_intermediate_size, shape.dtype_bytes) == (2048, 512, 2)
    assert shape.expert_bytes == 6291456 == 3 * 2048 * 512 * 2


def test_qwen3_moe_sparse_step_and_mlp_only_layers():
    shape = read_model_shape(
        {
            "architectures": ["Qwen3MoeForCausalLM"],
            "num_hidden_layers": 8,
            "hidden_size": 64,
            "intermediate_size": 256,
            "moe_intermediate_size": 32,
            "num_experts": 16,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 2,
            "mlp_only_layers": [3],
            "torch_dtype": "float32",
        }
    )
    # sparse when (i + 1) % 2 == 0, except layer 3 which is listed dense
    assert shape.moe_layers == (1, 5, 7)
    assert shape.expert_bytes == 3 * 64 * 32 * 4


def test_qwen2_moe_prefers_moe_intermediate_size_over_dense_width():
    shape = read_model_shape(
        {
            "architectures": ["Qwen2MoeForCausalLM"],
            "num_hidden_layers": 24,
            "hidden_size": 2048,
            "intermediate_size": 5632,
            "moe_intermediate_size": 1408,
            "num_experts": 60,
            "num_experts_per_tok": 4,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "torch_dtype": "bfloat16",
        }
    )
    assert shape.moe_intermediate_size == 1408
    assert len(shape.moe_layers) == 24 and shape.num_experts == 60


def test_mixtral_naming():
    shape = read_model_shape(
        {
            "architectures": ["MixtralForCausalLM"],
            "num_hidden_layers": 32,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "torch_dtype": "bfloat16",
        }
    )
    assert (shape.num_experts, shape.top_k, shape.moe_layers) == (8, 2, tuple(range(32)))
    assert shape.expert_bytes == 3 * 4096 * 14336 * 2


def test_dtype_defaults_to_bf16_and_torch_prefix_is_accepted():
    base = {
        "num_hidden_layers": 2,
        "hidden_size": 8,
        "moe_intermediate_size": 4,
        "num_experts": 4,
        "num_experts_per_tok": 1,
    }
    assert read_model_shape(base).dtype_bytes == 2
    assert read_model_shape({**base, "torch_dtype": "torch.float16"}).dtype_bytes == 2
    with pytest.raises(ModelShapeError, match="unknown dtype"):
        read_model_shape({**base, "torch_dtype": "complex64"})


def test_dense_model_and_missing_fields_are_refused(tmp_path):
    with pytest.raises(ModelShapeError, match="not a MoE model"):
        read_model_shape({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 8})
    with pytest.raises(ModelShapeError, match="moe_intermediate_size"):
        read_model_shape(
            {"num_experts": 4, "num_hidden_layers": 2, "hidden_size": 8, "num_experts_per_tok": 1}
        )
    with pytest.raises(ModelShapeError, match="no such config.json"):
        read_model_shape(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelShapeError, match="not valid JSON"):
        read_model_shape(tmp_path / "config.json")


# Full-size configs written from the published config.json of each model (tests/data/README.md).
# Every expected number is computed by hand here, from the model card's published sizes:
# expert bytes = 3 matrices x hidden x expert width x 2 bytes (bf16).
FULL_SIZE = {
    # file: (family, layers, moe layers, experts, top-k, hidden, expert width, shared width, bias)
    "qwen3_5_moe_35b_a3b_config.json": ("qwen", 40, range(0, 40), 256, 8, 2048, 512, 512, False),
    "deepseek_v2_lite_config.json": ("deepseek", 27, range(1, 27), 64, 6, 2048, 1408, 2 * 1408, False),
    "moonlight_16b_a3b_config.json": ("deepseek", 27, range(1, 27), 64, 6, 2048, 1408, 2 * 1408, False),
    "deepseek_v3_bf16_config.json": ("deepseek", 61, range(3, 61), 256, 8, 7168, 2048, 2048, False),
    "deepseek_v3_bf16_depth5_config.json": ("deepseek", 5, range(3, 5), 256, 8, 7168, 2048, 2048, False),
    "kimi_k2_bf16_depth3_config.json": ("deepseek", 3, range(1, 3), 384, 8, 7168, 2048, 2048, False),
    "gpt_oss_20b_bf16_config.json": ("gpt_oss", 24, range(0, 24), 32, 4, 2880, 2880, 0, True),
    "mixtral_8x7b_config.json": ("mixtral", 32, range(0, 32), 8, 2, 4096, 14336, 0, False),
}


@pytest.mark.parametrize("name", sorted(FULL_SIZE))
def test_full_size_config_shapes(name):
    family, layers, moe, experts, top_k, hidden, width, shared, bias = FULL_SIZE[name]
    shape = read_model_shape(DATA / name)
    assert shape.family == family
    assert (shape.num_layers, shape.moe_layers) == (layers, tuple(moe))
    assert (shape.num_experts, shape.top_k) == (experts, top_k)
    assert (shape.hidden_size, shape.moe_intermediate_size, shape.dtype_bytes) == (hidden, width, 2)
    assert shape.expert_bytes == 3 * hidden * width * 2
    assert shape.shared_expert_intermediate_size == shared
    assert shape.expert_bias == bias
    assert shape.total_expert_bytes == len(moe) * experts * 3 * hidden * width * 2


def test_full_size_expert_bytes_by_hand():
    gib = 2**30
    # Qwen3.5-35B-A3B: 3 x 2048 x 512 x 2 = 6 MiB per expert; 40 x 256 of them = 60 GiB.
    qwen = read_model_shape(DATA / "qwen3_5_moe_35b_a3b_config.json")
    assert qwen.expert_bytes == 6 * 2**20 and qwen.total_expert_bytes == 60 * gib
    # Mixtral-8x7B: 3 x 4096 x 14336 x 2 = 352,321,536 B = 336 MiB; 32 x 8 = 84 GiB.
    mixtral = read_model_shape(DATA / "mixtral_8x7b_config.json")
    assert mixtral.expert_bytes == 352_321_536 == 336 * 2**20 and mixtral.total_expert_bytes == 84 * gib
    # DeepSeek-V3 / Kimi-K2 layer: 3 x 7168 x 2048 x 2 = 84 MiB per expert, 21 GiB per 256-expert layer.
    v3 = read_model_shape(DATA / "deepseek_v3_bf16_config.json")
    assert v3.expert_bytes == 84 * 2**20 and v3.layer_expert_bytes == 21 * gib
    assert read_model_shape(DATA / "kimi_k2_bf16_depth3_config.json").layer_expert_bytes == 31.5 * gib
    # DeepSeek-V2-Lite: 3 x 2048 x 1408 x 2 = 17,301,504 B; 26 MoE layers x 64 experts.
    lite = read_model_shape(DATA / "deepseek_v2_lite_config.json")
    assert lite.expert_bytes == 17_301_504 and lite.total_expert_bytes == 26 * 64 * 17_301_504
    # GPT-OSS-20B (bf16): 3 x 2880 x 2880 x 2 = 49,766,400 B of weights; bias rows (2 x 2880 + 2880) x 2.
    oss = read_model_shape(DATA / "gpt_oss_20b_bf16_config.json")
    assert oss.expert_bytes == 49_766_400 and oss.expert_bias_bytes == 17_280


def test_tiny_deepseek_v3_config_is_read_not_refused():
    shape = read_model_shape(
        {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "num_hidden_layers": 6,
            "hidden_size": 64,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 2,
            "torch_dtype": "float32",
        }
    )
    # vLLM's rule: MoE when i >= first_k_dense_replace and i % moe_layer_freq == 0
    assert shape.moe_layers == (2, 4)
    assert (shape.num_experts, shape.top_k, shape.expert_bytes) == (8, 2, 3 * 64 * 32 * 4)
    assert shape.shared_expert_intermediate_size == 32


def test_gpt_oss_reads_experts_per_token_when_num_experts_per_tok_is_absent():
    shape = read_model_shape(
        {
            "model_type": "gpt_oss",
            "num_hidden_layers": 2,
            "hidden_size": 64,
            "intermediate_size": 64,
            "num_local_experts": 4,
            "experts_per_token": 2,
            "torch_dtype": "float32",
        }
    )
    assert (shape.family, shape.top_k, shape.expert_bias_bytes) == ("gpt_oss", 2, (2 * 64 + 64) * 4)


def test_dense_deepseek_and_quantized_configs_are_refused():
    dense = {"model_type": "deepseek_v2", "n_routed_experts": None, "num_hidden_layers": 2, "hidden_size": 8}
    with pytest.raises(ModelShapeError, match="not a MoE model"):
        read_model_shape(dense)
    quantized = orjson.loads((DATA / "gpt_oss_20b_bf16_config.json").read_bytes())
    quantized["quantization_config"] = {"quant_method": "mxfp4"}  # read since issue 16: 4-bit experts
    assert (
        read_model_shape(quantized).expert_bytes * 4
        == read_model_shape(DATA / "gpt_oss_20b_bf16_config.json").expert_bytes
    )
    quantized["quantization_config"] = {"quant_method": "hqq"}
    with pytest.raises(ModelShapeError, match=r"quant_method 'hqq'"):
        read_model_shape(quantized)


def test_validate_cli_accepts_a_tiny_deepseek_config(tmp_path, capsys):
    """The issue's reproduction: `reap-swap validate --model` used to refuse n_routed_experts."""
    from script_modules import load_script

    from reap_swap.cli.main import main

    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "num_hidden_layers": 3,
        "hidden_size": 64,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "torch_dtype": "float32",
    }
    (tmp_path / "config.json").write_bytes(orjson.dumps(config))
    plan = load_script("make_family_models").family_plan(read_model_shape(config), "tiny-deepseek")
    assert sorted(plan["perLayer"]) == ["layer_1", "layer_2"]  # layer 0 is dense
    (tmp_path / "plan.json").write_bytes(orjson.dumps(plan))
    rc = main(["validate", str(tmp_path / "plan.json"), "--model", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "valid: 0 error(s)" in out
    # a plan over layer 0 (dense) is refused against this model
    plan["perLayer"]["layer_0"] = plan["perLayer"].pop("layer_2")
    (tmp_path / "plan.json").write_bytes(orjson.dumps(plan))
    assert main(["validate", str(tmp_path / "plan.json"), "--model", str(tmp_path)]) != 0
    assert "missing: 2" in capsys.readouterr().out


def test_field_plan_validates_against_the_full_qwen3_5_config(capsys):
    from reap_swap.cli.main import main

    field_plan = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "strict30-v2-plan.json"
    if not field_plan.exists():
        pytest.skip(f"shared fixture missing: {field_plan}")
    assert main(["validate", str(field_plan), "--model", str(QWEN35)]) == 0
    assert "valid: 0 error(s), 0 warning(s)" in capsys.readouterr().out
