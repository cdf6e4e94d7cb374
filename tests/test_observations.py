"""Observation files: REAP's exact layout is read; ours round-trips; plan/evaluate CLIs on files."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from reap_swap.cli import main as cli
from reap_swap.planner.observation_types import LayerStats, RecordCounts
from reap_swap.planner.observations import META_KEY, ObservationError, load_observations, save_observations

E, H, TOP_K, LAYERS = 16, 32, 2, 4


def tiny_config(tmp_path):
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": E,
        "num_hidden_layers": LAYERS,
        "hidden_size": H,
        "num_experts_per_tok": TOP_K,
        "moe_intermediate_size": 16,
        "torch_dtype": "bfloat16",
    }
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def reap_layer_state(gen: torch.Generator, tokens: int, super_expert: int | None) -> dict:
    """What CerebrasResearch/reap's MoETransformerObserver.report_state holds for one layer, computed
    from a simulated forward: random router, random linear experts, softmax gate weights."""
    x = torch.randn(tokens, H, generator=gen)
    router = torch.randn(E, H, generator=gen) * 0.5
    experts = torch.randn(E, H, H, generator=gen) * 0.1
    if super_expert is not None:
        experts[super_expert] *= 200.0
    logits = x @ router.T
    selected = torch.topk(logits, TOP_K, dim=-1).indices
    weights = torch.softmax(logits, dim=-1)
    out = torch.einsum("th,ekh->etk", x, experts)  # [E, T, H]
    freq = torch.bincount(selected.view(-1), minlength=E)
    state = {
        "total_tokens": torch.tensor(tokens, dtype=torch.long),
        "expert_frequency": freq.to(torch.long),
        "pairwise_expert_frequency": (freq[None, :] + freq[:, None]).to(torch.long),
        "ttm_similarity_matrix": torch.rand(E, E, generator=gen),
        "routed_characteristic_activation": torch.rand(E, H, generator=gen),
        "characteristic_activation": torch.rand(E, H, generator=gen),
        "online_characteristic_activation_dist": torch.rand(E, E, generator=gen),
        "router_logit_similiarity": torch.rand(E, E, generator=gen),
        "ean_sum": torch.zeros(E, dtype=torch.float64),
        "weighted_ean_sum": torch.zeros(E, dtype=torch.float64),
        "ean_mean": torch.zeros(E, dtype=torch.float32),
        "reap": torch.zeros(E, dtype=torch.float32),
        "weighted_expert_frequency_sum": torch.zeros(E, dtype=torch.float64),
        "max_activations": torch.zeros(E, dtype=torch.float32),
    }
    for e in range(E):
        mask = (selected == e).any(dim=-1)
        if not mask.any():
            continue
        norms = out[e, mask].norm(dim=-1)
        g = weights[mask, e]
        state["ean_sum"][e] = norms.sum()
        state["ean_mean"][e] = norms.mean()
        state["weighted_ean_sum"][e] = (norms * g).sum()
        state["reap"][e] = (norms * g).mean()
        state["weighted_expert_frequency_sum"][e] = g.sum()
        state["max_activations"][e] = out[e, mask].max()
    return state


@pytest.fixture()
def reap_file(tmp_path):
    gen = torch.Generator().manual_seed(5)
    state = {layer: reap_layer_state(gen, 64, 3 if layer == 1 else None) for layer in range(LAYERS)}
    path = tmp_path / "observations_calib.pt"
    with open(path, "wb") as f:  # as REAP's save_state does
        torch.save(state, f)
    return path, state


def test_reads_reap_exact_layout(reap_file):
    path, state = reap_file
    obs = load_observations(path)
    assert obs.fmt == "reap" and sorted(obs.layers) == list(range(LAYERS))
    assert "pairwise_expert_frequency" in obs.fields and "reap" in obs.fields
    layer = obs.layers[1]
    assert layer.total_tokens == 64 and layer.raw_key == "1"
    assert np.array_equal(layer.expert_frequency, state[1]["expert_frequency"].numpy())
    assert layer.expert_frequency.sum() == 64 * TOP_K
    assert layer.coactivation is None  # pairwise_expert_frequency is freq[i] + freq[j], never co-activation
    assert np.allclose(layer.reap, state[1]["reap"].numpy())
    assert np.allclose(layer.max_activations, state[1]["max_activations"].numpy())
    assert obs.tags == {} and obs.records is None
    import hashlib

    assert obs.digest == hashlib.sha256(path.read_bytes()).hexdigest()


def test_plan_from_reap_file_validates_and_is_byte_identical(reap_file, tmp_path, capsys):
    path, state = reap_file
    model = tiny_config(tmp_path)
    out1, out2 = tmp_path / "p1.json", tmp_path / "p2.json"
    args = ["plan", "--observations", str(path), "--model", str(model), "--budget-ratio", "0.4"]
    assert cli.main(args + ["--out", str(out1)]) == 0
    assert cli.main(args + ["--out", str(out2)]) == 0
    assert out1.read_bytes() == out2.read_bytes()
    assert cli.main(["validate", str(out1), "--model", str(model)]) == 0
    doc = json.loads(out1.read_bytes())
    assert doc["scorerArtifacts"]["inputs"][0]["format"] == "reap"
    assert doc["scorerArtifacts"]["sliceMethod"] == "frequency_rank_buckets"
    # the planted super expert (layer 1, expert 3) is core even if rarely routed
    assert doc["scorerArtifacts"]["superExperts"] == {"layer_1": [3]}
    assert 3 in doc["perLayer"]["layer_1"]["coreExperts"]
    assert all("reapMass" in s for s in doc["perLayer"]["layer_0"]["sliceCatalog"])
    # a different budget is a different plan; the file digest pins the inputs
    assert cli.main(args[:-1] + ["0.5", "--out", str(out2)]) == 0
    assert out1.read_bytes() != out2.read_bytes()
    # wrong model shape: refused with a message, exit 1
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(
        (model / "config.json").read_text().replace('"num_experts": 16', '"num_experts": 32')
    )
    assert (
        cli.main(
            [
                "plan",
                "--observations",
                str(path),
                "--model",
                str(bad),
                "--budget-ratio",
                "0.4",
                "--out",
                str(tmp_path / "p3.json"),
            ]
        )
        == 1
    )
    assert "32" in capsys.readouterr().err


def make_ours(seed: int, records: int = 5):
    rng = np.random.default_rng(seed)
    per_record = []
    layers_rec = []
    for _ in range(records):
        tokens = int(rng.integers(3, 20))
        layer_counts, tops = [], []
        for _layer in range(LAYERS):
            top = np.argsort(-rng.normal(size=(tokens, E)), axis=1)[:, :TOP_K]
            tops.append(top)
            layer_counts.append(np.bincount(top.ravel(), minlength=E))
        per_record.append(layer_counts)
        layers_rec.append((tokens, tops))
    layers = {}
    for layer in range(LAYERS):
        top = np.concatenate([t[layer] for _, t in layers_rec])
        onehot = np.zeros((top.shape[0], E), dtype=np.int64)
        np.put_along_axis(onehot, top, 1, axis=1)
        freq = onehot.sum(axis=0)
        layers[layer] = LayerStats(top.shape[0], freq, freq * 0.5, onehot.T @ onehot, raw_key=str(layer))
    rec = RecordCounts(
        tuple(range(LAYERS)),
        np.array(per_record),
        tuple("ab"[i % 2] for i in range(records)),
        np.array([t for t, _ in layers_rec]),
        np.arange(1, records + 1),
    )
    return layers, rec


def test_our_format_round_trips(tmp_path):
    layers, rec = make_ours(1)
    path = tmp_path / "obs.pt"
    digest = save_observations(
        path, layers, tags={"a": layers}, records=rec, meta={"model": "tiny", "top_k": TOP_K, "records": 5}
    )
    obs = load_observations(path)
    assert obs.fmt == "reap-swap" and obs.digest == digest
    assert obs.meta["model"] == "tiny" and obs.meta["records"] == 5
    for i in range(LAYERS):
        assert np.array_equal(obs.layers[i].coactivation, layers[i].coactivation)
        assert np.allclose(obs.layers[i].weighted_frequency, layers[i].weighted_frequency)
        assert np.array_equal(obs.tags["a"][i].expert_frequency, layers[i].expert_frequency)
    assert np.array_equal(obs.records.counts, rec.counts) and obs.records.tags == rec.tags
    raw = torch.load(path, weights_only=True)  # plain tensors/containers: safe loader suffices
    assert set(raw) == set(range(LAYERS)) | {META_KEY}
    assert set(raw[0]) == {
        "total_tokens",
        "expert_frequency",
        "weighted_expert_frequency_sum",
        "coactivation",
    }
    assert raw[0]["total_tokens"].dim() == 0 and raw[0]["expert_frequency"].dtype == torch.long
    only = tmp_path / "reap_only.pt"
    save_observations(only, layers, reap_layout_only=True)
    assert set(torch.load(only, weights_only=True)) == set(range(LAYERS))


def test_evaluate_cli_on_per_request_file(tmp_path, capsys):
    layers, rec = make_ours(2, records=8)
    calib, held = tmp_path / "calib.pt", tmp_path / "held.pt"
    save_observations(calib, layers, records=rec)
    layers2, rec2 = make_ours(3, records=8)
    save_observations(held, layers2, records=rec2)
    model = tiny_config(tmp_path)
    plan = tmp_path / "plan.json"
    assert (
        cli.main(
            [
                "plan",
                "--observations",
                str(calib),
                "--model",
                str(model),
                "--budget-ratio",
                "0.5",
                "--out",
                str(plan),
            ]
        )
        == 0
    )
    assert json.loads(plan.read_bytes())["scorerArtifacts"]["sliceMethod"] == "coactivation_greedy_ochiai"
    report_path = tmp_path / "report.json"
    assert (
        cli.main(
            [
                "evaluate",
                "--plan",
                str(plan),
                "--observations",
                str(held),
                "--model",
                str(model),
                "--out",
                str(report_path),
            ]
        )
        == 0
    )
    report = json.loads(report_path.read_bytes())
    o = report["overall"]
    assert o["requests"] == 8 and o["selections"] == int(rec2.counts.sum())
    assert 0 < o["core"] <= o["core_plus_slices"] <= o["oracle_per_request"] <= 1
    assert "oracle" in capsys.readouterr().out


def test_malformed_files_are_refused_with_the_field(tmp_path):
    bad = tmp_path / "bad.pt"
    torch.save({0: {"total_tokens": torch.tensor(3)}}, bad)
    with pytest.raises(ObservationError, match="expert_frequency"):
        load_observations(bad)
    torch.save([1, 2, 3], bad)
    with pytest.raises(ObservationError, match="expected a dict"):
        load_observations(bad)
    torch.save({"mlp": {"expert_frequency": torch.zeros(4)}}, bad)
    with pytest.raises(ObservationError, match="not a layer index"):
        load_observations(bad)
    torch.save(
        {
            0: {
                "total_tokens": torch.tensor(3),
                "expert_frequency": torch.zeros(4),
                "coactivation": torch.zeros(4, 5),
            }
        },
        bad,
    )
    with pytest.raises(ObservationError, match="coactivation"):
        load_observations(bad)
    assert cli.main(["evaluate", "--plan", str(tmp_path / "none.json"), "--observations", str(bad)]) == 1
