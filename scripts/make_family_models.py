#!/usr/bin/env python3
"""Tiny seeded checkpoints of each MoE family, with a plan each, for the CPU end-to-end tests.

Why: reap-swap must read, count and swap every family people offload (Mixtral, GPT-OSS,
DeepSeek-V2/V3 / Kimi, Qwen3.5-MoE), not only the tiny Qwen3-MoE of make_tiny_moe.py. Each model
here is built by transformers' own model class from a small config in the family's own naming
(seeded), saved as safetensors in the format the HF hub uses, with make_tiny_moe's offline
tokenizer. Router weights are rescaled so that routing is varied and float32 near-ties are rare,
which an independent recount (transformers' router on the same checkpoint) needs.

The CPU build's limits shape the configs: attention head_dim >= 32; DeepSeek's MLA needs a head
size of 576 (kv_lora_rank 512 + qk_rope_head_dim 64).

Output (default .cache/families/<family>/, gitignored): model/ (config.json, model.safetensors,
tokenizer files) and plan.json (strict30-v2 format, plan layers = the decoder layers that hold
routed experts). Idempotent per family (a stamp of the recipe hash).

`family_plan(shape, ...)` is also what research/gpu/gpu_families.sh uses to write plans for the
full-size configs under tests/data/ (no weights: vLLM's --load-format dummy).

usage: python scripts/make_family_models.py [--out DIR] [--force] [FAMILY ...]
       python scripts/make_family_models.py --plan-for CONFIG --plan-out PLAN [--core-fraction F]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / ".cache" / "families"
SEED = 4321
ROUTER_STD = 0.1  # as make_tiny_moe's gate_std: router logits of a unit-RMS state spread ~1

_COMMON = {"vocab_size": 512, "hidden_size": 128, "max_position_embeddings": 1024, "torch_dtype": "float32"}
FAMILIES: dict[str, dict] = {
    "mixtral": {
        **_COMMON,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 64,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
    "gpt_oss": {
        **_COMMON,
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 64,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "experts_per_token": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 128,
        "rope_scaling": None,
    },
    "deepseek_v3": {
        **_COMMON,
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 128,
        "moe_intermediate_size": 64,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_group": 2,  # group-limited top-k, sigmoid scores + e_score_correction_bias (V3's router)
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 64,
        "v_head_dim": 32,
        "rope_scaling": None,
    },
    "qwen3_5_moe": {
        **_COMMON,
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
    },
}


def family_plan(
    shape, model_name: str, core_fraction: float = 0.25, slice_size: int = 2, budget_fraction: float = 1.0
) -> dict:
    """A strict30-v2 plan over `shape.moe_layers`: a rotated core per layer, slices over the rest.

    `shape` is a reap_swap.sizing.model_shape.ModelShape. The budget fits `budget_fraction` of every
    expert (at least the core), so swaps up to that share of the model are legal."""
    E, pe = shape.num_experts, shape.expert_bytes
    n_core = int(E * core_fraction)
    per_layer, total_core, total_slices = {}, 0, 0
    for L in shape.moe_layers:
        order = [(e + 3 * L) % E for e in range(E)]
        core, rest = sorted(order[:n_core]), order[n_core:]
        slices = [
            {"sliceId": f"layer_{L}_slice_{i:02d}", "experts": sorted(rest[j : j + slice_size])}
            for i, j in enumerate(range(0, len(rest), slice_size))
        ]
        for s in slices:
            s["byteCost"] = len(s["experts"]) * pe
        per_layer[f"layer_{L}"] = {
            "rawLayerKey": str(L),
            "numExperts": E,
            "coreExperts": core,
            "coreByteCost": len(core) * pe,
            "sliceCatalog": slices,
        }
        total_core, total_slices = total_core + len(core), total_slices + len(slices)
    core_bytes = total_core * pe
    budget = max(core_bytes, int(len(shape.moe_layers) * E * budget_fraction) * pe)
    return {
        "mode": "dynamic_core_specialist",
        "model": model_name,
        "budget": {
            "per_expert_bytes": pe,
            "swappable_expert_budget_bytes": budget,
            "core_budget_bytes": core_bytes,
            "specialist_budget_bytes": budget - core_bytes,
            "max_refreshes_per_request": 4,
        },
        "perLayer": per_layer,
        "summary": {
            "layerCount": len(per_layer),
            "totalCoreExperts": total_core,
            "totalSlices": total_slices,
        },
    }


def recipe_hash(family: str) -> str:
    blob = json.dumps({"recipe": FAMILIES[family], "seed": SEED, "router_std": ROUTER_STD}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _rescale_routers(model) -> int:
    """Every router's weight ~ N(0, ROUTER_STD^2) (its bias, if any, zero); returns how many."""
    import torch

    g = torch.Generator().manual_seed(SEED + 1)
    n = 0
    for _name, module in sorted(model.named_modules(), key=lambda item: item[0]):
        if type(module).__name__.endswith("Router") and hasattr(module, "weight"):
            with torch.no_grad():
                w = module.weight
                w.copy_(torch.randn(w.shape, generator=g, dtype=torch.float32).to(w.dtype) * ROUTER_STD)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            n += 1
    return n


def build_weights(model_dir: Path, cfg: dict) -> None:
    """transformers' own model class for the family, seeded, saved as safetensors."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures")}
    config = AutoConfig.for_model(cfg["model_type"], **fields)
    config.architectures = cfg["architectures"]
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if _rescale_routers(model) == 0:
        raise RuntimeError(f"{cfg['model_type']}: no router module found to rescale")
    model.save_pretrained(model_dir, safe_serialization=True)


def _tokenizer(model_dir: Path, vocab: int) -> dict[str, int]:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import make_tiny_moe
    finally:
        sys.path.pop(0)
    return make_tiny_moe.build_tokenizer(model_dir, vocab)


def build(family: str, out: Path, force: bool = False) -> Path:
    """out/<family>/ with model/ and plan.json (rebuilt only when the recipe changed)."""
    from reap_swap.plan.document import load_plan
    from reap_swap.sizing.model_shape import read_model_shape

    dest, want = out / family, recipe_hash(family)
    stamp = dest / "STAMP"
    if not force and stamp.is_file() and stamp.read_text().strip() == want:
        return dest
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{family}-", dir=out))
    try:
        model_dir = tmp / "model"
        model_dir.mkdir()
        special = _tokenizer(model_dir, FAMILIES[family]["vocab_size"])
        cfg = {
            **FAMILIES[family],
            "eos_token_id": special["<|im_end|>"],
            "pad_token_id": special["<|endoftext|>"],
        }
        build_weights(model_dir, cfg)
        shape = read_model_shape(model_dir)
        plan = family_plan(shape, f"reap-swap/tiny-{family}")
        (tmp / "plan.json").write_text(json.dumps(plan, indent=2))
        load_plan(tmp / "plan.json", shape)  # the plan must validate against the model it is for
        (tmp / "STAMP").write_text(want + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="*", help=f"default: all of {sorted(FAMILIES)}")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--plan-for", type=Path, help="write only a plan for this config.json / folder")
    ap.add_argument("--plan-out", type=Path)
    ap.add_argument("--core-fraction", type=float, default=0.25)
    ap.add_argument("--slice-size", type=int, default=8)
    a = ap.parse_args(argv)
    if a.plan_for:
        from reap_swap.sizing.model_shape import read_model_shape

        shape = read_model_shape(a.plan_for)
        plan = family_plan(shape, str(a.plan_for), a.core_fraction, a.slice_size)
        a.plan_out.write_text(json.dumps(plan))
        print(a.plan_out)
        return 0
    for family in a.families or sorted(FAMILIES):
        if family not in FAMILIES:
            ap.error(f"unknown family {family!r}; known: {sorted(FAMILIES)}")
        print(build(family, a.out.resolve(), a.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
