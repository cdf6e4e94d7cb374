"""scripts/make_olmoe_traces.py on synthetic sequences in the source schema (olmoe_decode_atomic_routing_v1).

The real files (helloimrizy-pages/opt) are not in the tree; these build a few small ones in
tmp_path: a chunks folder, and a git repository holding it (the form the converter reads from a
fetched snapshot).
"""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest
from script_modules import load_script

from reap_swap.cache.replay import simulate
from reap_swap.cache.trace import load_trace

mk = load_script("make_olmoe_traces")

LAYERS, E, K = (0, 1, 2), 8, 2


def _write_seq(folder, domain, domain_id, seq_id, prompt_index, gen, rng, **override):
    """One sequence_NNNN.npz + .metadata.json as the source writes them (token-major events)."""
    n = gen * len(LAYERS)
    ids = np.stack([rng.choice(E, size=K, replace=False) for _ in range(n)]).astype(np.int16)
    arrays = {
        "schema_version": np.asarray(mk.SCHEMA),
        "event_index": np.arange(n, dtype=np.int64),
        "sequence_id": np.full(n, seq_id, dtype=np.int32),
        "domain_id": np.full(n, domain_id, dtype=np.int8),
        "prompt_index": np.full(n, prompt_index, dtype=np.int32),
        "generated_token_index": np.repeat(np.arange(gen), len(LAYERS)).astype(np.int32),
        "layer_index": np.tile(LAYERS, gen).astype(np.int16),
        "requested_expert_ids": ids,
        "router_weights": np.full((n, K), 0.5, dtype=np.float32),
        "token_id": np.zeros(n, dtype=np.int32),
        "prompt_length": np.full(n, 5, dtype=np.int32),
        "generation_length": np.full(n, gen, dtype=np.int32),
    }
    arrays.update(override)
    meta = {
        "schema_version": mk.SCHEMA,
        "domains": ["general", "coding"],
        "layer_indices": list(LAYERS),
        "num_experts": E,
        "top_k": K,
        "expert_bytes_by_layer": [[96] * E for _ in LAYERS],
        "sequences": [
            {
                "sequence_id": seq_id,
                "domain": domain,
                "domain_id": domain_id,
                "prompt_index": prompt_index,
                "prompt_length": 5,
                "generation_length": gen,
            }
        ],
    }
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(folder / f"sequence_{seq_id:04d}.npz", **arrays)
    (folder / f"sequence_{seq_id:04d}.metadata.json").write_text(json.dumps(meta))
    return ids.reshape(gen, len(LAYERS), K)


@pytest.fixture
def chunks(tmp_path):
    """A repo-like tree: 2 domains x 3 sequences of 4..6 decode tokens; returns (root, routed)."""
    rng = np.random.default_rng(0)
    root = tmp_path / "repo"
    routed = {}
    for d, domain in enumerate(("general", "coding")):
        for p in range(3):
            sid = 100 * d + p
            routed[sid] = _write_seq(root / mk.CHUNKS / domain, domain, d, sid, p, 4 + p, rng)
    return root, routed


def test_chunks_folder_per_domain(chunks, tmp_path):
    root, routed = chunks
    out = tmp_path / "out" / "t.npz"
    assert mk.main(["--source", str(root), "--domains", "general", "coding", "--range", "1:3",
                    "--per-domain", "--out", str(out)]) == 0  # fmt: skip
    for d, domain in enumerate(("general", "coding")):
        t = load_trace(out.with_name(f"t-{domain}.npz"))
        assert t.num_requests == 2 and t.num_steps == 5 + 6 and t.num_tokens == 11
        assert t.layers == LAYERS and t.top_k == K and t.num_experts == E and t.per_expert_bytes == 96
        assert t.request_tags == (
            f"{domain}/sequence_{100 * d + 1:04d}",
            f"{domain}/sequence_{100 * d + 2:04d}",
        )
        want = np.concatenate([routed[100 * d + 1], routed[100 * d + 2]])
        np.testing.assert_array_equal(t.topk_ids, want)
        assert t.source["schema"] == mk.SCHEMA and t.source["repo"] == mk.REPO and t.source["range"] == [1, 3]
        assert [s["sequence_id"] for s in t.source["sequences"]] == [100 * d + 1, 100 * d + 2]
    prov = json.loads(out.with_name("t.provenance.json").read_text())
    assert [f["path"] for f in prov["files"]][0] == f"{mk.CHUNKS}/general/sequence_0001.npz"
    assert all(len(f["sha256"]) == 64 for f in prov["files"]) and len(prov["outputs"]) == 2


def test_git_source_records_commit_and_blobs(chunks, tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    root, routed = chunks
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "chunks"], check=True)
    head = subprocess.run(
        [*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()
    traces, prov = mk.build(root / ".git", ["coding"], 0, 3, raw=tmp_path / "raw")
    assert prov["commit"] == head and len(prov["files"]) == 3
    assert all(len(f["blob"]) == 40 for f in prov["files"])
    assert (tmp_path / "raw" / head[:12] / "coding" / "sequence_0102.npz").is_file()
    np.testing.assert_array_equal(
        traces["coding"].topk_ids, np.concatenate([routed[s] for s in (100, 101, 102)])
    )
    one = mk.concat([traces["coding"]], prov)  # the single-trace form: the same requests in order
    assert one.num_requests == 3 and one.request_tags == traces["coding"].request_tags


def test_refuses_reordered_layers(tmp_path):
    rng = np.random.default_rng(1)
    folder = tmp_path / "general"
    _write_seq(folder, "general", 0, 0, 0, 2, rng, layer_index=np.asarray([0, 2, 1, 0, 1, 2], dtype=np.int16))
    with pytest.raises(mk.SourceError, match="layer_index"):
        mk.build(tmp_path, ["general"], 0, 1)


def _atomic_lru_misses(t, capacity: int) -> int:
    """The source study's LRU (stage3_residency policies.py: cold start, every requested expert
    admitted, the rest kept by last use then lower id), over the trace's tokens in order."""
    misses = 0
    for col in range(len(t.layers)):
        resident, last = set(), {}
        for clock, row in enumerate(t.topk_ids[:, col, :]):
            req = {int(e) for e in row}
            misses += len(req - resident)
            last.update(dict.fromkeys(req, clock))
            old = sorted(resident - req, key=lambda e: (-last[e], e))
            resident = req | set(old[: capacity - len(req)])
    return misses


def test_simulated_lru_is_the_atomic_lru(chunks, tmp_path):
    """With capacity >= top_k and one token per step, reap-swap's lru is the source's atomic LRU."""
    root, _ = chunks
    traces, _ = mk.build(root, ["general"], 0, 3)
    t = traces["general"]
    for budget, cap in (("0.25", 2), ("0.5", 4)):
        row = simulate(t, None, [budget], ["lru"])["rows"][0]
        assert set(row["slots"].values()) == {cap}
        tot = row["totals"]
        assert tot["selections"] - tot["selection_hits"] == _atomic_lru_misses(t, cap)
