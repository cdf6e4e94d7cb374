"""model_shape across the names transformers gives one field (issue 44).

transformers >= 5.19 saves a Qwen3-MoE config's expert count as ``num_local_experts`` (its
``attribute_map`` aliases ``num_experts`` to it) beside ``moe_intermediate_size``; reap-swap read
that as Mixtral naming and took the expert width from ``intermediate_size``, refusing valid plans.
These tests build configs with the installed transformers, save them, and read the shape back
through reap-swap's entry points (``read_model_shape``, ``reap-swap validate --model``, the
``server.plan_source.load_validated_plan``).
"""

from __future__ import annotations

import argparse

import orjson
import pytest

from reap_swap.sizing.model_shape import ModelShapeError, read_model_shape

# hidden 128, dense MLP 256, experts 64 wide: a bf16 expert is 3 x 128 x 64 x 2 = 49,152 bytes
# (the numbers; reading the dense width instead gives 196,608)
HIDDEN, DENSE, WIDTH = 128, 256, 64
EXPERT_BYTES = 3 * HIDDEN * WIDTH * 2

# what transformers >= 5.19 writes for a Qwen3-MoE checkpoint: no num_experts
QWEN3_MOE_5_19 = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "num_hidden_layers": 4,
    "hidden_size": HIDDEN,
    "intermediate_size": DENSE,
    "moe_intermediate_size": WIDTH,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "dtype": "bfloat16",
    "transformers_version": "5.19.0",
}


def _legacy(config: dict) -> dict:
    """The same checkpoint as an older transformers saved it (num_experts)."""
    old = {k: v for k, v in config.items() if k != "num_local_experts"}
    return {**old, "num_experts": config["num_local_experts"]}


def _plan(tmp_path, shape) -> str:
    from script_modules import load_script

    plan = load_script("make_family_models").family_plan(shape, "tiny-qwen3-moe")
    path = tmp_path / "plan.json"
    path.write_bytes(orjson.dumps(plan))
    return str(path)


def test_transformers_5_19_qwen3_moe_config_json_takes_the_width_from_moe_intermediate_size(tmp_path):
    (tmp_path / "config.json").write_bytes(orjson.dumps(QWEN3_MOE_5_19))
    shape = read_model_shape(tmp_path)
    assert shape.family == "qwen"
    assert (shape.num_experts, shape.top_k, shape.moe_layers) == (8, 2, (0, 1, 2, 3))
    assert (shape.hidden_size, shape.moe_intermediate_size) == (HIDDEN, WIDTH)
    assert shape.expert_bytes == EXPERT_BYTES == 49_152
    assert shape == read_model_shape(_legacy(QWEN3_MOE_5_19))


def test_plan_made_before_a_resave_validates_and_launches_on_the_resaved_checkpoint(tmp_path, capsys):
    """The issue's reproduction: a plan made on the num_experts config, checked against the same
    checkpoint re-saved by transformers >= 5.19 (num_local_experts)."""
    from reap_swap.cli.main import main
    from reap_swap.config.settings import Settings
    from reap_swap.server import plan_source

    plan = _plan(tmp_path, read_model_shape(_legacy(QWEN3_MOE_5_19)))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_bytes(orjson.dumps(QWEN3_MOE_5_19))
    rc = main(["validate", plan, "--model", str(model)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "valid: 0 error(s)" in out
    args = argparse.Namespace(model=str(model), hf_config_path=None)
    shape, _plan_obj, _cartridges = plan_source.load_validated_plan(Settings(plan_file=plan), args)
    assert shape.expert_bytes == EXPERT_BYTES


def test_conflicting_expert_counts_are_refused():
    with pytest.raises(ModelShapeError, match="num_experts 4.*num_local_experts 8"):
        read_model_shape({**QWEN3_MOE_5_19, "num_experts": 4})
    # the same value under both names (an older transformers wrote both) is fine
    assert read_model_shape({**QWEN3_MOE_5_19, "num_experts": 8}).num_experts == 8


def test_unknown_model_type_with_moe_intermediate_size_is_not_read_as_mixtral():
    config = {k: v for k, v in QWEN3_MOE_5_19.items() if k not in ("model_type", "architectures")}
    shape = read_model_shape(config)
    assert (shape.family, shape.moe_intermediate_size) == ("qwen", WIDTH)
    mixtral = {k: v for k, v in config.items() if k != "moe_intermediate_size"}
    assert (read_model_shape(mixtral).family, read_model_shape(mixtral).moe_intermediate_size) == (
        "mixtral",
        DENSE,
    )


def test_a_qwen_config_without_moe_intermediate_size_is_refused_not_read_at_the_dense_width():
    config = {k: v for k, v in QWEN3_MOE_5_19.items() if k != "moe_intermediate_size"}
    with pytest.raises(ModelShapeError, match="lacks moe_intermediate_size"):
        read_model_shape(config)


# ---- configs built and saved by the installed transformers -----------------------------------

_COMMON = {"num_hidden_layers": 4, "hidden_size": HIDDEN, "intermediate_size": DENSE, "dtype": "bfloat16"}
_QWEN = {
    **_COMMON,
    "moe_intermediate_size": WIDTH,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
_DEEPSEEK = {
    **_COMMON,
    "moe_intermediate_size": WIDTH,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
}
_EVERY_LAYER = (0, 1, 2, 3)

# class name: (kwargs, nested under text_config, family, top-level width, MoE layers, bias)
FAMILIES = {
    "Qwen3MoeConfig": (_QWEN, False, "qwen", WIDTH, _EVERY_LAYER, False),
    "Qwen2MoeConfig": (
        {**_QWEN, "shared_expert_intermediate_size": 32},
        False,
        "qwen",
        WIDTH,
        _EVERY_LAYER,
        False,
    ),
    "Qwen3NextConfig": (_QWEN, False, "qwen", WIDTH, _EVERY_LAYER, False),
    "Qwen3_5MoeConfig": (_QWEN, True, "qwen", WIDTH, _EVERY_LAYER, False),
    "Qwen3VLMoeConfig": (_QWEN, True, "qwen", WIDTH, _EVERY_LAYER, False),
    "DeepseekV2Config": (_DEEPSEEK, False, "deepseek", WIDTH, (1, 2, 3), False),
    "DeepseekV3Config": (_DEEPSEEK, False, "deepseek", WIDTH, (1, 2, 3), False),
    "MixtralConfig": (
        {**_COMMON, "num_local_experts": 8, "num_experts_per_tok": 2},
        False,
        "mixtral",
        DENSE,
        _EVERY_LAYER,
        False,
    ),
    # Qwen's names without moe_intermediate_size: experts are intermediate_size wide
    "OlmoeConfig": (
        {**_COMMON, "num_experts": 8, "num_experts_per_tok": 2},
        False,
        "qwen",
        DENSE,
        _EVERY_LAYER,
        False,
    ),
    "GptOssConfig": (
        {**_COMMON, "num_local_experts": 8, "num_experts_per_tok": 2},
        False,
        "gpt_oss",
        DENSE,
        _EVERY_LAYER,
        True,
    ),
}


def _config_class(name: str):
    transformers = pytest.importorskip("transformers")
    cls = getattr(transformers, name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    return cls


def _build(name: str):
    kwargs, nested, *_ = FAMILIES[name]
    cls = _config_class(name)
    if nested:
        return cls(text_config={**kwargs})
    return cls(**kwargs)


def _check(shape, name: str) -> None:
    _, _, family, width, moe_layers, bias = FAMILIES[name]
    assert shape.family == family
    assert (shape.num_layers, shape.moe_layers) == (4, moe_layers)
    assert (shape.num_experts, shape.top_k) == (8, 2)
    assert (shape.hidden_size, shape.moe_intermediate_size, shape.dtype_bytes) == (HIDDEN, width, 2)
    assert shape.expert_bytes == 3 * HIDDEN * width * 2
    assert shape.expert_bias == bias


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_config_saved_by_the_installed_transformers(name, tmp_path):
    _build(name).save_pretrained(tmp_path)
    _check(read_model_shape(tmp_path), name)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_config_as_transformers_resolves_it(name, tmp_path):
    """engine/observer.py's path: AutoConfig.from_pretrained(...).to_dict(), and the object itself."""
    from transformers import AutoConfig

    _build(name).save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    _check(read_model_shape(config.to_dict()), name)
    _check(read_model_shape(config), name)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_attribute_map_alias_of_the_expert_count_is_read(name, tmp_path):
    """A config.json that names a field by the other side of the class's attribute_map (what
    another transformers release writes) reads the same."""
    config = _build(name)
    config.save_pretrained(tmp_path)
    saved = orjson.loads((tmp_path / "config.json").read_bytes())
    sub = type(getattr(config, "text_config", None) or config)
    fields = saved.get("text_config", saved)
    renamed = 0
    for alias, canonical in sub.attribute_map.items():
        if canonical in fields and alias not in fields:
            fields[alias] = fields.pop(canonical)
            renamed += 1
    if not renamed:
        pytest.skip(f"{sub.__name__}.attribute_map renames no field it saves")
    _check(read_model_shape(saved), name)


def test_installed_qwen3_moe_config_round_trips_through_both_names(tmp_path):
    """Whatever name this transformers writes, both spellings load to the same model shape."""
    cls = _config_class("Qwen3MoeConfig")
    cls(**_QWEN).save_pretrained(tmp_path)
    saved = orjson.loads((tmp_path / "config.json").read_bytes())
    assert 8 in (saved.get("num_experts"), saved.get("num_local_experts"))
    _check(read_model_shape(saved), "Qwen3MoeConfig")
