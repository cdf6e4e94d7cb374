"""model_shape: expert geometry from the config.json naming of each supported MoE family."""

from pathlib import Path

import orjson
import pytest

from reap_swap.model_shape import ModelShapeError, read_model_shape

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
