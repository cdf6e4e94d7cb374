#!/usr/bin/env python3
"""Write a variant of the random GPU test model whose routers have a known, per-token-class skew.

Why: a random-weight MoE routes almost uniformly, so a residency plan cannot beat its resident
fraction on it. Issue #4 item 4 needs the same model with routing that is skewed in a documented
way and differs between prompt domains, so plans built from calibration prompts have something to
find. The construction is exact and small (README of the construction: `skew_construction.json`):

1. Token classes: every vocab id gets one of K=5 classes from its decoded string (`token_class`):
   lower (ASCII letters, all lower case), upper (ASCII letters with an upper-case one),
   punct (ASCII punctuation only), space (whitespace only), other (digits, mixed, bytes, added
   tokens, specials). Code and prose differ in their class mix (see `class_shares`).
2. Marker channels: the last K hidden channels d_0..d_4 are reserved. embed_tokens[t, d_c] = C
   for c = class(t) and 0 on the other reserved channels. Rows d_c of every o_proj and every
   expert's down_proj are zeroed, so no layer writes those channels: the residual stream keeps
   the embedding's value there, and every router sees its token's class marker.
3. Router bias: gate.weight[e, d_c] of layer l = A * rank_{l,c}(e)^(-z) * rho_l / C, where
   rank_{l,c} is a seeded random permutation of the experts (rank 1..E) per (layer, class) and
   rho_l the typical rms of the residual entering layer l's MoE (measured by
   research/sim/simulate_skew.py). The router's RMSNorm divides the marker by the token's rms, so the
   logit bias is ~ A * rank^(-z) in every layer, on top of the ~N(0, 0.9^2) random logits.

Everything else is byte-identical. Deterministic for a given --seed (permutations come from a CPU
torch.Generator). Streams one shard at a time; no GPU needed.

`--format fp8-block` writes the same skewed model in the format of the official
Qwen3-30B-A3B-FP8 checkpoint: every attention projection and every expert projection becomes
`weight` float8_e4m3fn + `weight_scale_inv` bf16 per 128x128 block, quantized from the skewed bf16
weights by scripts/make_quant_checkpoint.py's `fp8_block_quantize` (amax / 448 per block); the
routers, embeddings, norms and lm_head stay bf16 and config.json gets that writer's
`quantization_config` (quant_method fp8, weight_block_size [128, 128], the routers and lm_head in
modules_to_not_convert). The skew survives exactly: the router and the embedding markers are
untouched and the zeroed rows of o_proj / down_proj quantize to exact zeros.

Writing is parallel-safe: every file goes to a temporary name and is renamed into place, and
skew_construction.json (with the format) is written last, so a reader that finds it finds a
complete model; two writers of the same DST write identical bytes. Host memory: about
--workers x 2 shards (the shard read, its skewed copies and its FP8 output).

usage: make_skewed_moe.py SRC DST [--seed 0] [--amp 3] [--zipf 0.6] [--marker 0.125] [--format bf16]
       make_skewed_moe.py SRC DST --construction-only   # writes only DST/skew_construction.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import string
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from reap_swap.engine.vmm import contiguous_runs

CLASS_NAMES = ("lower", "upper", "punct", "space", "other")
CLASS_RULES = {
    "lower": "decoded.strip() is ASCII letters only, all lower case",
    "upper": "decoded.strip() is ASCII letters only, at least one upper case",
    "punct": "decoded.strip() non-empty and every char in string.punctuation",
    "space": "decoded.strip() == '' (whitespace / newlines / indentation)",
    "other": "everything else: digits, mixed pieces, non-ASCII bytes, added tokens w0.., specials",
}
# rms of the residual entering each layer's MoE of the 12-layer kit model (median over tokens),
# measured by research/sim/simulate_skew.py with this construction (research-notes/skew-simulation.json)
RHO_KIT = (0.3311, 0.8648, 1.3185, 1.6979, 2.0053, 2.2669, 2.5222, 2.7558, 2.9583, 3.1568, 3.3501, 3.5373)
DEFAULTS = {"seed": 0, "amp": 3.0, "zipf": 0.6, "marker": 0.125}
FORMATS = ("bf16", "fp8-block")
# the linears the real block-FP8 Qwen3-MoE checkpoints quantize (router, embeddings, lm_head: not)
_FP8_LINEAR = re.compile(
    r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.experts\.\d+\.(gate|up|down)_proj)\.weight$"
)
_PUNCT = set(string.punctuation)


def token_class(decoded: str) -> int:
    """Class id of one token's decoded string (rule: CLASS_RULES, in CLASS_NAMES order)."""
    s = decoded.strip()
    if s == "":
        return 3
    if s.isascii() and s.isalpha():
        return 0 if s.islower() else 1
    if all(ch in _PUNCT for ch in s):
        return 2
    return 4


def token_classes(tokenizer_json: str | os.PathLike) -> list[int]:
    """Class of every vocab id of a tokenizers `tokenizer.json` (specials decoded, not skipped)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    return [token_class(tok.decode([i], skip_special_tokens=False)) for i in range(tok.get_vocab_size())]


@dataclass
class Construction:
    """Everything the weight transformation needs; `describe()` is its JSON record."""

    hidden: int
    experts: int
    layers: int
    classes: torch.Tensor  # [vocab] int64 class id per token
    channels: list[int]  # reserved hidden channel of class c
    marker: float  # C, the embedding value on the own class channel
    amp: float
    zipf: float
    seed: int
    rho: list[float]  # per-layer rms compensation
    ranks: list[list[list[int]]] = field(default_factory=list)  # [l][c] -> experts by rank
    gate_cols: list[torch.Tensor] = field(default_factory=list)  # [l] -> [E, K] bf16

    def describe(self) -> dict:
        vocab = int(self.classes.numel())
        sizes = torch.bincount(self.classes, minlength=len(CLASS_NAMES)).tolist()
        return {
            "what": "router skew by token-class marker channels (scripts/make_skewed_moe.py)",
            "params": {
                "seed": self.seed,
                "amp_A": self.amp,
                "zipf_z": self.zipf,
                "marker_C": self.marker,
                "rho_per_layer": self.rho,
                "hidden": self.hidden,
                "experts": self.experts,
                "layers": self.layers,
                "vocab": vocab,
            },
            "formula": (
                "gate.weight[e, d_c] = bf16(A * rank_{l,c}(e)^(-z) * rho_l / C); "
                "logit bias ~= A * rank^(-z) * rho_l / rms(residual)"
            ),
            "channels": {n: ch for n, ch in zip(CLASS_NAMES, self.channels)},
            "zeroed_rows": "rows d_c of every self_attn.o_proj.weight and experts.*.down_proj.weight",
            "embedding": "embed_tokens[t, d_c] = C if class(t) == c else 0",
            "token_classes": {
                n: {
                    "rule": CLASS_RULES[n],
                    "size": sizes[c],
                    "ids": [
                        [first, first + count - 1]
                        for first, count in contiguous_runs((self.classes == c).nonzero().flatten().tolist())
                    ],
                }
                for c, n in enumerate(CLASS_NAMES)
            },
            "layers": [
                {
                    "layer": layer,
                    "rho": self.rho[layer],
                    "classes": {
                        n: {
                            "experts_by_rank": self.ranks[layer][c],
                            "gate_value_by_rank": [
                                float(v)
                                for v in self.gate_cols[layer][self.ranks[layer][c], c].float().tolist()
                            ],
                        }
                        for c, n in enumerate(CLASS_NAMES)
                    },
                }
                for layer in range(self.layers)
            ],
        }


def kit_prefix_rho(layers: int) -> list[float]:
    """RHO_KIT's first ``layers`` values: layer l of a causal stack sees only layers < l, so a
    reduced-depth kit model's layer l has the 12-layer model's residual rms entering it."""
    if not 1 <= layers <= len(RHO_KIT):
        raise ValueError(f"--rho kit-prefix: {layers} layers, RHO_KIT has {len(RHO_KIT)}")
    return list(RHO_KIT[:layers])


def build_construction(
    classes,
    *,
    hidden,
    experts,
    layers,
    seed=DEFAULTS["seed"],
    amp=DEFAULTS["amp"],
    zipf=DEFAULTS["zipf"],
    marker=DEFAULTS["marker"],
    rho=None,
) -> Construction:
    """Seeded per-(layer, class) permutations and the bf16 router column values."""
    k = len(CLASS_NAMES)
    if rho is None:
        rho = list(RHO_KIT) if layers == len(RHO_KIT) and all(RHO_KIT) else [1.0] * layers
    classes = torch.as_tensor(classes, dtype=torch.int64)
    con = Construction(
        hidden=hidden,
        experts=experts,
        layers=layers,
        classes=classes,
        channels=list(range(hidden - k, hidden)),
        marker=marker,
        amp=amp,
        zipf=zipf,
        seed=seed,
        rho=[float(r) for r in rho],
    )
    strength = amp * torch.arange(1, experts + 1, dtype=torch.float64) ** (-zipf)
    for layer in range(layers):
        cols = torch.zeros(experts, k, dtype=torch.float64)
        by_rank = []
        for c in range(k):
            g = torch.Generator().manual_seed(seed * 1_000_003 + layer * 101 + c)
            perm = torch.randperm(experts, generator=g)  # perm[r] = expert of rank r+1
            cols[perm, c] = strength * con.rho[layer] / marker
            by_rank.append(perm.tolist())
        con.ranks.append(by_rank)
        con.gate_cols.append(cols.to(torch.bfloat16))
    return con


_LAYER = re.compile(
    r"model\.layers\.(\d+)\.(self_attn\.o_proj\.weight|mlp\.gate\.weight|"
    r"mlp\.experts\.\d+\.down_proj\.weight)$"
)


def skew_tensors(tensors: dict[str, torch.Tensor], con: Construction) -> dict[str, torch.Tensor]:
    """Pure: the skewed version of a shard's tensors (untouched tensors are the same objects)."""
    ch = torch.tensor(con.channels)
    out = dict(tensors)
    for name, t in tensors.items():
        if name == "model.embed_tokens.weight":
            t = t.clone()
            t[:, ch] = 0
            rows = torch.arange(t.shape[0])
            t[rows, ch[con.classes[: t.shape[0]]]] = torch.tensor(con.marker, dtype=t.dtype)
            out[name] = t
            continue
        m = _LAYER.match(name)
        if not m:
            continue
        layer, kind = int(m.group(1)), m.group(2)
        t = t.clone()
        if kind == "mlp.gate.weight":
            t[:, ch] = con.gate_cols[layer].to(t.dtype)
        else:  # o_proj / down_proj: nothing writes d_c
            t[ch, :] = 0
        out[name] = t
    return out


def class_shares(tokenizer_json, classes, corpus_jsonl) -> dict:
    """Per corpus domain: token count and the share of its tokens in each class."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    cls = torch.as_tensor(classes)
    counts: dict[str, torch.Tensor] = {}
    for line in open(corpus_jsonl):
        r = json.loads(line)
        ids = torch.tensor(tok.encode(r["text"]).ids, dtype=torch.int64)
        c = torch.bincount(cls[ids], minlength=len(CLASS_NAMES))
        counts[r["source"]] = counts.get(r["source"], 0) + c
    return {
        d: {
            "tokens": int(c.sum()),
            **{n: round(float(c[i]) / float(c.sum()), 4) for i, n in enumerate(CLASS_NAMES)},
        }
        for d, c in sorted(counts.items())
    }


def _quant_writer():
    """scripts/make_quant_checkpoint.py as a module (its quantizer and quantization_config)."""
    name = "make_quant_checkpoint"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def fp8_block_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pure: a (skewed) bf16 shard in block FP8 (module doc); the other tensors are the same objects."""
    quantize = _quant_writer().fp8_block_quantize
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if _FP8_LINEAR.match(name):
            out[name], out[name + "_scale_inv"] = quantize(t)
        else:
            out[name] = t
    return out


def fp8_block_config(cfg: dict) -> dict:
    """config.json of the block-FP8 model: the source's, with make_quant_checkpoint's fp8-block
    quantization_config for its depth."""
    q = _quant_writer().quantization_config("fp8-block", int(cfg["num_hidden_layers"]))
    return {**cfg, "quantization_config": q}


def _atomic_write(path: Path, write) -> None:
    """write(tmp) then rename into place: a reader sees the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _link_or_copy(src: Path, dst: Path) -> None:
    def put(tmp: Path) -> None:
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copy2(src, tmp)

    _atomic_write(dst, put)


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    ap.add_argument("--amp", type=float, default=DEFAULTS["amp"], help="A (logit units)")
    ap.add_argument("--zipf", type=float, default=DEFAULTS["zipf"], help="Zipf exponent z")
    ap.add_argument("--marker", type=float, default=DEFAULTS["marker"], help="C")
    ap.add_argument(
        "--format", choices=FORMATS, default="bf16", help="bf16 (as SRC) or fp8-block (Qwen3-30B-A3B-FP8)"
    )
    ap.add_argument(
        "--corpus",
        default=str(Path(__file__).resolve().parent.parent / "data/corpus/calibration.jsonl"),
        help="jsonl (text, source) for the per-domain class shares, if present",
    )
    ap.add_argument(
        "--construction-only", action="store_true", help="write only DST/skew_construction.json (no weights)"
    )
    ap.add_argument("--workers", type=int, default=4, help="shards in flight")
    ap.add_argument(
        "--rho",
        choices=("auto", "kit-prefix"),
        default="auto",
        help="auto: RHO_KIT at 12 layers, else 1.0; kit-prefix: RHO_KIT[:layers] (a reduced-depth kit "
        "model gets the first layers' compensation of the 12-layer one)",
    )
    return ap.parse_args(argv)


def write_weights(src: Path, dst: Path, con: Construction, fmt: str, workers: int, t0: float) -> None:
    """Every shard skewed (and quantized for fp8-block), then the other files of SRC; fp8-block
    also gets its own config.json and index (new tensor names, new total size)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    index = json.loads((src / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))

    def one(name: str) -> dict[str, int]:
        with safe_open(src / name, framework="pt") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        out = skew_tensors(tensors, con)
        if fmt == "fp8-block":
            out = fp8_block_tensors(out)
        _atomic_write(dst / name, lambda tmp: save_file(out, tmp, metadata=meta))
        return {k: v.numel() * v.element_size() for k, v in out.items()}

    weight_map: dict[str, str] = {}
    total = 0
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for name, sizes in zip(shards, pool.map(one, shards)):
            weight_map.update(dict.fromkeys(sizes, name))
            total += sum(sizes.values())
            print(f"{name} written ({time.time() - t0:.1f}s)", flush=True)
    own = {"config.json", "model.safetensors.index.json"} if fmt == "fp8-block" else set()
    for p in src.iterdir():
        if p.is_file() and p.name not in shards and p.name not in own and p.name != "skew_construction.json":
            _link_or_copy(p, dst / p.name)
    if fmt == "fp8-block":
        doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        cfg = fp8_block_config(json.loads((src / "config.json").read_text()))
        for fname, obj in (("model.safetensors.index.json", doc), ("config.json", cfg)):
            _atomic_write(dst / fname, lambda tmp, obj=obj: tmp.write_text(json.dumps(obj, indent=1)))


def main(argv=None) -> int:
    a = _parse(argv)
    t0 = time.time()
    src, dst = Path(a.src), Path(a.dst)
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    classes = token_classes(src / "tokenizer.json")
    if len(classes) != cfg["vocab_size"]:
        sys.exit(f"tokenizer has {len(classes)} ids, config vocab_size {cfg['vocab_size']}")
    con = build_construction(
        classes,
        hidden=cfg["hidden_size"],
        experts=cfg.get("num_experts") or cfg["num_local_experts"],
        layers=cfg["num_hidden_layers"],
        seed=a.seed,
        amp=a.amp,
        zipf=a.zipf,
        marker=a.marker,
        rho=kit_prefix_rho(cfg["num_hidden_layers"]) if a.rho == "kit-prefix" else None,
    )
    desc = con.describe()
    desc["format"] = a.format
    if Path(a.corpus).is_file():
        desc["corpus_class_shares"] = {
            "corpus": str(a.corpus),
            **class_shares(src / "tokenizer.json", classes, a.corpus),
        }
    if not a.construction_only:
        write_weights(src, dst, con, a.format, a.workers, t0)
    desc["seconds"] = round(time.time() - t0, 1)
    text = json.dumps(desc, indent=1)
    _atomic_write(dst / "skew_construction.json", lambda tmp: tmp.write_text(text))  # last: complete
    summary = {n: v["size"] for n, v in desc["token_classes"].items()}
    params = {k: desc["params"][k] for k in ("amp_A", "zipf_z", "marker_C", "seed")}
    print(
        json.dumps(
            {
                "dst": str(dst),
                "format": a.format,
                "seconds": desc["seconds"],
                "class_sizes": summary,
                **params,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
