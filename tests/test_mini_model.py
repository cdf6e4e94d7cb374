"""The shipped mini MoE (models/reap-mini-moe): loads, has the promised shape and size, and
routes with measurable per-domain structure on held-out text (issue 6).

Fast (a few seconds on one CPU thread): a handful of held-out records per domain.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from script_modules import load_script

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "reap-mini-moe"
HELDOUT = REPO / "data" / "corpus" / "heldout.jsonl"
CALIB = REPO / "data" / "corpus" / "calibration.jsonl"
DOMAINS = {"c", "prose", "python", "shell"}

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")


@pytest.fixture(scope="module")
def rs():
    return load_script("routing_stats")


@pytest.fixture(scope="module")
def loaded(rs):
    torch.set_num_threads(1)
    return rs.load_model(str(MODEL))


def test_files_config_and_size():
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "README.md",
    ):
        assert (MODEL / name).is_file(), name
    size = (MODEL / "model.safetensors").stat().st_size
    assert 3_000_000 < size <= 8_000_000, size
    cfg = json.loads((MODEL / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert cfg["model_type"] == "qwen3_moe"
    assert cfg["torch_dtype"] == "bfloat16"
    assert cfg["num_experts"] == 16 and cfg["num_experts_per_tok"] == 2
    assert cfg["norm_topk_prob"] is True
    assert cfg["head_dim"] >= 32 and cfg["hidden_size"] % 32 == 0  # vLLM CPU kernels
    assert cfg["moe_intermediate_size"] % 32 == 0
    assert cfg["mlp_only_layers"] == [] and cfg["decoder_sparse_step"] == 1
    tc = json.loads((MODEL / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tc["chat_template"] and "<|im_end|>" in tc["chat_template"]
    assert tc["eos_token"] and tc["pad_token"]


def test_tensors_bf16_per_expert_layout():
    from safetensors import safe_open

    cfg = json.loads((MODEL / "config.json").read_text())
    with safe_open(str(MODEL / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert {f.get_slice(k).get_dtype() for k in keys} == {"BF16"}
        # the per-expert names vLLM's Qwen3-MoE loader maps onto w13/w2
        for layer in range(cfg["num_hidden_layers"]):
            for e in range(cfg["num_experts"]):
                for w in ("gate_proj", "up_proj", "down_proj"):
                    assert f"model.layers.{layer}.mlp.experts.{e}.{w}.weight" in keys
            assert f"model.layers.{layer}.mlp.gate.weight" in keys
        w = f.get_slice("model.layers.0.mlp.experts.0.gate_proj.weight")
        assert w.get_shape() == [cfg["moe_intermediate_size"], cfg["hidden_size"]]


def test_tokenizer_chat_template(loaded):
    _, tok = loaded
    assert tok.vocab_size + len(tok.get_added_vocab()) >= 4000
    text = tok.apply_chat_template(
        [{"role": "user", "content": "def f(x):"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\ndef f(x):<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode(ids) == text


def test_heldout_loss_is_learned(loaded, rs):
    model, tok = loaded
    recs = rs.load_jsonl(str(HELDOUT), per_domain=2)
    assert {r["source"] for r in recs} == DOMAINS
    tot, n = 0.0, 0
    with torch.no_grad():
        for r in recs:
            ids = torch.tensor([tok.encode(r["text"], add_special_tokens=False)[:256]])
            out = model(input_ids=ids, labels=ids)
            tot += out.loss.item() * (ids.shape[1] - 1)
            n += ids.shape[1] - 1
    ce = tot / n
    # uniform over the vocabulary would be ln(4096) = 8.3; the trained model is far below
    assert ce < 0.6 * math.log(model.config.vocab_size), ce


def _gap(half_counts, n_keep=4):
    """Plan-like check on two halves of the held-out records of each domain: the share of a
    domain's half-1 selections that fall on the top n_keep experts of its own half 0, and on
    those of another domain's half 0."""
    import numpy as np

    doms = sorted({g.split("#")[0] for g in half_counts})
    own, other = [], []
    for layer in range(half_counts[doms[0] + "#0"].shape[0]):
        for d in doms:
            h = half_counts[d + "#1"][layer]
            for e in doms:
                keep = np.argsort(-half_counts[e + "#0"][layer], kind="stable")[:n_keep]
                (own if d == e else other).append(h[keep].sum() / h.sum())
    return float(np.mean(own)), float(np.mean(other))


@pytest.fixture(scope="module")
def routing(loaded, rs):
    """Routing of the trained and of a random-init model on 24 held-out records per domain."""
    model, tok = loaded
    recs = rs.load_jsonl(str(HELDOUT), per_domain=24)
    rnd_model, _ = rs.load_model(str(MODEL), random_init=True, seed=0)
    out = {}
    for name, m in (("trained", model), ("random", rnd_model)):
        h = rs.route_counts(m, tok, recs, max_tokens=256, key=rs.halves_key)
        out[name] = (rs.summarize(rs.merge_halves(h), half_counts=h), _gap(h))
    return out


def test_routing_is_domain_structured(routing):
    s, (own, other) = routing["trained"]
    assert set(s["domains"]) == DOMAINS
    # between-domain JS far above the within-domain noise floor (two halves of one domain's
    # records); thresholds well under what research.md reports
    assert s["js_mean_over_layers"] > 2.5 * s["js_within_mean_over_layers"], (
        s["js_mean_over_layers"],
        s["js_within_mean_over_layers"],
    )
    assert s["js_mean_over_layers"] > 0.03
    # a domain's own top-25 % experts (chosen on other records) cover its traffic clearly
    # better than another domain's top 25 % do
    assert own - other > 0.05, (own, other)
    # no collapsed layer
    for r in s["layers"]:
        assert r["top25_pooled"] < 0.8


def test_routing_more_structured_than_random_init(routing):
    s, (own, other) = routing["trained"]
    r, (rown, rother) = routing["random"]
    ratio = s["js_mean_over_layers"] / s["js_within_mean_over_layers"]
    rratio = r["js_mean_over_layers"] / r["js_within_mean_over_layers"]
    assert ratio > 1.5 * rratio, (ratio, rratio)
    assert own - other > rown - rother, ((own, other), (rown, rother))
