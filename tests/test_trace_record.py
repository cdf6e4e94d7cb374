"""trace_record: the recorder's steps are the model's own routing (checked against one full
forward of prompt + generated tokens), one prefill step then one step per decode token."""

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from reap_swap.engine.trace_recorder import record_trace  # noqa: E402
from reap_swap.sizing.model_shape import read_model_shape  # noqa: E402

MODEL = Path(__file__).resolve().parents[1] / "models" / "reap-mini-moe"


def test_recorded_steps_match_a_full_forward():
    shape = read_model_shape(MODEL)
    tok = transformers.AutoTokenizer.from_pretrained(MODEL)
    prompts = [
        ("python", tok("def add(a, b):\n    return a + b\n")["input_ids"]),
        ("prose", tok("The cat sat")["input_ids"]),
    ]
    trace = record_trace(str(MODEL), prompts, shape, decode_tokens=5, source={"test": True}, progress=False)
    assert trace.num_requests == 2 and trace.num_steps == 2 * 5
    assert trace.request_tags == ("python", "prose")
    n0 = len(prompts[0][1])
    assert trace.step_offsets[1] == n0 and trace.num_tokens == n0 + len(prompts[1][1]) + 2 * 4
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    # request 0: greedy continuation, then one forward over all routed tokens
    ids = list(prompts[0][1])
    with torch.inference_mode():
        for _ in range(4):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        out = model(input_ids=torch.tensor([ids]), output_router_logits=True)
    full = torch.stack([r.reshape(len(ids), -1) for r in out.router_logits], dim=1)
    want = np.sort(torch.topk(full, shape.top_k, dim=-1).indices.numpy(), axis=-1)
    got = np.sort(trace.topk_ids[: trace.step_offsets[5]].astype(np.int64), axis=-1)
    assert np.array_equal(got, want)


def test_observe_write_trace_compares_prefill_with_the_counters(tmp_path):
    """observe --trace's hook: writes a loadable trace in corpus order and records how many prefill
    selections differ from the counters it is given (here an independent full forward)."""
    import argparse

    from reap_swap.cache.trace import load_trace
    from reap_swap.engine.observer import _write_trace
    from reap_swap.planner.corpus import CorpusRecord
    from reap_swap.planner.observed_counts import CountAccumulator

    shape = read_model_shape(MODEL)
    tok = transformers.AutoTokenizer.from_pretrained(MODEL)
    texts = [(2, "c", "int main(void) { return 0; }"), (1, "prose", "It was a dark and stormy night")]
    tokenized = [(CorpusRecord(line, tag, None, text), tok(text)["input_ids"]) for line, tag, text in texts]
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    counts = np.zeros((len(shape.moe_layers), shape.num_experts), dtype=np.int64)
    with torch.inference_mode():
        for _, ids in tokenized:
            out = model(input_ids=torch.tensor([ids]), output_router_logits=True)
            for l, r in enumerate(out.router_logits):
                np.add.at(
                    counts[l],
                    torch.topk(r.reshape(len(ids), -1), shape.top_k, dim=-1).indices.numpy().ravel(),
                    1,
                )
    total = CountAccumulator()
    total.add(sum(len(ids) for _, ids in tokenized), {l: {"counts": counts[l]} for l in shape.moe_layers})
    args = argparse.Namespace(
        model=str(MODEL), trace=tmp_path / "t.npz", trace_decode_tokens=3, progress=False
    )
    _write_trace(args, shape, tokenized, {"name": "x.jsonl"}, total)
    trace = load_trace(args.trace)
    assert trace.request_tags == ("prose", "c")  # corpus (line) order
    assert trace.num_steps == 2 * 3
    assert trace.source["prefill_selections_differing_from_vllm"] == 0
    assert trace.source["lines"] == [1, 2] and trace.source["corpus"] == {"name": "x.jsonl"}
    moved = counts.copy()
    e_from = int(np.flatnonzero(moved[0])[0])
    moved[0, e_from] -= 1
    moved[0, (e_from + 1) % shape.num_experts] += 1
    total2 = CountAccumulator()
    total2.add(total.tokens, {l: {"counts": moved[l]} for l in shape.moe_layers})
    _write_trace(args, shape, tokenized, {"name": "x.jsonl"}, total2)
    assert load_trace(args.trace).source["prefill_selections_differing_from_vllm"] == 1
