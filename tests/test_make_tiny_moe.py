"""The tiny MoE builder: deterministic, idempotent, and its plan validates against its config."""

import hashlib
import json

from reap_fakes import build_tiny_model

from reap_swap.plan.document import load_plan
from reap_swap.sizing.model_shape import read_model_shape


def digest(root):
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_build_is_deterministic_idempotent_and_valid(tmp_path):
    a = build_tiny_model(tmp_path / "a")
    b = build_tiny_model(tmp_path / "b")
    assert digest(a) == digest(b)
    stamp = (a / "STAMP").stat().st_mtime_ns
    build_tiny_model(tmp_path / "a")  # matching stamp: nothing rebuilt
    assert (a / "STAMP").stat().st_mtime_ns == stamp
    shape = read_model_shape(a / "model")
    assert (shape.num_layers, shape.num_experts, shape.top_k, shape.hidden_size) == (4, 16, 2, 128)
    plan = load_plan(a / "plan.json", shape)
    assert all(plan.layers[i].candidates == frozenset(range(16)) for i in range(3))
    assert plan.layers[3].candidates == frozenset(range(14))
    tok = json.loads((a / "model" / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok["chat_template"]
