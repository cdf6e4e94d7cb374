"""Shared by the quantized-checkpoint tests (test_make_quant_checkpoint, test_quant_budget,
test_skewed_fp8): the tiny shape their checkpoints are written at, the writers' flags for a
shape, and the safetensors headers read without the tensor data."""

import json
import struct
from pathlib import Path

TINY = dict(
    layers=2,
    hidden=256,
    moe_intermediate=128,
    experts=4,
    top_k=2,
    heads=4,
    kv_heads=2,
    head_dim=64,
    vocab=384,
)


def shape_args(shape: dict) -> list[str]:
    """make_quant_checkpoint.py's flags for a shape: --hidden 256 --moe-intermediate 128 ..."""
    return [x for k, v in shape.items() for x in ("--" + k.replace("_", "-"), str(v))]


def file_header(path: Path) -> dict:
    """One .safetensors file's JSON header (__metadata__ included)."""
    with path.open("rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        return json.loads(fh.read(n))


def headers(folder: Path) -> dict:
    """name -> (dtype, shape) over the folder's .safetensors files."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        meta = file_header(f)
        out.update({k: (v["dtype"], tuple(v["shape"])) for k, v in meta.items() if k != "__metadata__"})
    return out
