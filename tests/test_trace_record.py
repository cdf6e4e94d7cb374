"""trace_record: the recorder's steps are the model's own routing (checked against one full
forward of prompt + generated tokens), one prefill step then one step per decode token."""

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from reap_swap.model_shape import read_model_shape  # noqa: E402
from reap_swap.trace_record import record_trace  # noqa: E402

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
