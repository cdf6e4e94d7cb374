"""The skewed model in block FP8 (scripts/make_skewed_moe.py --format fp8-block), and what the bench
makes of it: same tensors as make_quant_checkpoint's fp8-block writer (whose names are checked
against vLLM's expert mapping in test_make_quant_checkpoint.py), the skew intact after
quantization, FP8 bytes in the model shape, the plan and the stock-UVA offload. CPU, tiny shapes."""

from __future__ import annotations

import hashlib
import json

import pytest
from quant_files import TINY, file_header, headers, shape_args
from script_modules import load_script

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")
pytest.importorskip("tokenizers")

from reap_swap.bench import arms as bench_arms  # noqa: E402
from reap_swap.bench import config as bench_config  # noqa: E402
from reap_swap.bench.report import GIB  # noqa: E402
from reap_swap.plan.document import PlanError, load_plan  # noqa: E402
from reap_swap.sizing.model_shape import read_model_shape  # noqa: E402
from reap_swap.sizing.quant.budget import pool_slots  # noqa: E402
from reap_swap.sizing.quant.scheme import scheme_from_config  # noqa: E402

msk = load_script("make_skewed_moe")
mqc = load_script("make_quant_checkpoint")

TINY_ARGS = shape_args(TINY)


def _dequant(q, scale, block=128):
    s = scale.float().repeat_interleave(block, 0).repeat_interleave(block, 1)
    return q.float() * s[: q.shape[0], : q.shape[1]]


def test_fp8_block_quantize_blocks_scales_and_zeros():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(300, 260, generator=g) * 0.05).to(torch.bfloat16)
    w[7] = 0  # a zero row inside a block (the skew's zeroed o_proj / down_proj rows)
    w[256:, 256:] = 0  # an all-zero (padded) corner block
    q, scale = mqc.fp8_block_quantize(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and q.is_contiguous()
    assert scale.dtype == torch.bfloat16 and scale.shape == (3, 3)
    assert scale[2, 2] == 1.0 and (q[7].float() == 0).all() and (q[256:, 256:].float() == 0).all()
    deq, wf = _dequant(q, scale), w.float()
    for bo in range(3):
        for bi in range(3):
            blk = (slice(bo * 128, (bo + 1) * 128), slice(bi * 128, (bi + 1) * 128))
            amax = wf[blk].abs().max()
            assert (deq[blk] - wf[blk]).abs().max() <= amax / 16 + 1e-7  # e4m3: 3 mantissa bits
            if amax > 0:  # the block's largest value lands near 448 (scale = amax / 448, in bf16)
                assert 440 <= q[blk].float().abs().max() <= 448
    q2, s2 = mqc.fp8_block_quantize(w.clone())
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, scale)


def _load_all(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(st.load_file(f))
    return out


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """bf16 source (make_quant_checkpoint), its fp8-block sibling, and the skewed FP8 model twice."""
    root = tmp_path_factory.mktemp("skewfp8")
    assert mqc.main(["--out", str(root), "--format", "bf16", "--format", "fp8-block", *TINY_ARGS]) == 0
    for d in ("a", "b"):
        args = [str(root / "bf16"), str(root / d), "--format", "fp8-block", "--corpus", "/nonexistent"]
        assert msk.main([*args, "--workers", "2", "--seed", "5"]) == 0
    assert (
        msk.main([str(root / "bf16"), str(root / "skew16"), "--corpus", "/nonexistent", "--seed", "5"]) == 0
    )
    return root


def test_same_tensors_and_config_as_the_fp8_block_writer(written):
    got, want = headers(written / "a"), headers(written / "fp8-block")
    assert got == want  # names, dtypes (F8_E4M3 weights, BF16 weight_scale_inv, BF16 router), shapes
    assert got["model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv"] == ("BF16", (1, 2))
    assert got["model.layers.1.mlp.gate.weight"][0] == "BF16"
    cfg = json.loads((written / "a" / "config.json").read_text())
    assert cfg["quantization_config"] == mqc.quantization_config("fp8-block", TINY["layers"])
    src_cfg = json.loads((written / "bf16" / "config.json").read_text())
    assert {k: v for k, v in cfg.items() if k != "quantization_config"} == src_cfg
    scheme = scheme_from_config(cfg["quantization_config"])
    assert (scheme.kind, scheme.bits) == ("fp8", 8)
    index = json.loads((written / "a" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(got)
    for name, shard in index["weight_map"].items():
        assert name in file_header(written / "a" / shard)
    tensors = _load_all(written / "a")
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    desc = json.loads((written / "a" / "skew_construction.json").read_text())
    assert desc["format"] == "fp8-block" and desc["params"]["seed"] == 5
    assert not [p for p in (written / "a").iterdir() if ".tmp" in p.name]


def test_deterministic(written):
    for p in sorted((written / "a").iterdir()):
        if p.name != "skew_construction.json":
            assert (
                hashlib.sha256(p.read_bytes()).digest()
                == hashlib.sha256((written / "b" / p.name).read_bytes()).digest()
            )


def test_the_skew_survives_quantization(written):
    fp8, bf16 = _load_all(written / "a"), _load_all(written / "skew16")
    desc = json.loads((written / "a" / "skew_construction.json").read_text())
    ch = list(desc["channels"].values())
    assert ch == list(range(TINY["hidden"] - 5, TINY["hidden"]))
    n_fp8 = 0
    for name, t in bf16.items():
        if name + "_scale_inv" not in fp8:  # router, embeddings, norms, lm_head: the bf16 skew itself
            assert fp8[name].dtype == torch.bfloat16 and torch.equal(fp8[name], t), name
            continue
        n_fp8 += 1
        q, scale = fp8[name], fp8[name + "_scale_inv"]
        assert q.dtype == torch.float8_e4m3fn
        deq = _dequant(q, scale)
        assert (deq - t.float()).abs().max() <= scale.float().max() * 448 / 16 + 1e-7, name
        if name.endswith(("o_proj.weight", "down_proj.weight")):  # nothing writes the marker channels
            assert (q[ch, :].float() == 0).all(), name
    per_layer = 4 + 3 * TINY["experts"]
    assert n_fp8 == TINY["layers"] * per_layer


def test_model_shape_plan_and_stock_uva_count_fp8_bytes(written, tmp_path):
    shape, shape16 = read_model_shape(written / "a"), read_model_shape(written / "skew16")
    h, i, e, layers = TINY["hidden"], TINY["moe_intermediate"], TINY["experts"], TINY["layers"]
    assert shape.expert_bytes == 3 * h * i and shape16.expert_bytes == 2 * shape.expert_bytes
    total = shape.total_expert_bytes
    assert total == layers * e * 3 * h * i
    plan_path = _plan(tmp_path / "plan.json", shape, core=1, budget_experts=layers * e // 2)
    plan = load_plan(str(plan_path), shape)
    with pytest.raises(PlanError):  # a plan made on the bf16 sibling is refused: re-plan
        load_plan(str(_plan(tmp_path / "p16.json", shape16, core=1, budget_experts=4)), shape)
    budgets = [total * 0.25 / GIB, total * 0.5 / GIB]
    cfg = bench_config.BenchConfig(
        model=str(written / "a"),
        plan=plan_path,
        prompts=tmp_path / "p.jsonl",
        out=tmp_path / "out",
        arms=["stock-uva", "plan-swap"],
        budget_gib=budgets,
    )
    runs = bench_arms.plan_runs(cfg, plan, shape, total, "cuda", timing_on=True)
    assert [r.arm for r in runs] == ["stock-uva", "stock-uva", "plan-swap", "plan-swap"]
    for r in runs:
        frac = r.budget_bytes / total
        assert frac == pytest.approx(0.25, abs=1e-6) or frac == pytest.approx(0.5, abs=1e-6)
        if r.arm == "stock-uva":
            gb = float(r.argv[r.argv.index("--cpu-offload-gb") + 1])
            assert gb * GIB == pytest.approx(total - r.budget_bytes, abs=GIB * 1e-6)  # FP8 bytes
            assert r.argv[r.argv.index("--cpu-offload-params") + 1 :][:2] == ["w13_weight", "w2_weight"]
        else:
            derived = load_plan(str(r.plan_path), shape)
            assert pool_slots(derived.swappable_budget_bytes, derived.per_expert_bytes) == round(
                frac * layers * e
            )


def _plan(path, shape, core: int, budget_experts: int):
    """A valid plan for `shape`: the first `core` experts of each layer, slices of 1 over the rest."""
    per = shape.expert_bytes
    per_layer = {
        f"layer_{layer}": {
            "rawLayerKey": str(layer),
            "numExperts": shape.num_experts,
            "coreExperts": list(range(core)),
            "coreByteCost": core * per,
            "sliceCatalog": [
                {"sliceId": f"layer_{layer}_slice_{x:02d}", "experts": [x], "byteCost": per}
                for x in range(core, shape.num_experts)
            ],
        }
        for layer in shape.moe_layers
    }
    core_bytes = core * per * len(shape.moe_layers)
    doc = {
        "mode": "dynamic_core_specialist",
        "model": "m",
        "budget": {
            "per_expert_bytes": per,
            "swappable_expert_budget_bytes": budget_experts * per,
            "core_budget_bytes": core_bytes,
            "specialist_budget_bytes": budget_experts * per - core_bytes,
            "max_refreshes_per_request": 4,
        },
        "perLayer": per_layer,
    }
    path.write_text(json.dumps(doc))
    return path
