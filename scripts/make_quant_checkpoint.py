#!/usr/bin/env python3
"""Write seeded random MoE checkpoints in each quantized format, with the tensor names, dtypes and
`quantization_config` of the real ones, at Qwen3-30B-A3B layer shape and a few layers.

Why: the residency engine must bind every per-expert tensor of each format (issue 16), and the
GPU survey (`research/gpu/gpu_quant_survey.py`) must see what vLLM 0.26 really registers for them,
without downloading 15-60 GB checkpoints onto a machine with no internet. The values are random
but valid (FP8 from rounded normals, never NaN; int4 words and e8m0 scales in range), so a model
loads and generates; only names, shapes, dtypes and configs are meant to be faithful.

Formats (`--format`, repeatable, or `all`):
  bf16       Qwen3MoE, bf16 (also the input of vLLM's online `--quantization fp8`)
  fp8-block  Qwen3-30B-A3B-FP8 style: quant_method fp8, weight_block_size [128,128],
             `weight` float8_e4m3fn + `weight_scale_inv` bf16 [out/128, in/128] (bf16 as in Qwen's
             FP8 checkpoints, float32 in DeepSeek-V3's; vLLM casts to its float32 parameter)
  fp8-tensor quant_method fp8, activation_scheme static: `weight_scale`, `input_scale` scalars
  ct-fp8     compressed-tensors float-quantized, channel weights / dynamic token activations:
             `weight` fp8 + `weight_scale` float32 [out, 1]
  awq        AutoAWQ gemm, 4 bit, group 128: `qweight` int32 [in, out/8], `qzeros` int32
             [in/128, out/8], `scales` fp16 [in/128, out]
  gptq       AutoGPTQ, 4 bit, group 128, desc_act false: `qweight` int32 [in/8, out], `qzeros`,
             `scales`, `g_idx` int32 [in]
  ct-w4a16   compressed-tensors pack-quantized, 4 bit group 128 symmetric: `weight_packed` int32
             [out, in/8], `weight_scale` bf16 [out, in/128], `weight_shape` int64 [2]
  mxfp4      GPT-OSS layout (GptOssForCausalLM): `gate_up_proj_blocks` uint8 [E, 2I, H/32, 16],
             `gate_up_proj_scales` uint8 e8m0 [E, 2I, H/32], `gate_up_proj_bias` bf16, `down_proj_*`
Attention projections are quantized like the experts (as in the real checkpoints); the router
(`mlp.gate` / `mlp.router`), embeddings, norms and lm_head stay unquantized.

usage: python scripts/make_quant_checkpoint.py --out DIR [--format all] [--layers 2]
       [--hidden 2048 --moe-intermediate 768 --experts 128 ...]   (tiny shapes for CPU tests)
Each format goes to DIR/<format>/ (config.json, model-0000N.safetensors + index, tokenizer).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORMATS = ("bf16", "fp8-block", "fp8-tensor", "ct-fp8", "awq", "gptq", "ct-w4a16", "mxfp4")
GROUP = 128


@dataclass(frozen=True)
class Shape:
    layers: int = 2
    hidden: int = 2048
    moe_intermediate: int = 768
    experts: int = 128
    top_k: int = 8
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    vocab: int = 2048
    seed: int = 16
    plain_attention: int = 0  # 1: attention projections unquantized (listed as ignored), MoE only


def _tiny_moe():
    """scripts/make_tiny_moe.py as a module (its tokenizer builder and chat template)."""
    spec = importlib.util.spec_from_file_location("make_tiny_moe", ROOT / "scripts" / "make_tiny_moe.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_tiny_moe", mod)
    spec.loader.exec_module(mod)
    return mod


# -- one linear layer [out, in] in each format --------------------------------------------------
def _randn(g, *shape, std=0.02):
    import torch

    return torch.randn(*shape, generator=g) * std


def _int32_words(g, *shape):
    import torch

    return torch.randint(-(2**31), 2**31 - 1, shape, generator=g, dtype=torch.int32)


def _scales(g, *shape: int, dtype):
    import torch

    return (torch.rand(shape, generator=g) * 0.004 + 0.001).to(dtype)


FP8_MAX = 448.0  # largest float8_e4m3fn


def fp8_block_quantize(w, block: int = 128):
    """A real [out, in] weight -> (`weight` float8_e4m3fn, `weight_scale_inv` bf16 [ceil(out/b),
    ceil(in/b)]), the DeepSeek-V3 / Qwen3-FP8 block recipe: scale = amax(|block|) / 448, stored in
    bf16, and the weight divided by that stored scale, so vLLM's dequant (fp8 x scale per block)
    is what was meant. Deterministic; an all-zero block gets scale 1 (its zeros stay exact zeros,
    as do zero rows inside any block)."""
    import torch

    out, inp = w.shape
    bo, bi = -(-out // block), -(-inp // block)
    x = torch.nn.functional.pad(w.float(), (0, bi * block - inp, 0, bo * block - out))
    blocks = x.view(bo, block, bi, block)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).to(torch.bfloat16)
    q = (blocks / scale.float()[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(bo * block, bi * block)[:out, :inp].contiguous(), scale


def quantized_linear(fmt: str, prefix: str, out: int, inp: int, g) -> dict:
    """The checkpoint tensors of one nn.Linear(in, out) called `prefix` in format `fmt`."""
    import torch

    fp8 = torch.float8_e4m3fn
    if fmt == "bf16":
        return {f"{prefix}.weight": _randn(g, out, inp).to(torch.bfloat16)}
    if fmt in ("fp8-block", "fp8-tensor", "ct-fp8"):
        t = {f"{prefix}.weight": (torch.randn(out, inp, generator=g) * 64).clamp(-448, 448).to(fp8)}
        if fmt == "fp8-block":
            t[f"{prefix}.weight_scale_inv"] = _scales(g, -(-out // 128), -(-inp // 128), dtype=torch.bfloat16)
        elif fmt == "fp8-tensor":
            t[f"{prefix}.weight_scale"] = _scales(g, dtype=torch.float32)  # 0-d, like the real ones
            t[f"{prefix}.input_scale"] = _scales(g, dtype=torch.float32)
        else:
            t[f"{prefix}.weight_scale"] = _scales(g, out, 1, dtype=torch.float32)
        return t
    if fmt == "awq":
        return {
            f"{prefix}.qweight": _int32_words(g, inp, out // 8),
            f"{prefix}.qzeros": _int32_words(g, inp // GROUP, out // 8),
            f"{prefix}.scales": _scales(g, inp // GROUP, out, dtype=torch.float16),
        }
    if fmt == "gptq":
        return {
            f"{prefix}.qweight": _int32_words(g, inp // 8, out),
            f"{prefix}.qzeros": _int32_words(g, inp // GROUP, out // 8),
            f"{prefix}.scales": _scales(g, inp // GROUP, out, dtype=torch.float16),
            f"{prefix}.g_idx": (torch.arange(inp, dtype=torch.int32) // GROUP),
        }
    if fmt == "ct-w4a16":
        return {
            f"{prefix}.weight_packed": _int32_words(g, out, inp // 8),
            f"{prefix}.weight_scale": _scales(g, out, inp // GROUP, dtype=torch.bfloat16),
            f"{prefix}.weight_shape": torch.tensor([out, inp], dtype=torch.int64),
        }
    raise ValueError(f"unknown format {fmt!r}")


# -- configs ----------------------------------------------------------------------------------
def _compressed_tensors_config(fp8: bool, ignore: list[str]) -> dict:
    """compressed-tensors: FP8 channel weights with dynamic per-token activations, or W4A16
    pack-quantized group-128 symmetric weights."""
    if fp8:
        weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
    else:
        weights = {
            "num_bits": 4,
            "type": "int",
            "strategy": "group",
            "group_size": GROUP,
            "symmetric": True,
            "dynamic": False,
            "actorder": None,
        }
    acts = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts if fp8 else None}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized" if fp8 else "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {**group, "output_activations": None}},
        "ignore": ignore,
    }


def quantization_config(fmt: str, layers: int = 2, plain_attention: bool = False) -> dict | None:
    """The `quantization_config` block of config.json, as the real checkpoints write it (fp8 matches
    ignored layers by full prefix, so the routers are listed one by one)."""
    keep = ["lm_head", "re:.*mlp.gate$"] + (["re:.*self_attn.*"] if plain_attention else [])
    gates = ["lm_head"] + [f"model.layers.{i}.mlp.gate" for i in range(layers)]
    if plain_attention:
        gates += [f"model.layers.{i}.self_attn.{p}_proj" for i in range(layers) for p in "qkvo"]
    if fmt == "bf16":
        return None
    if fmt == "fp8-block":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": gates,
        }
    if fmt == "fp8-tensor":
        return {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": gates}
    if fmt in ("ct-fp8", "ct-w4a16"):
        return _compressed_tensors_config(fmt == "ct-fp8", keep)
    if fmt == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": GROUP,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": ["mlp.gate"] + (["self_attn"] if plain_attention else []),
        }
    if fmt == "gptq":
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": GROUP,
            "desc_act": False,
            "sym": True,
            "checkpoint_format": "gptq",
            "dynamic": {"-:.*mlp\\.gate$": {}, **({"-:.*self_attn.*": {}} if plain_attention else {})},
        }
    if fmt == "mxfp4":
        return {
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
        }
    raise ValueError(f"unknown format {fmt!r}")


def model_dtype(fmt: str) -> str:
    return "float16" if fmt in ("awq", "gptq") else "bfloat16"


def qwen3_config(s: Shape, fmt: str, special: dict) -> dict:
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": s.vocab,
        "hidden_size": s.hidden,
        "intermediate_size": 6144,
        "moe_intermediate_size": s.moe_intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "num_experts": s.experts,
        "num_experts_per_tok": s.top_k,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "eos_token_id": special["<|im_end|>"],
        "pad_token_id": special["<|endoftext|>"],
        "bos_token_id": None,
        "torch_dtype": model_dtype(fmt),
        "use_cache": True,
    }
    if (q := quantization_config(fmt, s.layers, bool(s.plain_attention))) is not None:
        cfg["quantization_config"] = q
    return cfg


def gpt_oss_config(s: Shape, special: dict) -> dict:
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": s.vocab,
        "hidden_size": s.hidden,
        "intermediate_size": s.moe_intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "num_local_experts": s.experts,
        "num_experts_per_tok": s.top_k,
        "experts_per_token": s.top_k,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(s.layers)],
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "hidden_act": "silu",
        "attention_bias": True,
        "max_position_embeddings": 4096,
        "initial_context_length": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 1.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 4096,
            "truncate": False,
        },
        "tie_word_embeddings": False,
        "eos_token_id": special["<|im_end|>"],
        "pad_token_id": special["<|endoftext|>"],
        "torch_dtype": "bfloat16",
        "quantization_config": quantization_config("mxfp4", s.layers),
        "use_cache": True,
    }


# -- weights ----------------------------------------------------------------------------------
def _common(s: Shape, dtype, g) -> dict:
    import torch

    return {
        "model.embed_tokens.weight": _randn(g, s.vocab, s.hidden, std=1.0).to(dtype),
        "lm_head.weight": _randn(g, s.vocab, s.hidden).to(dtype),
        "model.norm.weight": torch.ones(s.hidden, dtype=dtype),
    }


def qwen3_layer(s: Shape, fmt: str, i: int, g) -> dict:
    """One decoder layer of a Qwen3MoE checkpoint: attention + router + per-expert projections."""
    import torch

    dtype = getattr(torch, model_dtype(fmt))
    h, n, d = s.hidden, s.moe_intermediate, s.head_dim
    p = f"model.layers.{i}."
    t = {
        p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
        p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
        p + "self_attn.q_norm.weight": torch.ones(d, dtype=dtype),
        p + "self_attn.k_norm.weight": torch.ones(d, dtype=dtype),
        p + "mlp.gate.weight": _randn(g, s.experts, h, std=0.1).to(dtype),
    }
    for name, out, inp in (
        ("q_proj", s.heads * d, h),
        ("k_proj", s.kv_heads * d, h),
        ("v_proj", s.kv_heads * d, h),
        ("o_proj", h, s.heads * d),
    ):
        if s.plain_attention:
            t[p + f"self_attn.{name}.weight"] = _randn(g, out, inp).to(dtype)
        else:
            t.update(quantized_linear(fmt, p + "self_attn." + name, out, inp, g))
    for e in range(s.experts):
        q = f"{p}mlp.experts.{e}."
        t.update(quantized_linear(fmt, q + "gate_proj", n, h, g))
        t.update(quantized_linear(fmt, q + "up_proj", n, h, g))
        t.update(quantized_linear(fmt, q + "down_proj", h, n, g))
        if fmt == "fp8-tensor":  # vLLM loads both into one w13_input_scale slot: they must agree
            t[q + "up_proj.input_scale"] = t[q + "gate_proj.input_scale"].clone()
    return t


def gpt_oss_layer(s: Shape, i: int, g) -> dict:
    """One GPT-OSS decoder layer: bf16 attention with sinks and biases, MXFP4 experts (3-D)."""
    import torch

    bf, h, n, d, e = torch.bfloat16, s.hidden, s.moe_intermediate, s.head_dim, s.experts
    p = f"model.layers.{i}."
    t = {
        p + "input_layernorm.weight": torch.ones(h, dtype=bf),
        p + "post_attention_layernorm.weight": torch.ones(h, dtype=bf),
        p + "self_attn.sinks": torch.zeros(s.heads, dtype=torch.float32),
        p + "mlp.router.weight": _randn(g, e, h, std=0.1).to(bf),
        p + "mlp.router.bias": torch.zeros(e, dtype=bf),
    }
    for name, out, inp in (
        ("q_proj", s.heads * d, h),
        ("k_proj", s.kv_heads * d, h),
        ("v_proj", s.kv_heads * d, h),
        ("o_proj", h, s.heads * d),
    ):
        t[p + f"self_attn.{name}.weight"] = _randn(g, out, inp).to(bf)
        t[p + f"self_attn.{name}.bias"] = torch.zeros(out, dtype=bf)
    x = p + "mlp.experts."
    for name, out, inp in (("gate_up_proj", 2 * n, h), ("down_proj", h, n)):
        blocks = torch.randint(0, 256, (e, out, inp // 32, 16), generator=g, dtype=torch.uint8)
        t[x + name + "_blocks"] = blocks
        t[x + name + "_scales"] = torch.randint(118, 124, (e, out, inp // 32), generator=g, dtype=torch.uint8)
        t[x + name + "_bias"] = torch.zeros(e, out, dtype=bf)
    return t


def write_format(out: Path, fmt: str, s: Shape, tiny) -> Path:
    """DIR/<fmt>/: one safetensors shard per decoder layer (peak memory: one layer) + index."""
    import torch
    from safetensors.torch import save_file

    folder = out / fmt
    folder.mkdir(parents=True, exist_ok=True)
    special = tiny.build_tokenizer(folder, s.vocab)
    g = torch.Generator().manual_seed(s.seed)
    n_shards = s.layers + 1
    weight_map: dict[str, str] = {}
    total = 0
    for i in range(n_shards):  # shard 0: embeddings, norm, lm_head; shard i: decoder layer i-1
        if i == 0:
            tensors = _common(s, getattr(torch, model_dtype(fmt)), g)
        elif fmt == "mxfp4":
            tensors = gpt_oss_layer(s, i - 1, g)
        else:
            tensors = qwen3_layer(s, fmt, i - 1, g)
        fname = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file(
            {k: v.contiguous() for k, v in tensors.items()}, str(folder / fname), metadata={"format": "pt"}
        )
        total += sum(v.numel() * v.element_size() for v in tensors.values())
        weight_map.update(dict.fromkeys(tensors, fname))
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    cfg = gpt_oss_config(s, special) if fmt == "mxfp4" else qwen3_config(s, fmt, special)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = {"eos_token_id": special["<|im_end|>"], "pad_token_id": special["<|endoftext|>"]}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2))
    (folder / "reap_quant_recipe.json").write_text(json.dumps({"format": fmt, **asdict(s)}, indent=2))
    return folder


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Shape]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--format", action="append", choices=(*FORMATS, "all"), help="repeatable; default all")
    d = Shape()
    for field, default in asdict(d).items():
        ap.add_argument("--" + field.replace("_", "-"), type=int, default=default)
    a = ap.parse_args(argv)
    shape = Shape(**{f: getattr(a, f) for f in asdict(d)})
    return a, shape


def main(argv: list[str] | None = None) -> int:
    a, shape = parse_args(argv)
    formats = FORMATS if not a.format or "all" in a.format else tuple(dict.fromkeys(a.format))
    tiny = _tiny_moe()
    for fmt in formats:
        folder = write_format(a.out, fmt, shape, tiny)
        size = json.loads((folder / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
        print(f"{fmt}: {folder} ({size / 2**30:.2f} GiB)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
