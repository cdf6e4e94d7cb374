"""Routing traces of a (reduced-depth) skewed kit model on the CPU, and the plans the simulator uses.

    python3 /work/shared/gpu-kit/mk_model.py /tmp/skewtrace/model --layers 3 --seed 0
    PYTHONPATH=$PWD python scripts/make_skewed_moe.py /tmp/skewtrace/model /tmp/skewtrace/skew \
        --rho kit-prefix --workers 1
    PYTHONPATH=$PWD python research/sim/record_skew_trace.py --model /tmp/skewtrace/skew   # ~5 min, 1 core

No vLLM server or engine: ``reap-swap observe --trace`` starts vLLM for its prefill counters and
then loads the model a second time in transformers (reap_swap/engine/trace_recorder.py), two copies that do
not fit beside the CI on this machine. Here only the recorder runs (bfloat16, the H200's serving
dtype), on the prompts of ``record_mini_trace.cut_corpus`` (first --per-domain records of each
domain, <= --chars characters, prefill + --decode-tokens greedy tokens per request) of both splits:

1. calibration and held-out traces -> OUT/skew-<split>.npz (uint8 expert ids);
2. an observation file from the calibration trace's *prefill* steps (what vLLM's counters count
   in ``reap-swap observe``) -> ``reap-swap plan`` at 12.5 / 25 / 50 % of expert bytes (core
   fraction 0.75, as the mini MoE's plans) -> OUT/plan-<ratio>.json;
3. OUT/params.json: the model construction (mk_model / make_skewed_moe parameters and seeds,
   skew_construction.json's params and digest), the corpus cut and the commands.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record_mini_trace import CLI, ROOT, cut_corpus  # noqa: E402

BUDGETS = ("0.125", "0.25", "0.5")
SPLITS = ("calibration", "heldout")


def prefill_layer_stats(trace) -> dict:
    """{layer: LayerStats} of the trace's prefill steps only (one per request)."""
    from reap_swap.planner.observation_types import LayerStats

    starts = trace.request_first_steps()
    tokens = int(np.diff(trace.step_offsets)[starts].sum())
    return {
        l: LayerStats(
            total_tokens=tokens, expert_frequency=trace.step_counts(l)[starts].sum(0).astype(np.int64)
        )
        for l in trace.layers
    }


def record_split(args, split: str, shape, tokenizer):
    from reap_swap.cache.trace import save_trace
    from reap_swap.engine.trace_recorder import record_trace
    from reap_swap.planner.corpus import read_corpus, tokenize_records

    cut = args.out / f".{split}-prompts.jsonl"
    n = cut_corpus(split, args.per_domain, args.chars, cut)
    records, issues = read_corpus(cut)
    tokenized, tok_issues = tokenize_records(tokenizer, records, 2048)
    if issues or tok_issues:
        sys.exit(f"{split}: corpus issues {issues + tok_issues}")
    trace = record_trace(
        str(args.model),
        [(rec.tag or "", ids) for rec, ids in tokenized],
        shape,
        decode_tokens=args.decode_tokens,
        source={"corpus": f"data/corpus/{split}.jsonl", "per_domain": args.per_domain, "chars": args.chars},
        dtype=args.dtype,
    )
    save_trace(args.out / f"skew-{split}.npz", trace)
    cut.unlink()
    print(f"{split}: {n} prompts, {trace.num_steps} steps, {trace.num_tokens} tokens", flush=True)
    return trace


def plans(args, calib) -> None:
    from reap_swap.planner.observations import save_observations

    obs = args.out / ".calibration-prefill.pt"
    save_observations(
        obs,
        prefill_layer_stats(calib),
        meta={"model": str(args.model), "from": "skew-calibration.npz prefill"},
    )
    for ratio in BUDGETS:
        cmd = CLI + ["plan", "--observations", str(obs), "--model", str(args.model), "--model-name",
                     "skew-kit", "--budget-ratio", ratio, "--core-fraction", "0.75",
                     "--out", str(args.out / f"plan-{ratio}.json")]  # fmt: skip
        subprocess.run(cmd, cwd=ROOT, check=True)
    obs.unlink()


def write_params(args) -> None:
    """OUT/params.json: how to rebuild the model and the traces (module doc)."""
    from reap_swap.planner.observations import file_digest

    con = json.loads((args.model / "skew_construction.json").read_text())
    info = json.loads((args.model / "kit_model_info.json").read_text())
    mk = {k: info[k] for k in ("layers", "experts", "topk", "hidden", "moe_intermediate", "vocab")}
    params = {
        "mk_model": {**mk, "seed": 0, "generator": "torch CPU (on a GPU host mk_model draws on CUDA: other values)"},
        "make_skewed_moe": {**con["params"], "format": con.get("format"), "rho": "kit-prefix"},
        "skew_construction_sha256": file_digest(args.model / "skew_construction.json"),
        "trace": {
            "splits": list(SPLITS),
            "per_domain": args.per_domain,
            "chars": args.chars,
            "decode_tokens": args.decode_tokens,
            "dtype": args.dtype,
            "threads": args.threads,
            "prompts": "record_mini_trace.cut_corpus(split, per_domain, chars), text records, tokenizer's specials",
        },
        "plans": {"budgets": list(BUDGETS), "core_fraction": 0.75, "from": "skew-calibration.npz prefill counts"},
        "commands": [" ".join(line.split()).replace("\\ ", "") for line in __doc__.split("\n\n")[1].splitlines()],
    }  # fmt: skip
    (args.out / "params.json").write_text(json.dumps(params, indent=1) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="make_skewed_moe.py output")
    ap.add_argument("--out", type=Path, default=ROOT / "research-notes/cache-sim/skew")
    ap.add_argument("--per-domain", type=int, default=8)
    ap.add_argument("--chars", type=int, default=600)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a CI shares this machine)")
    ap.add_argument("--params-only", action="store_true", help="only (re)write OUT/params.json")
    args = ap.parse_args()
    if args.params_only:
        write_params(args)
        return 0
    import torch
    from transformers import AutoTokenizer

    from reap_swap.sizing.model_shape import read_model_shape

    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    shape = read_model_shape(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    traces = {}
    for split in SPLITS:
        traces[split] = record_split(args, split, shape, tokenizer)
        gc.collect()  # the split's model copy goes before the next one loads (peak is within a split)
    plans(args, traces["calibration"])
    write_params(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
