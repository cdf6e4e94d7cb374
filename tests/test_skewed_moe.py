"""scripts/make_skewed_moe.py: the skew construction on a tiny synthetic checkpoint (CPU, ~1 MB)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from script_modules import load_script

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")
tokenizers = pytest.importorskip("tokenizers")

msk = load_script("make_skewed_moe")

H, E, L, I = 32, 8, 2, 16
WORDS = ["<unk>", "the", "The", "(", "==", "\t", "42", "x1", "def", "ABC", ";", "é"]
CLASSES = [4, 0, 1, 2, 2, 3, 4, 4, 0, 1, 2, 4]


def _tensors(seed=0):
    """A Qwen3-MoE-named tiny checkpoint: shard 1 = embeddings, shard l+2 = layer l."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*s):
        return (torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16)

    shards = {
        1: {
            "model.embed_tokens.weight": rnd(len(WORDS), H),
            "lm_head.weight": rnd(len(WORDS), H),
            "model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
        }
    }
    for layer in range(L):
        p = f"model.layers.{layer}."
        t = {
            p + "input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
            p + "self_attn.q_proj.weight": rnd(64, H),
            p + "self_attn.o_proj.weight": rnd(H, 64),
            p + "mlp.gate.weight": rnd(E, H),
        }
        for e in range(E):
            t[f"{p}mlp.experts.{e}.gate_proj.weight"] = rnd(I, H)
            t[f"{p}mlp.experts.{e}.up_proj.weight"] = rnd(I, H)
            t[f"{p}mlp.experts.{e}.down_proj.weight"] = rnd(H, I)
        shards[layer + 2] = t
    return shards


def _con(**kw):
    return msk.build_construction(CLASSES, hidden=H, experts=E, layers=L, **kw)


def test_token_class_rule():
    assert [msk.token_class(w) for w in WORDS] == CLASSES
    assert msk.token_class(" foo") == 0 and msk.token_class("\n    ") == 3
    assert msk.token_class("") == 3 and msk.token_class("w12") == 4
    assert msk.token_class("<|im_end|>") == 4


def test_construction_is_seeded_zipf():
    a, b, c = _con(seed=3), _con(seed=3), _con(seed=4)
    assert a.ranks == b.ranks and all(torch.equal(x, y) for x, y in zip(a.gate_cols, b.gate_cols))
    assert a.ranks != c.ranks
    rho = [0.5, 2.0]
    con = _con(amp=6.0, zipf=0.5, marker=0.125, rho=rho)
    for layer in range(L):
        for k in range(len(msk.CLASS_NAMES)):
            assert sorted(con.ranks[layer][k]) == list(range(E))
            for r, e in enumerate(con.ranks[layer][k]):
                want = torch.tensor(6.0 * (r + 1) ** -0.5 * rho[layer] / 0.125).to(torch.bfloat16)
                assert con.gate_cols[layer][e, k] == want
    # different permutations per layer and per class
    assert con.ranks[0][0] != con.ranks[1][0] and con.ranks[0][0] != con.ranks[0][1]


def test_skew_tensors_exact():
    con = _con(rho=[0.5, 2.0])
    ch = con.channels
    assert ch == list(range(H - 5, H))
    for shard in _tensors().values():
        before = {k: v.clone() for k, v in shard.items()}
        out = msk.skew_tensors(shard, con)
        assert all(torch.equal(before[k], shard[k]) for k in shard)  # input untouched
        assert out.keys() == shard.keys()
        for name, t in out.items():
            mask = torch.ones_like(t, dtype=torch.bool)
            if name == "model.embed_tokens.weight":
                for tok, c in enumerate(CLASSES):
                    want = torch.zeros(5, dtype=t.dtype)
                    want[c] = 0.125
                    assert torch.equal(t[tok, ch], want)
                mask[:, ch] = False
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                assert (t[ch, :] == 0).all()
                mask[ch, :] = False
            elif name.endswith("mlp.gate.weight"):
                layer = int(name.split(".")[2])
                assert torch.equal(t[:, ch], con.gate_cols[layer])
                mask[:, ch] = False
            else:
                assert t is shard[name]
            assert torch.equal(t[mask], shard[name][mask])  # rest identical


def _write_ckpt(root: Path) -> Path:
    from tokenizers import Tokenizer, models

    src = root / "src"
    src.mkdir()
    wmap = {}
    shards = _tensors()
    n = len(shards)
    for i, t in shards.items():
        name = f"model-{i:05d}-of-{n:05d}.safetensors"
        st.save_file(t, src / name, metadata={"format": "pt"})
        wmap.update({k: name for k in t})
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))
    (src / "config.json").write_text(
        json.dumps({"vocab_size": len(WORDS), "hidden_size": H, "num_experts": E, "num_hidden_layers": L})
    )
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.save(str(src / "tokenizer.json"))
    (src / "tokenizer_config.json").write_text("{}")
    (root / "corpus.jsonl").write_text(
        json.dumps({"text": "the", "source": "prose"})
        + "\n"
        + json.dumps({"text": "def", "source": "python"})
        + "\n"
    )
    return src


def _digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_cli_end_to_end_deterministic(tmp_path):
    src = _write_ckpt(tmp_path)
    corpus = str(tmp_path / "corpus.jsonl")
    for d in ("a", "b"):
        assert (
            msk.main([str(src), str(tmp_path / d), "--seed", "7", "--corpus", corpus, "--workers", "2"]) == 0
        )
    a, b = tmp_path / "a", tmp_path / "b"
    names = sorted(p.name for p in src.iterdir())
    assert sorted(p.name for p in a.iterdir()) == sorted(names + ["skew_construction.json"])
    for name in names:
        assert _digest(a / name) == _digest(b / name)
    con = msk.build_construction(CLASSES, hidden=H, experts=E, layers=L, seed=7)
    for name in names:
        if not name.endswith(".safetensors"):
            assert (a / name).read_bytes() == (src / name).read_bytes()
            continue
        got, orig = st.load_file(a / name), st.load_file(src / name)
        want = msk.skew_tensors(orig, con)
        assert got.keys() == orig.keys()
        assert all(torch.equal(got[k], want[k]) for k in got)
    desc = json.loads((a / "skew_construction.json").read_text())
    assert desc["params"]["seed"] == 7 and desc["params"]["rho_per_layer"] == [1.0, 1.0]
    assert {n: v["size"] for n, v in desc["token_classes"].items()} == {
        "lower": 2,
        "upper": 2,
        "punct": 3,
        "space": 1,
        "other": 4,
    }
    assert desc["token_classes"]["other"]["ids"] == [[0, 0], [6, 7], [11, 11]]
    assert desc["layers"][1]["classes"]["punct"]["experts_by_rank"] == con.ranks[1][2]
    assert desc["corpus_class_shares"]["prose"]["lower"] == 1.0
    desc_b = json.loads((b / "skew_construction.json").read_text())
    desc.pop("seconds"), desc_b.pop("seconds")
    assert desc == desc_b


def test_construction_only_writes_no_weights(tmp_path):
    src = _write_ckpt(tmp_path)
    dst = tmp_path / "doc"
    assert msk.main([str(src), str(dst), "--construction-only", "--corpus", "/nonexistent"]) == 0
    assert [p.name for p in dst.iterdir()] == ["skew_construction.json"]
    assert "corpus_class_shares" not in json.loads((dst / "skew_construction.json").read_text())
