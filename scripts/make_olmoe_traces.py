"""Issue 42 test-data maker: public OLMoE decode routing -> reap-swap routing traces (reap_swap.cache.trace).

Source: the real decode routing of allenai/OLMoE-1B-7B-0924 (16 MoE layers x 64 experts, top-8,
bf16, greedy decode of at most 128 tokens) over 400 prompts in four domains, published in the
GitHub repository ``helloimrizy-pages/opt`` under
``stage3_residency/traces/full/chunks/{general,coding,math,reasoning}/sequence_NNNN.npz`` (+
``.metadata.json``), schema ``olmoe_decode_atomic_routing_v1``: one event per (decode token, MoE
layer) in token-major order, ``requested_expert_ids[event, 8]`` (router rank order) with
``layer_index``, ``generated_token_index``, ``sequence_id``, ``prompt_index`` per event. Prompt
(prefill) routing is not in the source: every event is one decode forward (the token fed back).

Data fetched from that repository is not committed here (this workplace's rule): run the script on
a git snapshot (``fetch`` tool: a bare git dir, read with ``git show``) or on a checkout's chunks
folder, and write the traces under /tmp. The raw npz read from a git dir are extracted to --raw.

    .venv/bin/python scripts/make_olmoe_traces.py --source /work/.mirror/helloimrizy-pages+opt/repo \\
        --range 20:45 --per-domain --out /tmp/olmoe/traces/olmoe-eval25.npz

Mapping: one source sequence = one request (tag ``<domain>/<sequence_NNNN>``), one decode token =
one step of one token. reap-swap marks a request's first step as its prefill; here that step is the
first decode token (no prompt was routed), so the ``decode_*`` counters leave out one token per
request and the totals are the ones comparable with the source. ``--range A:B`` takes the files
A..B-1 of each domain in file order (the source's own evaluation split is 20:100: its first 20
prompts per domain calibrate, cache_policy replays the rest). ``--per-domain`` writes one trace
per domain (``<out stem>-<domain>.npz``: a cache that starts cold per domain, as the source's
stationary workloads), otherwise one trace with the domains one after another. Provenance (repo,
commit, every path with its git blob and sha256, schema, the command) goes into each trace's
``meta.source`` and ``<out stem>.provenance.json``.

``--observations FILE.pt`` also writes the routed selections of the written traces per layer as a
reap-swap observation file and ``--model-config FILE.json`` OLMoE's MoE shape (for ``reap-swap
plan --observations FILE.pt --model FILE.json``): use them on a calibration range only (0:20),
never on the range replayed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

SCHEMA = "olmoe_decode_atomic_routing_v1"
REPO = "helloimrizy-pages/opt"
CHUNKS = "stage3_residency/traces/full/chunks"
DOMAINS = ("general", "coding", "math", "reasoning")
MODEL = "allenai/OLMoE-1B-7B-0924"
# allenai/OLMoE-1B-7B-0924 config.json, the fields reap_swap.sizing.model_shape reads (16 layers, 64
# experts of width 1024, top-8, hidden 2048, bf16: 3 x 2048 x 1024 x 2 B = 12,582,912 B per expert,
# equal to the source's expert_bytes_by_layer).
OLMOE_CONFIG = {
    "architectures": ["OlmoeForCausalLM"],
    "model_type": "olmoe",
    "hidden_size": 2048,
    "intermediate_size": 1024,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "vocab_size": 50304,
    "torch_dtype": "bfloat16",
}
_SEQ = re.compile(r"^sequence_(\d+)\.npz$")


class SourceError(ValueError):
    """A source file that does not follow the schema (the message names the file and field)."""


def _git(git_dir: Path, *args: str) -> bytes:
    return subprocess.run(["git", "--git-dir", str(git_dir), *args], check=True, capture_output=True).stdout


def is_git_dir(path: Path) -> bool:
    return (path / "objects").is_dir() and (path / "HEAD").is_file()


def list_sequences(source: Path, commit: str | None, domain: str) -> list[str]:
    """The domain's ``sequence_NNNN.npz`` paths (relative to the chunks folder), in file order."""
    if is_git_dir(source):
        out = _git(source, "ls-tree", "--name-only", f"{commit}:{CHUNKS}/{domain}").decode()
        names = out.split()
    else:
        folder = source / domain if (source / domain).is_dir() else source / CHUNKS / domain
        names = [p.name for p in folder.iterdir()] if folder.is_dir() else []
    found = sorted(n for n in names if _SEQ.match(n))
    if not found:
        raise SourceError(f"{source}: no {domain}/sequence_NNNN.npz found")
    return [f"{domain}/{n}" for n in found]


def materialize(source: Path, commit: str | None, rel: str, raw: Path) -> tuple[Path, Path, dict]:
    """(npz, metadata.json, provenance entry) of one sequence; from a git dir they are extracted to ``raw``."""
    entry: dict = {"path": f"{CHUNKS}/{rel}"}
    meta_rel = rel[: -len(".npz")] + ".metadata.json"
    if is_git_dir(source):
        paths = []
        for r in (rel, meta_rel):
            dest = raw / r
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(_git(source, "show", f"{commit}:{CHUNKS}/{r}"))
            paths.append(dest)
        entry["blob"] = _git(source, "rev-parse", f"{commit}:{CHUNKS}/{rel}").decode().strip()
        npz, meta = paths
    else:
        folder = source if (source / rel).is_file() else source / CHUNKS
        npz, meta = folder / rel, folder / meta_rel
    entry["sha256"] = hashlib.sha256(npz.read_bytes()).hexdigest()
    return npz, meta, entry


def read_sequence(npz: Path, meta_path: Path) -> tuple[np.ndarray, dict]:
    """One source sequence -> ([decode tokens, layers, top_k] expert ids, its manifest entry)."""
    meta = json.loads(meta_path.read_text())
    with np.load(npz, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    schema = str(np.asarray(arrays.get("schema_version", "")).item())
    if schema != SCHEMA or meta.get("schema_version") != SCHEMA:
        raise SourceError(f"{npz}: schema {schema!r} / {meta.get('schema_version')!r}, expected {SCHEMA}")
    seqs = meta.get("sequences") or []
    if len(seqs) != 1:
        raise SourceError(f"{meta_path}: sequences lists {len(seqs)} entries, expected 1")
    seq = seqs[0]
    layers = [int(x) for x in meta["layer_indices"]]
    top_k, num_experts = int(meta["top_k"]), int(meta["num_experts"])
    ids = np.asarray(arrays["requested_expert_ids"])
    gen = int(seq["generation_length"])
    n = gen * len(layers)
    if ids.shape != (n, top_k):
        raise SourceError(f"{npz}: requested_expert_ids {ids.shape}, expected {(n, top_k)}")
    if not np.array_equal(arrays["event_index"], np.arange(n)):
        raise SourceError(f"{npz}: event_index is not 0..{n - 1}")
    if not np.array_equal(arrays["layer_index"], np.tile(layers, gen)):
        raise SourceError(f"{npz}: layer_index is not token-major over layers {layers}")
    if not np.array_equal(arrays["generated_token_index"], np.repeat(np.arange(gen), len(layers))):
        raise SourceError(f"{npz}: generated_token_index is not 0..{gen - 1} per layer")
    if np.any(arrays["sequence_id"] != int(seq["sequence_id"])):
        raise SourceError(f"{npz}: sequence_id differs from the metadata's {seq['sequence_id']}")
    if ids.min() < 0 or ids.max() >= num_experts:
        raise SourceError(f"{npz}: expert id outside [0, {num_experts})")
    info = {
        "layers": layers,
        "top_k": top_k,
        "num_experts": num_experts,
        "sequence_id": int(seq["sequence_id"]),
        "domain": str(seq["domain"]),
        "prompt_index": int(seq["prompt_index"]),
        "prompt_length": int(seq["prompt_length"]),
        "generation_length": gen,
        "per_expert_bytes": sorted({int(b) for row in meta["expert_bytes_by_layer"] for b in np.ravel(row)}),
    }
    return ids.reshape(gen, len(layers), top_k), info


def _parse_range(text: str) -> tuple[int, int]:
    a, sep, b = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"--range {text}: expected START:STOP (e.g. 20:45)")
    start, stop = int(a or 0), int(b)
    if not 0 <= start < stop:
        raise argparse.ArgumentTypeError(f"--range {text}: need 0 <= START < STOP")
    return start, stop


def build(
    source: Path,
    domains: Sequence[str],
    start: int,
    stop: int,
    *,
    commit: str | None = None,
    raw: Path | None = None,
    repo: str = REPO,
):
    """{domain: Trace} for files start..stop-1 of each domain, and the provenance document."""
    from reap_swap.cache.trace import from_requests

    source = Path(source)
    if is_git_dir(source):
        commit = _git(source, "rev-parse", f"{commit or 'HEAD'}^{{commit}}").decode().strip()
        raw = Path(raw or "/tmp/olmoe/raw") / commit[:12]
    files, traces, shape = [], {}, None
    for domain in domains:
        rels = list_sequences(source, commit, domain)
        if stop > len(rels):
            raise SourceError(f"--range {start}:{stop}: {domain} has {len(rels)} sequences")
        requests, tags, seq_meta = [], [], []
        for rel in rels[start:stop]:
            npz, meta_path, entry = materialize(source, commit, rel, raw)
            routed, info = read_sequence(npz, meta_path)
            if info["domain"] != domain:
                raise SourceError(f"{npz}: domain {info['domain']!r} in the {domain} folder")
            here = (
                tuple(info["layers"]),
                info["top_k"],
                info["num_experts"],
                tuple(info["per_expert_bytes"]),
            )
            if shape is None:
                shape = here
            elif here != shape:
                raise SourceError(f"{npz}: shape {here} differs from the first file's {shape}")
            requests.append([routed[i : i + 1] for i in range(len(routed))])
            tags.append(f"{domain}/{Path(rel).stem}")
            seq_meta.append(
                {k: info[k] for k in ("sequence_id", "prompt_index", "prompt_length", "generation_length")}
            )
            files.append(entry)
        traces[domain] = (requests, tags, seq_meta)
    layers, top_k, num_experts, per_expert = shape
    if len(per_expert) != 1:
        raise SourceError(f"expert_bytes_by_layer holds several sizes {per_expert}; a trace has one")
    provenance = {
        "repo": repo,
        "url": f"https://github.com/{repo}",
        "commit": commit,
        "chunks": CHUNKS,
        "schema": SCHEMA,
        "model": MODEL,
        "range": [start, stop],
        "domains": list(domains),
        "mapping": "one sequence = one request; one decode token = one step of one token; step 0 of a "
        "request is its first decode token (prompt routing is not in the source)",
        "command": shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv[0] else "",
    }
    out = {}
    for domain, (requests, tags, seq_meta) in traces.items():
        out[domain] = from_requests(
            requests,
            layers=layers,
            model=MODEL,
            num_experts=num_experts,
            top_k=top_k,
            per_expert_bytes=per_expert[0],
            request_tags=tags,
            source={**provenance, "domains": [domain], "sequences": seq_meta},
        )
    return out, {**provenance, "files": files}


def concat(traces: Sequence, source: dict):
    """One trace of several (same model), requests one after another."""
    from reap_swap.cache.trace import from_requests

    first = traces[0]
    requests = []
    for t in traces:
        for r in range(t.num_requests):
            a, b = t.step_offsets[t.request_offsets[r]], t.step_offsets[t.request_offsets[r + 1]]
            requests.append([t.topk_ids[i : i + 1] for i in range(a, b)])
    seqs = [s for t in traces for s in t.source.get("sequences", [])]
    return from_requests(
        requests,
        layers=first.layers,
        model=first.model,
        num_experts=first.num_experts,
        top_k=first.top_k,
        per_expert_bytes=first.per_expert_bytes,
        request_tags=[tag for t in traces for tag in t.request_tags],
        source={**source, "sequences": seqs},
    )


def write_observations(path: Path, traces: Sequence, source: dict) -> None:
    """Routed selections per layer over every step of ``traces`` as a reap-swap observation file."""
    from reap_swap.planner.observation_types import LayerStats
    from reap_swap.planner.observations import save_observations

    first = traces[0]
    stats = {}
    for l in first.layers:
        freq = sum(t.step_counts(l).sum(0).astype(np.int64) for t in traces)
        stats[l] = LayerStats(total_tokens=sum(t.num_tokens for t in traces), expert_frequency=freq)
    meta = {
        "model": MODEL,
        "from": f"{source['repo']}@{source['commit']} {source['range']} decode selections",
    }
    save_observations(path, stats, meta=meta)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--source", type=Path, required=True, help="bare git dir of the repo, or its chunks folder"
    )
    ap.add_argument("--commit", help="git revision (git source only; default HEAD)")
    ap.add_argument("--repo", default=REPO, help="owner/name recorded as provenance")
    ap.add_argument("--raw", type=Path, default=Path("/tmp/olmoe/raw"), help="where git blobs are extracted")
    ap.add_argument("--domains", nargs="+", default=list(DOMAINS), choices=DOMAINS)
    ap.add_argument("--range", type=_parse_range, default=(20, 45), help="files START:STOP of each domain")
    ap.add_argument("--out", type=Path, required=True, help="trace .npz (with --per-domain: the stem)")
    ap.add_argument("--per-domain", action="store_true", help="one trace per domain (cold start per domain)")
    ap.add_argument("--observations", type=Path, help="also write the routed counts as observations (.pt)")
    ap.add_argument("--model-config", type=Path, help="also write OLMoE's config.json shape here")
    args = ap.parse_args(argv)

    from reap_swap.cache.trace import save_trace

    start, stop = args.range
    per, provenance = build(
        args.source, args.domains, start, stop, commit=args.commit, raw=args.raw, repo=args.repo
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    written = []
    if args.per_domain:
        for domain, trace in per.items():
            path = args.out.with_name(f"{args.out.stem}-{domain}.npz")
            save_trace(path, trace)
            written.append((path, trace))
    else:
        src = {k: v for k, v in provenance.items() if k != "files"}
        trace = concat(list(per.values()), src)
        save_trace(args.out, trace)
        written.append((args.out, trace))
    provenance["outputs"] = [
        {
            "file": str(p),
            "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
            "requests": t.num_requests,
            "steps": t.num_steps,
        }
        for p, t in written
    ]
    doc = args.out.with_name(f"{args.out.stem}.provenance.json")
    doc.write_text(json.dumps(provenance, indent=1) + "\n")
    if args.observations is not None:
        write_observations(args.observations, [t for _, t in written], provenance)
    if args.model_config is not None:
        args.model_config.write_text(json.dumps(OLMOE_CONFIG, indent=1) + "\n")
    for p, t in written:
        print(f"wrote {p}: {t.num_requests} requests, {t.num_steps:,} steps, {len(t.layers)} layers")
    print(f"wrote {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
